"""The dynamic draft tree (EAGLE-2): grow it from the draft, select the best nodes, mask its attention.

`draft_tree` expands the `topk` best nodes per depth by cumulative draft log-probability for `depth`
levels and keeps the `budget` best nodes overall; `DraftTree` holds the result in verification order
(root first, parents before children) with the ancestor mask the target's verify pass attends through.
`specdraft.decode.rules.accept_tree` walks it after verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.decode.runners import Drafter


@dataclass
class DraftTree:
    """A draft tree in verification order: node 0 is the root (x_{n-1}), nodes 1.. the selected drafts."""

    tokens: list[int]  # target token id per node
    parents: list[int]  # parent node index (-1 for the root)
    depths: list[int]  # 0 for the root, j for the j-th draft token of a path

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """Child indices per node, in node order (nodes are sorted best draft score first within a depth)."""
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, par in enumerate(self.parents):
            if par >= 0:
                out[par].append(i)
        return out

    def mask(self) -> torch.Tensor:
        """bool (N, N): node i attends to itself and its ancestors."""
        return ancestor_mask(self.parents)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """bool (N, N) with [i, j] True iff j is i or an ancestor of i; parents[i] < i (or -1)."""
    N = len(parents)
    m = torch.zeros(N, N, dtype=torch.bool)
    for i, par in enumerate(parents):
        assert par < i, "parents must precede their children"
        m[i, i] = True
        if par >= 0:
            m[i] |= m[par]
    return m


def draft_tree(
    drafter: Drafter,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    root_token: int,
    base_pos: int,
    topk: int,
    depth: int,
    budget: int,
) -> DraftTree:
    """Grow a dynamic tree (EAGLE-2) from the draft's first output and select `budget` nodes.

    hidden (H,), logits (Vd,): the draft's output at the last context pair (predicting d_1); base_pos = n - 2,
    the draft position of that pair (a depth-j node is fed at base_pos + j). Scores are cumulative draft
    log-probabilities. Depth 1: the top-k tokens. Each further depth feeds the `topk` best nodes of the
    previous depth (the frontier) in one draft forward, each attending to the context and its own ancestors,
    and adds their top-k children (topk * topk candidates). Finally the `budget` best nodes of all candidates
    are kept: a child's score never exceeds its parent's, and ties sort the shallower first, so the kept set
    contains every kept node's ancestors. The draft's cache is left with the fed frontier nodes appended
    (the caller crops it back to the context).
    """
    K = min(topk, logits.shape[-1])
    tid = drafter.target_ids
    # candidate nodes: token (target id), parent (-1 = root), depth, score, hidden input for feeding
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    score: list[float] = []
    hin: list[torch.Tensor] = []
    logq = torch.log_softmax(logits.float(), dim=-1)  # (Vd,)
    top = logq.topk(K)
    for v, i in zip(top.values.tolist(), top.indices.tolist()):
        tok.append(int(tid[i]))
        par.append(-1)
        dep.append(1)
        score.append(v)
        hin.append(hidden)
    frontier = list(range(len(tok)))
    context = len(drafter)
    slot: dict[int, int] = {}  # node -> position in the draft cache
    for d in range(2, depth + 1):
        F_ = len(frontier)
        S = len(drafter)
        mask = torch.zeros(F_, S + F_, dtype=torch.bool)  # (F, S + F)
        mask[:, :context] = True
        for r, node in enumerate(frontier):
            a = par[node]
            while a >= 0:
                mask[r, slot[a]] = True
                a = par[a]
            mask[r, S + r] = True
        ids = torch.tensor([tok[n] for n in frontier])  # (F,)
        h_in = torch.stack([hin[n] for n in frontier])  # (F, H)
        pos = torch.full((F_,), base_pos + d - 1, dtype=torch.long)  # (F,)
        h_out, lg = drafter.step(ids, h_in, pos, mask)  # (F, H), (F, Vd)
        for r, node in enumerate(frontier):
            slot[node] = S + r
        lq = torch.log_softmax(lg.float(), dim=-1)  # (F, Vd)
        top = lq.topk(K, dim=-1)  # (F, K)
        cand = torch.tensor([score[n] for n in frontier])[:, None] + top.values.cpu()  # (F, K)
        first = len(tok)
        for r, node in enumerate(frontier):
            for c in range(K):
                tok.append(int(tid[top.indices[r, c]]))
                par.append(node)
                dep.append(d)
                score.append(float(cand[r, c]))
                hin.append(h_out[r])
        order = sorted(range(first, len(tok)), key=lambda n: (-score[n], n))
        frontier = sorted(order[:K])
    keep = sorted(range(len(tok)), key=lambda n: (-score[n], dep[n], n))[:budget]
    keep_set = set(keep)
    assert all(par[n] < 0 or par[n] in keep_set for n in keep), "selected tree is not ancestor-closed"
    keep.sort(key=lambda n: (dep[n], -score[n], n))  # by depth, best first: parents precede children
    index = {n: i + 1 for i, n in enumerate(keep)}
    return DraftTree(
        tokens=[root_token] + [tok[n] for n in keep],
        parents=[-1] + [0 if par[n] < 0 else index[par[n]] for n in keep],
        depths=[0] + [dep[n] for n in keep],
    )

"""Reference speculative decoding (EAGLE-3 chain and dynamic tree) with a transformers target and our draft.

One sequence at a time, any device, KV caches on both sides. The token stream is x_0 .. x_{n-1}: the prompt,
then accepted tokens; the last one, x_{n-1}, was produced by the target but not yet fed to it (the "root").

Alignment (as in training, see `specdraft.train.loop.ttt_unroll`): the draft at position t reads the fused aux
features f_t of the target at position t and the embedding of token x_{t+1}, and predicts x_{t+2}. So before
a round the draft's cache holds pairs (f_t, x_{t+1}) for t = 0 .. n-2 and its last output predicts x_n, the
first draft token d_1; draft token d_j is fed back at position n-2+j with the draft's own previous hidden
output instead of target features (training-time test steps).

A round:
  1. draft catch-up: feed the pairs the draft has not seen yet (target features of the tokens accepted in
     the previous round, captured by hooks on the target's aux layers during its verify forward);
  2. draft a chain of k tokens, or a dynamic tree (EAGLE-2: expand the `topk` best nodes per depth by
     cumulative draft log-probability for `depth` levels, keep the `budget` best nodes overall);
  3. verify: one target forward over [x_{n-1}, drafted tokens] (a tree attention mask for trees);
  4. accept a prefix / a root-to-node path, plus one bonus token from the target, roll both KV caches back
     to the accepted tokens (chain: crop; tree: keep the accepted path's positions in order).

Target positions held in its KV cache: x_0 .. x_{n-2}. Draft cache: pairs for t = 0 .. n-2 after catch-up.

Acceptance rules (`accept_chain`, `accept_tree`) are pure functions, tested against analytic rates.
Greedy (T = 0) accepts a draft token iff it equals the target's argmax, so the output equals target-only
greedy decoding token for token. Sampling (T > 0) keeps the target's distribution exactly (rules stated at
the code). Tree + sampling uses the recursive rejection rule for deterministic (top-k) candidates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdraft.model.draft import DraftKVCache, Eagle3Draft, draft_to_target_ids

# ---------------------------------------------------------------------------------------------------------
# settings and results
# ---------------------------------------------------------------------------------------------------------


@dataclass
class SpecConfig:
    """Settings of one speculative decoding run."""

    k: int = 5  # chain: draft tokens per round (ignored with tree=True)
    tree: bool = False  # draft a dynamic tree instead of a chain
    topk: int = 8  # tree: children expanded per node and nodes kept per depth
    depth: int = 6  # tree: maximum draft tokens along one path
    budget: int = 32  # tree: draft tokens verified per round (tree size without the root)
    temperature: float = 0.0  # 0 = greedy; > 0 = sampling with the exact rejection rule
    max_new_tokens: int = 128  # new tokens per prompt
    stop_ids: tuple[int, ...] = ()  # generation ends after any of these tokens (e.g. EOS)

    def __post_init__(self) -> None:
        problems = []
        if self.k < 1:
            problems.append(f"k must be >= 1, not {self.k}")
        if self.tree and (self.topk < 1 or self.depth < 1 or self.budget < 1):
            problems.append(
                f"tree needs topk, depth, budget >= 1 (got {self.topk}, {self.depth}, {self.budget})"
            )
        if self.temperature < 0 or not math.isfinite(self.temperature):
            problems.append(f"temperature must be >= 0, not {self.temperature}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, not {self.max_new_tokens}")
        if problems:
            raise ValueError("speculative decoding settings: " + "; ".join(problems))
        self.stop_ids = tuple(int(i) for i in self.stop_ids)

    @property
    def max_draft_depth(self) -> int:
        """The most draft tokens one round can accept."""
        return min(self.depth, self.budget) if self.tree else self.k


@dataclass
class GenResult:
    """One generation: new tokens and what it cost."""

    tokens: list[int]  # new tokens (cut at max_new_tokens and after the first stop id)
    target_forwards: int  # target forwards, the prefill included
    seconds: float  # wall-clock time of the whole generation
    accepted: list[int] = field(default_factory=list)  # per round: draft tokens accepted (before any cut)
    drafted: list[int] = field(default_factory=list)  # per round: draft tokens verified (chain k; tree size)

    @property
    def rounds(self) -> int:
        """Decoding rounds (target forwards after the prefill)."""
        return len(self.accepted) if self.accepted else max(0, self.target_forwards - 1)

    @property
    def tau(self) -> float:
        """Mean tokens per round: accepted draft tokens + the target's own token."""
        return sum(self.accepted) / len(self.accepted) + 1 if self.accepted else 1.0


# ---------------------------------------------------------------------------------------------------------
# the two models behind small interfaces (tests substitute stubs with fixed logits)
# ---------------------------------------------------------------------------------------------------------


class TargetRunner(Protocol):
    """A causal LM with a KV cache over the accepted tokens x_0 .. x_{n-2}."""

    def reset(self) -> None: ...

    def __len__(self) -> int: ...  # cached positions

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions (T,); tree_mask bool (T, T) among the new tokens, or (T, S_past + T) over the cache
        too (None = causal), True = attend -> fp32 logits
        (T, V) or (1, V) with last_only, and the aux features (T, A) of the new tokens (None if not captured).
        The new tokens are appended to the cache."""
        ...

    def keep(self, n_past: int, index: torch.Tensor) -> None:
        """Keep cached positions [0, n_past) and n_past + index (in that order); drop the rest."""
        ...


class Drafter(Protocol):
    """A draft with its own KV cache over (feature, next token) pairs."""

    target_ids: torch.Tensor  # (Vd,) target id of each draft-vocabulary index

    def reset(self) -> None: ...

    def __len__(self) -> int: ...

    def extend(
        self, aux: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs (target features aux (m, A), next tokens ids (m,)) causally -> the last position's
        hidden_out (H,) and draft logits (Vd,)."""
        ...

    def step(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed K draft tokens ids (K,) with hidden inputs (K, H) at positions (K,); mask bool
        (K, len(self) + K) True = attend (None = causal) -> hidden_out (K, H), logits (K, Vd)."""
        ...

    def crop(self, n: int) -> None: ...


class HFTargetRunner:
    """A transformers causal LM (`specdraft.targets.Target`) with a DynamicCache and hooks on its aux layers.

    aux features = cat of the hidden states ENTERING decoder layers `aux_layer_ids` (ascending), the inputs
    the draft's `fc` was trained on. Tree verification passes a 4D additive float mask (B, 1, T, S_past + T),
    which transformers uses as-is (eager and sdpa attention); `tests/test_speculate.py` checks it reproduces
    each branch run alone.
    """

    def __init__(self, target, aux_layer_ids: list[int] | None):
        from transformers import DynamicCache

        self.target = target
        self.model = target.model
        self._cache_cls = DynamicCache
        self.aux_layer_ids = sorted(aux_layer_ids) if aux_layer_ids else []
        bad = [i for i in self.aux_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(
                f"aux layer ids {bad} are outside this {target.num_layers}-layer target: the draft was trained "
                "for another target; pass the target it was trained on (see the draft's config.json)"
            )
        self._slots: dict[int, torch.Tensor] = {}
        self._handles = []
        from specdraft.targets import layer_hidden

        for i in self.aux_layer_ids:

            def pre(mod, args, kwargs, i=i):
                self._slots[i] = layer_hidden(args, kwargs)

            self._handles.append(target.layers[i].register_forward_pre_hook(pre, with_kwargs=True))
        self.cache = DynamicCache()
        self._dtype = next(self.model.parameters()).dtype

    def close(self) -> None:
        """Remove the hooks from the target."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def reset(self) -> None:
        self.cache = self._cache_cls()

    def __len__(self) -> int:
        return int(self.cache.get_seq_length())

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.target.device
        T = ids.shape[0]
        past = len(self)
        mask = None
        if tree_mask is not None:
            full = tree_mask.to(device)
            if full.shape == (T, T):  # among the new tokens; every new token sees the whole cache
                full = torch.cat(
                    [torch.ones(T, past, dtype=torch.bool, device=device), full], dim=1
                )  # (T, past + T)
            assert full.shape == (T, past + T), (
                f"tree mask {tuple(tree_mask.shape)} is neither ({T}, {T}) nor ({T}, {past + T})"
            )
            mask = torch.zeros(full.shape, dtype=self._dtype, device=device)  # (T, past + T)
            mask.masked_fill_(~full, torch.finfo(self._dtype).min)
            mask = mask[None, None]  # (1, 1, T, past + T)
        self._slots.clear()
        out = self.model(
            input_ids=ids.to(device)[None],  # (1, T)
            position_ids=positions.to(device)[None],  # (1, T)
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        assert len(self) == past + T, f"the cache grew to {len(self)}, expected {past + T}"
        logits = out.logits[0].float()  # (T or 1, V)
        aux = None
        if self.aux_layer_ids:
            missing = [i for i in self.aux_layer_ids if i not in self._slots]
            assert not missing, f"aux hooks did not fire for layers {missing}"
            aux = torch.cat([self._slots[i][0] for i in self.aux_layer_ids], dim=-1)  # (T, 3H)
            self._slots.clear()
        return logits, aux

    def keep(self, n_past: int, index: torch.Tensor) -> None:
        total = len(self)
        index = index.to(self.target.device)
        prefix = bool(torch.equal(index, torch.arange(index.numel(), device=index.device)))
        keep = torch.cat([torch.arange(n_past, device=index.device), n_past + index])  # (n_past + a,)
        layers = getattr(self.cache, "layers", None)
        if layers is None:  # transformers < 4.56: key_cache / value_cache lists
            for i in range(len(self.cache.key_cache)):
                self.cache.key_cache[i] = self.cache.key_cache[i].index_select(-2, keep)
                self.cache.value_cache[i] = self.cache.value_cache[i].index_select(-2, keep)
            return
        for layer in layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            if layer.keys.shape[-2] != total:
                raise ValueError(
                    f"the target's KV cache layer {type(layer).__name__} holds {layer.keys.shape[-2]} of {total} "
                    "positions (sliding window?): the reference decoder needs full-attention layers"
                )
            if prefix:
                n = n_past + index.numel()
                layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
            else:
                layer.keys = layer.keys.index_select(-2, keep)  # (B, kvh, n_past + a, d)
                layer.values = layer.values.index_select(-2, keep)  # (B, kvh, n_past + a, d)


class EagleDrafter:
    """An `Eagle3Draft` with its `DraftKVCache`, as a `Drafter`."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft.eval()
        self.cache = DraftKVCache()
        self.target_ids = draft_to_target_ids(draft.d2t)  # (Vd,)
        p = next(draft.parameters())
        self.device, self.dtype = p.device, p.dtype

    def reset(self) -> None:
        self.cache = DraftKVCache()

    def __len__(self) -> int:
        return len(self.cache)

    def crop(self, n: int) -> None:
        self.cache.crop(n)

    @torch.inference_mode()
    def extend(
        self, aux: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.draft
        h = d.fuse(aux.to(self.device, self.dtype)[None])  # (1, m, H)
        out, _ = d(ids.to(self.device)[None], h, positions.to(self.device)[None], None, self.cache, False)
        last = out[0, -1]  # (H,)
        return last, d.compute_logits(last[None, None])[0, 0].float()  # (H,), (Vd,)

    @torch.inference_mode()
    def step(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = None if mask is None else mask.to(self.device)[None, None]  # (1, 1, K, S + K)
        out, logits = self.draft(
            ids.to(self.device)[None], hidden.to(self.device, self.dtype)[None], positions.to(self.device)[None],
            m, self.cache,
        )  # fmt: skip
        return out[0], logits[0].float()  # (K, H), (K, Vd)


# ---------------------------------------------------------------------------------------------------------
# distributions and acceptance rules
# ---------------------------------------------------------------------------------------------------------


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in fp32 (T > 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def draft_probs_full(
    draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab: int, temperature: float
) -> torch.Tensor:
    """The draft's distribution over the TARGET vocabulary: softmax over the draft vocabulary, zero elsewhere.

    draft_logits (..., Vd), target_ids (Vd,) -> (..., V)."""
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)  # (..., Vd)
    full = q.new_zeros((*q.shape[:-1], vocab))  # (..., V)
    full[..., target_ids.to(q.device)] = q
    return full


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a (V,) probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device).item())


def accept_chain(
    p: torch.Tensor,
    draft_tokens: list[int],
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Accept a prefix of a drafted chain; returns (accepted count a, the target's next token).

    p: (k + 1, V) target probabilities at [root, d_1, .., d_k] (greedy: logits; argmax is all that is used);
    q: (k, V) the draft's probabilities d_j was sampled from (None = greedy).

    Greedy: d_j is accepted iff it is the target's argmax after d_1 .. d_{j-1}; the next token is the argmax
    at the first mismatch (or after d_k) -- exactly what target-only greedy decoding emits.

    Sampling (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): accept d_j ~ q_j with
    probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw the next token from
    norm(max(p_j - q_j, 0)); if all k are accepted draw it from p_{k+1}. Every emitted token is then
    distributed exactly as p (the target's tempered distribution); q is zero outside the draft vocabulary.
    """
    k = len(draft_tokens)
    assert p.shape[0] == k + 1, f"p has {p.shape[0]} rows for {k} draft tokens (need k + 1)"
    if q is None:
        top = p.argmax(dim=-1).tolist()  # (k + 1,)
        a = 0
        while a < k and draft_tokens[a] == top[a]:
            a += 1
        return a, top[a]
    assert q.shape[0] == k, f"q has {q.shape[0]} rows for {k} draft tokens"
    for j, x in enumerate(draft_tokens):
        px, qx = float(p[j, x]), float(q[j, x])
        assert qx > 0, f"draft token {x} has zero draft probability: it cannot have been sampled from q"
        if _uniform(generator, p.device) * qx < px:  # u < p/q  <=>  accept with prob min(1, p/q)
            continue
        residual = (p[j] - q[j]).clamp_(min=0)  # (V,)
        s = float(residual.sum())
        return j, sample(residual / s if s > 0 else p[j], generator)
    return k, sample(p[k], generator)


def accept_tree(
    p: torch.Tensor,
    tokens: list[int],
    children: list[list[int]],
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Walk a verified tree from the root; returns (accepted node indices, root excluded, the next token).

    p: (N, V) target probabilities (greedy: logits) at each node of [root, nodes...]; tokens[i] the token of
    node i; children[i] the child node indices of node i in the order they are tried (best draft score first).

    Greedy: move to the child whose token is the target's argmax, stop when none is.

    Sampling -- recursive rejection sampling with deterministic candidates (SpecInfer, Miao et al. 2023,
    with one-hot proposals): the tree's children are the draft's top-k, not samples from q, so each child c
    is treated as a proposal q = one_hot(c). Try the children in order: accept c with probability
    min(1, p'(c) / 1) = p'(c); on rejection p' <- norm(max(p' - one_hot(c), 0)), i.e. zero c and renormalise;
    if no child is accepted draw the next token from the final p'. P(emit x) = p(x) for every x, so the
    output keeps the target's distribution exactly; the acceptance probability at a node is the target's
    mass on its children.
    """
    path: list[int] = []
    node = 0
    while True:
        kids = children[node]
        if greedy:
            best = int(p[node].argmax())
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            pr = p[node].clone()  # (V,)
            nxt = None
            for c in kids:
                x = tokens[c]
                if pr[x] > 0 and _uniform(generator, pr.device) < float(pr[x]):
                    nxt = c
                    break
                pr[x] = 0.0
                s = float(pr.sum())
                if s <= 0:  # all the target's mass was on tried candidates (float edge case)
                    break
                pr /= s
            if nxt is None:
                return path, sample(pr if float(pr.sum()) > 0 else p[node], generator)
        path.append(nxt)
        node = nxt


# ---------------------------------------------------------------------------------------------------------
# the dynamic draft tree (EAGLE-2)
# ---------------------------------------------------------------------------------------------------------


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
    cfg: SpecConfig,
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
    K = min(cfg.topk, logits.shape[-1])
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
    for d in range(2, cfg.depth + 1):
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
    keep = sorted(range(len(tok)), key=lambda n: (-score[n], dep[n], n))[: cfg.budget]
    keep_set = set(keep)
    assert all(par[n] < 0 or par[n] in keep_set for n in keep), "selected tree is not ancestor-closed"
    keep.sort(key=lambda n: (dep[n], -score[n], n))  # by depth, best first: parents precede children
    index = {n: i + 1 for i, n in enumerate(keep)}
    return DraftTree(
        tokens=[root_token] + [tok[n] for n in keep],
        parents=[-1] + [0 if par[n] < 0 else index[par[n]] for n in keep],
        depths=[0] + [dep[n] for n in keep],
    )


# ---------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's next token from one row of logits (V,): argmax at T = 0, else a sample."""
    if temperature == 0:
        return int(logits.argmax())
    return sample(target_probs(logits, temperature), generator)


def _finish(new: list[int], cfg_max: int, stop_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first stop id; True when generation is over."""
    for i, t in enumerate(new):
        if t in stop_ids:
            return new[: min(i + 1, cfg_max)], True
    if len(new) >= cfg_max:
        return new[:cfg_max], True
    return new, False


@torch.inference_mode()
def target_generate(
    target: TargetRunner,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> GenResult:
    """Target-only decoding with the KV cache, through the same `TargetRunner.forward` as verification."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(torch.tensor(prompt), torch.arange(len(prompt)), None, last_only=True)
    new = [_pick(logits[-1], temperature, generator)]
    forwards = 1
    done = False
    new, done = _finish(new, max_new_tokens, stop_ids)
    while not done:
        n = len(prompt) + len(new)
        logits, _ = target.forward(torch.tensor([new[-1]]), torch.tensor([n - 1]), None, last_only=True)
        forwards += 1
        new, done = _finish(new + [_pick(logits[-1], temperature, generator)], max_new_tokens, stop_ids)
    return GenResult(tokens=new, target_forwards=forwards, seconds=time.perf_counter() - t0)


@torch.inference_mode()
def speculative_generate(
    target: TargetRunner,
    drafter: Drafter,
    prompt: list[int],
    cfg: SpecConfig,
    generator: torch.Generator | None = None,
) -> GenResult:
    """Speculative decoding of one prompt (chain or tree, greedy or sampled); see the module docstring."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    t0 = time.perf_counter()
    T = cfg.temperature
    greedy = T == 0
    target.reset()
    drafter.reset()
    logits, aux = target.forward(torch.tensor(prompt), torch.arange(len(prompt)), None, last_only=True)
    if aux is None:
        raise ValueError(
            "the target runner captures no aux features: build it with the draft's aux_layer_ids"
        )
    seq = list(prompt) + [_pick(logits[-1], T, generator)]  # x_0 .. x_{n-1}
    forwards = 1
    accepted: list[int] = []
    drafted: list[int] = []
    new, done = _finish(seq[len(prompt) :], cfg.max_new_tokens, cfg.stop_ids)
    pending = aux  # target features of positions len(drafter) .. n - 2
    while not done:
        n = len(seq)
        c = len(drafter)
        assert pending.shape[0] == n - 1 - c, f"{pending.shape[0]} pending features for {n - 1 - c} pairs"
        assert len(target) == n - 1, f"target cache {len(target)} != {n - 1}"
        # 1. catch-up: pairs (f_t, x_{t+1}) for t = c .. n - 2
        hidden, dlogits = drafter.extend(pending, torch.tensor(seq[c + 1 : n]), torch.arange(c, n - 1))
        V = logits.shape[-1]
        if not cfg.tree:
            # 2. chain: d_j is fed at draft position n - 2 + j with the previous step's hidden_out
            toks: list[int] = []
            qs: list[torch.Tensor] = []
            for j in range(1, cfg.k + 1):
                if greedy:
                    toks.append(int(drafter.target_ids[int(dlogits.argmax())]))
                else:
                    q = draft_probs_full(dlogits, drafter.target_ids, V, T)  # (V,)
                    qs.append(q)
                    toks.append(sample(q, generator))
                if j < cfg.k:
                    h, lg = drafter.step(
                        torch.tensor([toks[-1]]), hidden[None], torch.tensor([n - 2 + j]), None
                    )
                    hidden, dlogits = h[0], lg[0]  # (H,), (Vd,)
            # 3. verify [x_{n-1}, d_1 .. d_k] at positions n - 1 .. n - 1 + k
            ids = torch.tensor([seq[-1]] + toks)  # (k + 1,)
            vlogits, vaux = target.forward(ids, torch.arange(n - 1, n + cfg.k), None, last_only=False)
            forwards += 1
            # 4. accept
            p = vlogits if greedy else target_probs(vlogits, T)  # (k + 1, V)
            q = None if greedy else torch.stack(qs).to(p.device)  # (k, V)
            a, nxt = accept_chain(p, toks, q, generator)
            keep = torch.arange(a + 1)  # root + accepted drafts
            accepted_tokens = toks[:a]
            drafted.append(cfg.k)
        else:
            tree = draft_tree(drafter, hidden, dlogits, seq[-1], n - 2, cfg)
            ids = torch.tensor(tree.tokens)  # (N,)
            pos = n - 1 + torch.tensor(tree.depths)  # (N,)
            vlogits, vaux = target.forward(ids, pos, tree.mask(), last_only=False)
            forwards += 1
            p = vlogits if greedy else target_probs(vlogits, T)  # (N, V)
            path, nxt = accept_tree(p, tree.tokens, tree.children(), greedy, generator)
            a = len(path)
            keep = torch.tensor([0] + path)  # root + accepted path, in order
            accepted_tokens = [tree.tokens[i] for i in path]
            drafted.append(len(tree) - 1)
        accepted.append(a)
        # roll back: the target keeps x_0 .. x_{n-1} and the accepted drafts; the draft its context pairs
        target.keep(n - 1, keep)
        drafter.crop(n - 1)
        pending = vaux[keep.to(vaux.device)]  # (a + 1, A): features of x_{n-1} and the accepted drafts
        seq += accepted_tokens + [nxt]
        new, done = _finish(seq[len(prompt) :], cfg.max_new_tokens, cfg.stop_ids)
    return GenResult(
        tokens=new,
        target_forwards=forwards,
        seconds=time.perf_counter() - t0,
        accepted=accepted,
        drafted=drafted,
    )


class Speculator:
    """A target and a draft ready to decode: `generate` (speculative) and `baseline` (target-only)."""

    def __init__(self, target, draft: Eagle3Draft):
        cfg = draft.cfg
        if cfg.vocab_size != target.vocab_size or cfg.hidden_size != target.hidden_size:
            raise ValueError(
                f"the draft (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}) was built for another target than "
                f"{target.name} (vocab {target.vocab_size}, hidden {target.hidden_size}): pass its own target"
            )
        if len(cfg.aux_layer_ids) != 3:
            raise ValueError(
                f"the draft's config has aux_layer_ids {cfg.aux_layer_ids}; it needs 3 (re-save it)"
            )
        if cfg.target_config_hash and cfg.target_config_hash != target.config_hash:
            raise ValueError(
                f"the draft was trained for a target with config hash {cfg.target_config_hash} "
                f"({cfg.target_name}), not {target.name} ({target.config_hash}): pass the matching --target"
            )
        self.target = target
        self.runner = HFTargetRunner(target, cfg.aux_layer_ids)
        self.drafter = EagleDrafter(draft)

    def generate(self, prompt: list[int], cfg: SpecConfig, seed: int = 0) -> GenResult:
        """Speculative decoding of one prompt, seeded."""
        return speculative_generate(
            self.runner, self.drafter, prompt, cfg, make_generator(seed, self.target.device)
        )

    def baseline(self, prompt: list[int], cfg: SpecConfig, seed: int = 0) -> GenResult:
        """Target-only decoding of one prompt with the same settings, seeded."""
        return target_generate(self.runner, prompt, cfg.max_new_tokens, cfg.temperature, cfg.stop_ids,
                               make_generator(seed, self.target.device))  # fmt: skip

    def close(self) -> None:
        self.runner.close()


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A seeded generator on `device` (sampling and acceptance draws)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g

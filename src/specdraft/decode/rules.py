"""Acceptance rules of speculative decoding: which drafted tokens the target keeps, and its next token.

Pure functions of the target's and the draft's distributions, tested against analytic acceptance rates
(`tests/test_speculate.py`). Each rule is stated in full at its code:

  - `accept_chain`: a drafted chain. Greedy (T = 0) accepts a draft token iff it equals the target's
    argmax, so the output equals target-only greedy decoding token for token; sampling (T > 0) is the
    speculative-sampling rule, which keeps the target's distribution exactly.
  - `accept_tree`: a drafted tree. Greedy walks the argmax path; sampling is recursive rejection
    sampling for deterministic (top-k) candidates, again exact.

`target_probs` and `draft_probs_full` turn logits into the distributions these rules compare: both over
the TARGET vocabulary, the draft's zero outside its own reduced vocabulary.
"""

from __future__ import annotations

import torch


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

"""Reference decoding with a block-parallel (DFlash) draft: one draft forward proposes the whole block.

Token stream as in `specdraft.decode.speculate`: x_0 .. x_{n-1}, the last one (the anchor) produced by the
target and not yet fed to it. The draft holds the keys/values of the fused target features f_0 .. f_{n-2}
(its context cache, one entry per layer). A round:

  1. catch-up: add the features of the tokens the target verified in the previous round to the context;
  2. draft: one forward over the block [x_{n-1}, mask x k] at positions n-1 .. n-1+k (k = min(cfg.k, Q - 1);
     non-causal inside the block, attending to the whole context) gives the draft's distributions q_1 .. q_k
     of x_n .. x_{n+k-1}; d_j is their argmax (T = 0) or a draw from q_j (T > 0);
  3. verify: one target forward over [x_{n-1}, d_1 .. d_{Q-1}];
  4. accept with the same rule as EAGLE-3 chains (`specdraft.decode.rules.accept_chain`): greedy keeps the
     longest prefix equal to the target's argmax, so the output equals target-only greedy decoding; under
     sampling each d_j was drawn from a distribution fixed before verification (q_j depends on the context
     only), which is all speculative sampling needs, so the output keeps the target's distribution exactly.

The block's own keys are not cached: the next round's context gets the target's features of the accepted
tokens instead, as vLLM's DFlash proposer does.
"""

from __future__ import annotations

import torch

from specdraft.decode.rules import accept_chain, draft_probs_full, sample, target_probs
from specdraft.decode.runners import HFTargetRunner, TargetRunner
from specdraft.decode.speculate import (
    GenResult,
    SpecConfig,
    _finish,
    _now,
    _pick,
    _prefill,
    _verify,
    refuse_another_target,
)
from specdraft.model.dflash import DFlashDraft
from specdraft.model.draft import draft_to_target_ids


class DFlashDrafter:
    """A `DFlashDraft` with its context cache: per layer, keys/values (1, kv_heads, C, head_dim)."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft.eval()
        self.target_ids = draft_to_target_ids(draft.d2t)  # (Vd,)
        p = next(draft.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def reset(self) -> None:
        self.kv = None

    def __len__(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor, positions: torch.Tensor) -> None:
        """Add the context features aux (m, A) at positions (m,)."""
        if aux.shape[0] == 0:
            return
        d = self.draft
        ctx = d.context(aux.to(self.device, self.dtype)[None])  # (1, m, H)
        new = d.context_kv(ctx, positions.to(self.device)[None])
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [
                (torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.kv, new)
            ]

    @torch.inference_mode()
    def propose(self, anchor: int, position: int, k: int) -> torch.Tensor:
        """Draft logits (k, Vd) of a block [anchor, k mask slots] with the anchor at `position` (k <= block_size
        - 1: a shorter block, as vLLM runs one with num_speculative_tokens below the trained block)."""
        assert self.kv is not None, "extend the context before proposing"
        Q = k + 1
        ids = torch.tensor([[anchor] + [0] * (Q - 1)], device=self.device)  # (1, Q)
        is_mask = torch.arange(Q, device=self.device)[None] > 0  # (1, Q)
        pos = torch.arange(position, position + Q, device=self.device)[None]  # (1, Q)
        return self.draft(ids, is_mask, pos, self.kv, None)[0, 1:].float()  # (Q - 1, Vd)


@torch.inference_mode()
def block_generate(
    target: TargetRunner,
    drafter: DFlashDrafter,
    prompt: list[int],
    cfg: SpecConfig,
    generator: torch.Generator | None = None,
) -> GenResult:
    """Speculative decoding of one prompt with a DFlash draft (greedy or sampled); see the module docstring.
    Each round drafts min(cfg.k, block_size - 1) tokens (the tree settings do not apply)."""
    t0 = _now()
    logits, aux = _prefill(target, prompt)
    drafter.reset()
    if aux is None:
        raise ValueError(
            "the target runner captures no aux features: build it with the draft's aux_layer_ids"
        )
    vocab = logits.shape[-1]
    T = cfg.temperature
    seq = list(prompt) + [_pick(logits[-1], T, generator)]
    prefill_s, verify_s = _now() - t0, 0.0
    forwards = 1
    accepted: list[int] = []
    drafted: list[int] = []
    new, done = _finish(seq[len(prompt) :], cfg.max_new_tokens, cfg.stop_ids)
    pending = aux  # target features of positions len(drafter) .. n - 2
    while not done:
        n = len(seq)
        c = len(drafter)
        assert pending.shape[0] == n - 1 - c, f"{pending.shape[0]} pending features for {n - 1 - c} positions"
        drafter.extend(pending, torch.arange(c, n - 1))
        k = min(cfg.k, drafter.draft.cfg.block_size - 1)
        dlogits = drafter.propose(seq[-1], n - 1, k)  # (k, Vd)
        if T == 0:
            toks = drafter.target_ids[dlogits.argmax(-1).cpu()].tolist()
            q = None
        else:
            q = draft_probs_full(dlogits, drafter.target_ids, vocab, T)  # (k, V)
            toks = [sample(q[j], generator) for j in range(k)]
        ids = torch.tensor([seq[-1]] + toks)  # (k + 1,)
        vlogits, vaux, s = _verify(target, ids, torch.arange(n - 1, n + k), None)
        verify_s += s
        forwards += 1
        p = vlogits if T == 0 else target_probs(vlogits, T)  # (k + 1, V)
        a, nxt = accept_chain(p, toks, None if q is None else q.to(p.device), generator)
        accepted.append(a)
        drafted.append(k)
        target.keep(n - 1, torch.arange(a + 1))
        pending = vaux[: a + 1]  # features of x_{n-1} and the accepted drafts
        seq += toks[:a] + [nxt]
        new, done = _finish(seq[len(prompt) :], cfg.max_new_tokens, cfg.stop_ids)
    seconds = _now() - t0
    return GenResult(tokens=new, target_forwards=forwards, seconds=seconds, accepted=accepted, drafted=drafted,
                     prefill_seconds=prefill_s, draft_seconds=seconds - prefill_s - verify_s,
                     verify_seconds=verify_s)  # fmt: skip


class BlockSpeculator:
    """A target and a DFlash draft ready to decode, with `Speculator`'s interface (generate, baseline, close)."""

    def __init__(self, target, draft: DFlashDraft):
        cfg = draft.cfg
        if cfg.vocab_size != target.vocab_size or cfg.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"the DFlash draft (vocab {cfg.vocab_size}, target hidden {cfg.target_hidden_size}) was built for "
                f"another target than {target.name} (vocab {target.vocab_size}, hidden {target.hidden_size})"
            )
        refuse_another_target(cfg, target)
        self.target = target
        self.runner = HFTargetRunner(target, cfg.aux_layer_ids)
        self.drafter = DFlashDrafter(draft)

    def generate(self, prompt: list[int], cfg: SpecConfig, seed: int = 0) -> GenResult:
        from specdraft.decode.speculate import make_generator

        return block_generate(
            self.runner, self.drafter, prompt, cfg, make_generator(seed, self.target.device)
        )

    def baseline(self, prompt: list[int], cfg: SpecConfig, seed: int = 0) -> GenResult:
        from specdraft.decode.speculate import make_generator, target_generate

        return target_generate(self.runner, prompt, cfg.max_new_tokens, cfg.temperature, cfg.stop_ids,
                               make_generator(seed, self.target.device))  # fmt: skip

    def close(self) -> None:
        self.runner.close()

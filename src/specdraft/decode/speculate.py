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

Where the pieces are: this module holds the settings, the round above and the `Speculator` facade; the
acceptance rules are `specdraft.decode.rules`, the dynamic tree `specdraft.decode.tree`, the two models
behind their interfaces `specdraft.decode.runners`.

Acceptance rules (`accept_chain`, `accept_tree`) are pure functions, tested against analytic rates.
Greedy (T = 0) accepts a draft token iff it equals the target's argmax, so the output equals target-only
greedy decoding token for token. Sampling (T > 0) keeps the target's distribution exactly (rules stated at
the code). Tree + sampling uses the recursive rejection rule for deterministic (top-k) candidates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from specdraft.decode.rules import accept_chain, accept_tree, draft_probs_full, sample, target_probs
from specdraft.decode.runners import Drafter, EagleDrafter, HFTargetRunner, TargetRunner
from specdraft.decode.tree import draft_tree
from specdraft.model.draft import Eagle3Draft

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
    draft_sample: str = (
        "probabilistic"  # T > 0, chain: draft tokens sampled from q, or `greedy` (q's argmax, one-hot)
    )
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
        if self.draft_sample not in ("greedy", "probabilistic"):
            problems.append(f"draft_sample must be greedy or probabilistic, not {self.draft_sample!r}")
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
    prefill_seconds: float = 0.0  # the prompt's target forward
    draft_seconds: float = 0.0  # speculative rounds: the draft's catch-up and drafting, and the accept rule
    verify_seconds: float = 0.0  # speculative rounds: the target's verify forwards

    @property
    def rounds(self) -> int:
        """Decoding rounds (target forwards after the prefill)."""
        return len(self.accepted) if self.accepted else max(0, self.target_forwards - 1)

    @property
    def tau(self) -> float:
        """Mean tokens per round: accepted draft tokens + the target's own token."""
        return sum(self.accepted) / len(self.accepted) + 1 if self.accepted else 1.0


# ---------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------


def _now() -> float:
    """perf_counter after the device's queued work (CUDA is asynchronous: time what ran, not what was queued)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


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


def _prefill(target: TargetRunner, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Empty the target's cache and feed the prompt: logits (1, V) at its last position, aux features (P, A)."""
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    target.reset()
    return target.forward(torch.tensor(prompt), torch.arange(len(prompt)), None, last_only=True)


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
    t0 = _now()
    logits, _ = _prefill(target, prompt)
    new = [_pick(logits[-1], temperature, generator)]
    prefill_s = _now() - t0
    forwards = 1
    done = False
    new, done = _finish(new, max_new_tokens, stop_ids)
    while not done:
        n = len(prompt) + len(new)
        logits, _ = target.forward(torch.tensor([new[-1]]), torch.tensor([n - 1]), None, last_only=True)
        forwards += 1
        new, done = _finish(new + [_pick(logits[-1], temperature, generator)], max_new_tokens, stop_ids)
    return GenResult(tokens=new, target_forwards=forwards, seconds=_now() - t0, prefill_seconds=prefill_s)


@dataclass
class _Verified:
    """One verified round: what the target accepted and what both caches keep of the verified block."""

    tokens: list[int]  # accepted draft tokens, in order
    nxt: int  # the target's own next token (bonus or correction)
    keep: torch.Tensor  # indices into the verified block [x_{n-1}, drafts...] to keep: the root + accepted
    aux: torch.Tensor  # (N, A) target features of the verified block
    drafted: int  # draft tokens verified (chain k; tree size without the root)
    verify_s: float  # seconds of the target's verify forward


def _verify(target: TargetRunner, ids: torch.Tensor, pos: torch.Tensor, mask) -> tuple:
    """The target's verify forward over a drafted block: (logits (N, V), aux (N, A), its seconds)."""
    t0 = _now()
    vlogits, vaux = target.forward(ids, pos, mask, last_only=False)
    return vlogits, vaux, _now() - t0


def _chain_round(
    target: TargetRunner,
    drafter: Drafter,
    seq: list[int],
    hidden: torch.Tensor,
    dlogits: torch.Tensor,
    vocab: int,
    cfg: SpecConfig,
    generator: torch.Generator | None,
) -> _Verified:
    """Steps 2-4 for a chain: draft k tokens from the draft's output (hidden, dlogits), verify, accept."""
    T = cfg.temperature
    greedy = T == 0
    n = len(seq)
    # 2. chain: d_j is fed at draft position n - 2 + j with the previous step's hidden_out
    toks: list[int] = []
    qs: list[torch.Tensor] = []
    for j in range(1, cfg.k + 1):
        if greedy or cfg.draft_sample == "greedy":
            toks.append(int(drafter.target_ids[int(dlogits.argmax())]))
            if (
                not greedy
            ):  # greedy drafting at T > 0: the rule sees a one-hot proposal, accepting with p(d_j)
                qs.append(torch.nn.functional.one_hot(torch.tensor(toks[-1]), vocab).float())  # (V,)
        else:
            q = draft_probs_full(dlogits, drafter.target_ids, vocab, T)  # (V,)
            qs.append(q)
            toks.append(sample(q, generator))
        if j < cfg.k:
            h, lg = drafter.step(torch.tensor([toks[-1]]), hidden[None], torch.tensor([n - 2 + j]), None)
            hidden, dlogits = h[0], lg[0]  # (H,), (Vd,)
    # 3. verify [x_{n-1}, d_1 .. d_k] at positions n - 1 .. n - 1 + k
    ids = torch.tensor([seq[-1]] + toks)  # (k + 1,)
    vlogits, vaux, verify_s = _verify(target, ids, torch.arange(n - 1, n + cfg.k), None)
    # 4. accept
    p = vlogits if greedy else target_probs(vlogits, T)  # (k + 1, V)
    q = None if greedy else torch.stack(qs).to(p.device)  # (k, V)
    a, nxt = accept_chain(p, toks, q, generator)
    return _Verified(toks[:a], nxt, torch.arange(a + 1), vaux, cfg.k, verify_s)  # keep the root + accepted


def _tree_round(
    target: TargetRunner,
    drafter: Drafter,
    seq: list[int],
    hidden: torch.Tensor,
    dlogits: torch.Tensor,
    cfg: SpecConfig,
    generator: torch.Generator | None,
) -> _Verified:
    """Steps 2-4 for a tree: grow it from the draft's output (hidden, dlogits), verify it in one pass, walk it."""
    greedy = cfg.temperature == 0
    n = len(seq)
    tree = draft_tree(drafter, hidden, dlogits, seq[-1], n - 2, cfg.topk, cfg.depth, cfg.budget)
    ids = torch.tensor(tree.tokens)  # (N,)
    pos = n - 1 + torch.tensor(tree.depths)  # (N,)
    vlogits, vaux, verify_s = _verify(target, ids, pos, tree.mask())
    p = vlogits if greedy else target_probs(vlogits, cfg.temperature)  # (N, V)
    path, nxt = accept_tree(p, tree.tokens, tree.children(), greedy, generator)
    keep = torch.tensor([0] + path)  # root + accepted path, in order
    return _Verified([tree.tokens[i] for i in path], nxt, keep, vaux, len(tree) - 1, verify_s)


@torch.inference_mode()
def speculative_generate(
    target: TargetRunner,
    drafter: Drafter,
    prompt: list[int],
    cfg: SpecConfig,
    generator: torch.Generator | None = None,
) -> GenResult:
    """Speculative decoding of one prompt (chain or tree, greedy or sampled); see the module docstring."""
    t0 = _now()
    logits, aux = _prefill(target, prompt)
    drafter.reset()
    if aux is None:
        raise ValueError(
            "the target runner captures no aux features: build it with the draft's aux_layer_ids"
        )
    vocab = logits.shape[-1]
    seq = list(prompt) + [_pick(logits[-1], cfg.temperature, generator)]  # x_0 .. x_{n-1}
    prefill_s, verify_s = _now() - t0, 0.0
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
        # 2.-4. draft, verify, accept
        if cfg.tree:
            v = _tree_round(target, drafter, seq, hidden, dlogits, cfg, generator)
        else:
            v = _chain_round(target, drafter, seq, hidden, dlogits, vocab, cfg, generator)
        forwards += 1
        verify_s += v.verify_s
        accepted.append(len(v.tokens))
        drafted.append(v.drafted)
        # roll back: the target keeps x_0 .. x_{n-1} and the accepted drafts; the draft its context pairs
        target.keep(n - 1, v.keep)
        drafter.crop(n - 1)
        pending = v.aux[v.keep.to(v.aux.device)]  # (a + 1, A): features of x_{n-1} and the accepted drafts
        seq += v.tokens + [v.nxt]
        new, done = _finish(seq[len(prompt) :], cfg.max_new_tokens, cfg.stop_ids)
    seconds = _now() - t0
    return GenResult(tokens=new, target_forwards=forwards, seconds=seconds, accepted=accepted, drafted=drafted,
                     prefill_seconds=prefill_s, draft_seconds=seconds - prefill_s - verify_s,
                     verify_seconds=verify_s)  # fmt: skip


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
        refuse_another_target(cfg, target)
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


def refuse_another_target(cfg, target) -> None:
    """A draft (EAGLE-3 or DFlash) trained for a target whose config hash is recorded decodes only with it."""
    if cfg.target_config_hash and cfg.target_config_hash != target.config_hash:
        raise ValueError(
            f"the draft was trained for a target with config hash {cfg.target_config_hash} "
            f"({cfg.target_name}), not {target.name} ({target.config_hash}): pass the matching --target"
        )


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A seeded generator on `device` (sampling and acceptance draws)."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g

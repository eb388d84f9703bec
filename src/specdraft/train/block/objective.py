"""The block objective of a DFlash draft (`specdraft.model.dflash`): anchors, block mask, decayed loss.

Per sequence of T tokens x_0 .. x_{T-1} with target features f_t and a loss mask:

  - anchors: positions a with 1 <= a <= T - 2 whose next token x_{a+1} is trained (loss mask), sampled
    without replacement (`sample_anchors`), N per sequence;
  - one block per anchor: [x_a, mask x (Q-1)] at positions a .. a + Q - 1; slot i >= 1 is labelled
    x_{a+i} where a + i < T and the loss mask keeps it (and the token is in the draft vocabulary);
  - the block mask (`block_mask`): a block's tokens see the context features f_t for t < a (what the
    served draft has: the anchor is the token the target just produced) and all tokens of their own block,
    nothing of another block;
  - the loss: cross-entropy at slot i weighted by exp(-(i-1)/gamma) (early slots matter most: a draft
    token counts only if all before it are accepted), averaged over the weights of the labelled slots;
    with `weights="dpace"` (`--position-weights dpace`, position-aware cross-entropy) slot i is weighted
    instead by the chance that verification reaches it, as the draft stands: the product of the draft's own
    probabilities of the labels at slots 1 .. i-1 of that block (detached; 0 after an unlabelled slot);
  - the loss at a slot (`Objective.terms`, `--loss`): ce (the default, the cross-entropy above), or a soft
    loss against the target's own next-token distribution there (`train.losses`: kl, tv, lk, ...): slot i
    (position a + i) is what the target predicts from its final hidden state at a + i - 1, over the draft
    vocabulary (the teacher head EAGLE-3 trains with); weighted sums mix them (0.5*ce+0.5*kl);
  - metrics: accuracy per block slot, and the accepted length of each block (its leading correct slots,
    what greedy verification would keep), whose mean + 1 is the block's tau.

Memory is bounded by `chunk` anchors at a time: the attention of a chunk is (chunk * Q) x (a_max + chunk *
Q), and in training each chunk runs under activation checkpointing, so a sequence's anchors cost one
chunk's activations at a time (plain SDPA: CPU has no FlexAttention backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specdraft.model.dflash import DFlashDraft
from specdraft.train.losses import divergence

IGNORE = -100


@dataclass
class Objective:
    """What a block slot's loss is: the slot weights (exp or dpace), the `--loss` terms {name: weight} (ce, or
    soft ones against the target's distribution), and the target's frozen head for the soft ones
    (`train.ttt.TeacherHead`: final hidden state -> draft-vocabulary logits; None when only ce)."""

    weights: str = "exp"
    terms: dict = field(default_factory=lambda: {"ce": 1.0})
    teacher: torch.nn.Module | None = None

    def __post_init__(self):
        assert self.teacher is not None or set(self.terms) <= {"ce"}, "a soft --loss needs the teacher head"


def slot_losses(obj: Objective, logits: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor,
                final: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """(n * Q,) the loss of each block slot (logits (n * Q, Vd), labels (n * Q,), positions (n * Q,); final
    (T, H) the target's final hidden states, for soft terms): sum of the terms' weighted losses."""
    ce = F.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")  # (n * Q,)
    out = obj.terms.get("ce", 0.0) * ce
    soft = {k: w for k, w in obj.terms.items() if k != "ce"}
    if soft:
        assert final is not None, "a soft --loss needs the final hidden states (the shards hold them)"
        # the target's distribution of the token at position a + i: its prediction from position a + i - 1
        z = final[(pos - 1).clamp(0, final.shape[0] - 1)]  # (n * Q, H); a >= 1, so a + i - 1 >= 0
        t_logits, _ = obj.teacher(z)  # (n * Q, Vd) fp32, the draft vocabulary
        p = F.softmax(t_logits, -1)
        negent = torch.special.xlogy(p, p).sum(-1)  # (n * Q,)
        out = out + divergence(soft, logits.float(), p, negent)[0]
    return out


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a (1 <= a <= T - 2) whose next token is trained: (M,) int64, ascending."""
    T = loss_mask.shape[0]
    if T < 3:
        return torch.zeros(0, dtype=torch.long)
    ok = loss_mask[2:].bool().cpu()  # ok[j] <=> loss_mask[a + 1] with a = j + 1
    return torch.nonzero(ok).flatten() + 1


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to n distinct anchors among `valid_anchors`, uniformly, ascending: (min(n, M),) int64."""
    cand = valid_anchors(loss_mask)
    if cand.numel() <= n:
        return cand
    pick = torch.randperm(cand.numel(), generator=generator)[:n]
    return cand[pick].sort().values


def block_mask(anchors: torch.Tensor, ctx_len: int, Q: int) -> torch.Tensor:
    """Bool (N * Q, ctx_len + N * Q), True = attend: block j's rows see context t < anchors[j] and block j."""
    N = anchors.shape[0]
    ctx = torch.arange(ctx_len)[None, :] < anchors.cpu()[:, None]  # (N, C)
    ctx = ctx.repeat_interleave(Q, dim=0)  # (N * Q, C)
    blk = (
        torch.block_diag(*[torch.ones(Q, Q, dtype=torch.bool)] * N)
        if N
        else torch.zeros(0, 0, dtype=torch.bool)
    )
    return torch.cat([ctx, blk], dim=1)  # (N * Q, C + N * Q)


def target_to_draft(t2d: torch.Tensor) -> torch.Tensor:
    """(V,) draft index of each target id, -1 outside the draft vocabulary."""
    idx = torch.cumsum(t2d.long(), 0) - 1  # (V,)
    return torch.where(t2d, idx, torch.full_like(idx, -1))


def block_inputs(
    ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, Q: int, t2d_index: torch.Tensor
):
    """Block ids, is_mask, positions, draft-vocab labels for anchors: each (N * Q,) (labels IGNORE where
    there is nothing to learn: the anchor slot, past the end, loss-masked, outside the draft vocabulary)."""
    T = ids.shape[0]
    dev = ids.device
    a = anchors.to(dev)
    slot = torch.arange(Q, device=dev)
    pos = (a[:, None] + slot[None, :]).flatten()  # (N * Q,)
    is_mask = (slot[None, :] > 0).expand(a.shape[0], Q).flatten()  # (N * Q,)
    block_ids = torch.where(is_mask, torch.zeros_like(pos), ids[a].repeat_interleave(Q))  # (N * Q,)
    inside = pos < T
    safe = pos.clamp(max=T - 1)
    labels = t2d_index.to(dev)[ids[safe]]  # (N * Q,)
    keep = inside & is_mask & loss_mask.to(dev)[safe].bool() & (labels >= 0)
    return block_ids, is_mask, pos, torch.where(keep, labels, torch.full_like(labels, IGNORE))


def slot_weights(Q: int, gamma: float, device=None) -> torch.Tensor:
    """(Q,) loss weight per block slot: 0 for the anchor, exp(-(i-1)/gamma) for slot i >= 1."""
    i = torch.arange(Q, dtype=torch.float, device=device)
    return torch.where(i > 0, torch.exp(-(i - 1) / gamma), torch.zeros_like(i))


@dataclass
class BlockStats:
    """Sums over blocks: weighted loss, weight, per-slot correct/labelled counts, accepted lengths."""

    Q: int
    loss: float = 0.0
    weight: float = 0.0
    correct: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    accepted: float = 0.0
    blocks: int = 0

    def __post_init__(self):
        self.correct = self.correct or [0.0] * self.Q
        self.total = self.total or [0.0] * self.Q

    def add(self, other: BlockStats) -> None:
        self.loss += other.loss
        self.weight += other.weight
        self.correct = [x + y for x, y in zip(self.correct, other.correct)]
        self.total = [x + y for x, y in zip(self.total, other.total)]
        self.accepted += other.accepted
        self.blocks += other.blocks

    def as_tensor(self) -> torch.Tensor:
        """(4 + 2 Q,) float64: loss, weight, accepted, blocks, correct per slot, labelled per slot (to all-reduce)."""
        return torch.tensor([self.loss, self.weight, self.accepted, self.blocks, *self.correct, *self.total],
                            dtype=torch.float64)  # fmt: skip

    @classmethod
    def from_tensor(cls, Q: int, t: torch.Tensor) -> BlockStats:
        v = t.tolist()
        return cls(Q, v[0], v[1], v[4 : 4 + Q], v[4 + Q :], v[2], int(v[3]))

    def summary(self) -> dict:
        """loss, acc per slot 1 .. Q-1 (None where nothing was labelled), tau = 1 + mean accepted length."""
        return {
            "loss": self.loss / max(self.weight, 1e-9),
            "acc": [c / t if t else None for c, t in zip(self.correct[1:], self.total[1:])],
            "tau": 1.0 + self.accepted / max(self.blocks, 1),
            "blocks": self.blocks,
        }


def _chunk_logits(draft: DFlashDraft, ctx, ctx_pos, bids, bmask, bpos, anchors, Q):
    """Logits (n * Q, Vd) of one chunk of blocks over the context before its last anchor."""
    C = int(anchors.max())  # context t < a_max is all any block of the chunk sees
    kv = draft.context_kv(ctx[:, :C], ctx_pos[:, :C])
    m = block_mask(anchors, C, Q).to(ctx.device)[None, None]  # (1, 1, n * Q, C + n * Q)
    return draft(bids[None], bmask[None], bpos[None], kv, m)[0]  # (n * Q, Vd)


def dpace_weights(logits: torch.Tensor, labels: torch.Tensor, Q: int) -> torch.Tensor:
    """(n * Q,) D-PACE weights: slot i >= 1 of a block gets prod_{1 <= j < i} q_j(label_j), the draft's
    probability of reaching it (detached); the anchor slot 0, and every slot after an unlabelled one, 0."""
    with torch.no_grad():
        has = labels != IGNORE
        lp = F.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]  # (n * Q,)
        lp = torch.where(has, lp, torch.full_like(lp, float("-inf"))).view(-1, Q)  # (n, Q)
        lp[:, 0] = 0.0  # the anchor is given
        before = F.pad(torch.cumsum(lp, 1)[:, :-1], (1, 0))  # (n, Q): sum over slots 0 .. i-1
        w = torch.exp(before)  # (n, Q)
        w[:, 0] = 0.0
        return w.flatten() * has  # (n * Q,)


def block_loss(
    draft: DFlashDraft,
    aux: torch.Tensor,
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    chunk: int = 16,
    grad: bool = True,
    obj: Objective | None = None,
    final: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BlockStats]:
    """Sum of the weighted slot losses (`obj`, default: decayed cross-entropy) over the blocks of one sequence
    (aux (T, A), ids (T,), loss_mask (T,); final (T, H) for a soft loss) and its stats. Divide by
    `BlockStats.weight` summed over the batch for the mean loss. With `grad`, each chunk of anchors runs
    under activation checkpointing."""
    obj = obj or Objective()
    cfg = draft.cfg
    Q = cfg.block_size
    stats = BlockStats(Q)
    total = aux.new_zeros((), dtype=torch.float)
    if anchors.numel() == 0:
        return total, stats
    t2d_index = target_to_draft(draft.t2d)
    w_slot = slot_weights(Q, cfg.loss_decay_gamma, aux.device)  # (Q,)
    ctx = draft.context(aux[None])  # (1, T, H)
    ctx_pos = torch.arange(ids.shape[0], device=aux.device)[None]  # (1, T)
    for s in range(0, anchors.numel(), chunk):
        a = anchors[s : s + chunk]
        bids, bmask, bpos, labels = block_inputs(ids, loss_mask, a, Q, t2d_index)
        if grad:
            logits = checkpoint(
                _chunk_logits, draft, ctx, ctx_pos, bids, bmask, bpos, a, Q, use_reentrant=False
            )
        else:
            logits = _chunk_logits(draft, ctx, ctx_pos, bids, bmask, bpos, a, Q)
        ce = slot_losses(obj, logits, labels, bpos, final)  # (n * Q,)
        has = labels != IGNORE
        w = (
            dpace_weights(logits, labels, Q) if obj.weights == "dpace" else w_slot.repeat(a.numel()) * has
        )  # (n * Q,)
        total = total + (ce * w).sum()
        with torch.no_grad():
            right = (logits.argmax(-1) == labels) & has  # (n * Q,)
            stats.loss += float((ce * w).sum())
            stats.weight += float(w.sum())
            r, h = right.view(-1, Q), has.view(-1, Q)  # (n, Q)
            stats.correct = [x + y for x, y in zip(stats.correct, r.sum(0).tolist())]
            stats.total = [x + y for x, y in zip(stats.total, h.sum(0).tolist())]
            stats.accepted += float(r[:, 1:].long().cumprod(1).sum())  # leading correct slots per block
            stats.blocks += a.numel()
    return total, stats


def batch_loss(
    draft, batch, anchors: list[torch.Tensor], chunk: int, obj: Objective | None = None
) -> tuple[torch.Tensor | None, BlockStats]:
    """The summed block losses of sequences [(aux (T, A), ids (T,), loss_mask (T,)[, final (T, H)]), ...] at
    their `anchors` (None without a sequence), and their stats; divide by the (global) `BlockStats.weight`
    for the mean."""
    draft.train()
    stats = BlockStats(draft.cfg.block_size)
    losses = []
    for (aux, ids, lm, *final), a in zip(batch, anchors):
        loss, st = block_loss(draft, aux, ids, lm, a, chunk, True, obj, *final)
        losses.append(loss)
        stats.add(st)
    return (sum(losses) if losses else None), stats


def train_step(draft, optimizer, batch, anchors_per_seq: int, chunk: int, generator=None) -> BlockStats:
    """One optimiser step over a batch of sequences [(aux (T, A), ids (T,), loss_mask (T,)), ...]."""
    anchors = [sample_anchors(b[2], anchors_per_seq, generator) for b in batch]
    loss, stats = batch_loss(draft, batch, anchors, chunk)
    optimizer.zero_grad(set_to_none=True)
    if stats.weight > 0:
        (loss / stats.weight).backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
    return stats


@torch.no_grad()
def evaluate(
    draft, batch, anchors_per_seq: int = 1 << 30, chunk: int = 16, obj: Objective | None = None
) -> BlockStats:
    """Validation over every valid anchor (up to anchors_per_seq per sequence): stats without gradients (the
    loss `obj`'s, accuracy and accepted length the draft's own)."""
    draft.eval()
    stats = BlockStats(draft.cfg.block_size)
    for aux, ids, lm, *final in batch:
        anchors = valid_anchors(lm)[:anchors_per_seq]
        stats.add(block_loss(draft, aux, ids, lm, anchors, chunk, False, obj, *final)[1])
    return stats

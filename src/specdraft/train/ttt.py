"""Training-time test (TTT): the draft unrolled K steps on target features, its attention mask, the loss.

Alignment (one sample of T tokens x_0 .. x_{T-1}; target features f_t = cat(aux_1, aux_2, aux_3) at
position t, (T, 3H); the target's final hidden state z_t (id L, before the norm), (T, H)):

    TTT step i = 0 .. K-1, draft slot t:
        input token      x_{t+1+i}                 ids shifted by 1 + i          (B, T)
        input hidden     fc(f_t)          (i = 0)  fused target features        (B, T, H)
                         hidden_out_{i-1}[t] (i>0)  the draft's own previous output (pre-final-norm)
        position         t + i                                                  (B, T)
        predicts         x_{t+2+i}
        teacher          softmax over the draft vocabulary of lm_head(norm(z_{t+1+i}))[t2d]    (B, T, Vd)
        loss mask        loss_mask[t+2+i] (0 where t+2+i >= T)                 (B, T)
        attention keys   step-0 keys at slots 0..t (causal prefix over target-feature keys) and, for
                         each earlier step j in 1..i, only step j's key at slot t (the same position)

    This is exactly what speculative decoding runs: after a target forward over x_0..x_{p+1}, the draft's
    first step sees features of 0..p with tokens x_1..x_{p+1} (cache of step-0 keys), and its j-th next
    step feeds its own hidden state at position p+j, attending to that cache plus its own earlier keys.

    loss = sum_i decay**i * KL(teacher_i || draft_i), each averaged over the loss-masked tokens of the
    whole global batch (all ranks); acc_i = share of those tokens where argmax draft == argmax teacher.

Shapes: B rows, T tokens, H the target's hidden size, Vd the draft vocabulary, K the TTT steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as grad_checkpoint

from specdraft.model.draft import DraftKVCache, Eagle3Draft


class TeacherHead(nn.Module):
    """The target's frozen final norm + lm_head rows of the draft vocabulary: z (.., H) -> logits (.., Vd).

    Equal to `target.logits_from_final(z)[..., t2d]` but never materialises the full vocabulary.
    """

    def __init__(self, target, t2d: torch.Tensor):
        super().__init__()
        self.norm = copy.deepcopy(target.norm).requires_grad_(False)
        head = target.lm_head
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"the target's lm_head is a {type(head).__name__}, not a Linear: not supported yet"
            )
        keep = t2d.to(head.weight.device)
        self.register_buffer("weight", head.weight.detach()[keep].clone())  # (Vd, H)
        self.register_buffer("bias", None if head.bias is None else head.bias.detach()[keep].clone())
        self.softcap = target.logit_softcap

    @torch.no_grad()
    def forward(self, final: torch.Tensor) -> torch.Tensor:
        z = self.norm(final.to(self.weight.dtype))  # (B, T, H)
        logits = F.linear(z, self.weight, self.bias).float()  # (B, T, Vd)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def ttt_mask(T: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Attention mask of TTT step `step` over [step-0 keys | step-1 keys | ... | step-`step` keys].

    Returns bool (1, 1, T, (step + 1) * T), True = attend: a causal block over the step-0 keys (target
    features), then one diagonal block (same slot only) for each later step.
    """
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
    eye = torch.eye(T, dtype=torch.bool, device=device)  # (T, T)
    return torch.cat([causal] + [eye] * step, dim=1)[None, None]  # (1, 1, T, (step+1) T)


def _head_stats(
    draft: Eagle3Draft,
    h: torch.Tensor,
    teacher_logp: torch.Tensor,
    teacher_top: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked sums of KL(teacher || draft) and of top-1 agreement for hidden_out h (B, n, H)."""
    logq = F.log_softmax(draft.compute_logits(h).float(), dim=-1)  # (B, n, Vd)
    kl = (teacher_logp.exp() * (teacher_logp - logq)).sum(-1)  # (B, n)
    agree = (logq.argmax(-1) == teacher_top).float()  # (B, n)
    return (kl * mask).sum(), (agree * mask).sum().detach()


def ttt_unroll(draft: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, ttt_steps: int):
    """Yield the draft's hidden_out (B, T, H) of TTT steps 0 .. K-1 (alignment in the module docstring).

    Step i: tokens shifted by 1 + i, positions + i, input hidden = step i-1's output (fused features for
    step 0), keys = [step-0 keys | step-1 keys | ... | step-i keys] under `ttt_mask(T, i)`.
    """
    B, T = input_ids.shape
    ids = F.pad(input_ids, (0, ttt_steps + 1))  # (B, T + K + 1)
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # (B, T)
    h = draft.fuse(aux)  # (B, T, 3H) -> (B, T, H)
    cache = DraftKVCache()
    for i in range(ttt_steps):
        ids_i = ids[:, 1 + i : 1 + i + T]  # (B, T): shifted by 1 + i, token x_{t+1+i} at slot t
        mask_i = None if i == 0 else ttt_mask(T, i, input_ids.device)  # (1, 1, T, (i+1) T); step 0: causal
        pos_i = pos + i  # (B, T): positions shifted by i
        h, _ = draft(ids_i, h, pos_i, mask_i, cache, compute_logits=False)  # (B, T, H)
        yield h


class TTTModel(nn.Module):
    """The draft unrolled K steps (training-time test); what DDP/FSDP wraps (one forward per optimizer step)."""

    def __init__(self, draft: Eagle3Draft, ttt_steps: int, decay: float, checkpoint_head: bool = True):
        super().__init__()
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.decay = decay
        self.checkpoint_head = checkpoint_head

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        teacher_logp: torch.Tensor,
        loss_mask: torch.Tensor,
        norm: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One global-batch share.

        Args:
            input_ids: (B, T) token ids, right-padded.
            aux: (B, T, 3H) target aux features.
            teacher_logp: (B, T, Vd) log-softmax of the teacher at every position (position t predicts t+1).
            loss_mask: (B, T) float, 0 on padding.
            norm: (K,) the per-step divisor of the KL sums (global masked-token counts / world size).

        Returns:
            loss (scalar), kl_sums (K,) and agree_sums (K,) of this rank, both detached.
        """
        T = input_ids.shape[1]
        K = self.ttt_steps
        lmask = F.pad(loss_mask, (0, K + 2))  # (B, T + K + 2)
        teacher_top = teacher_logp.argmax(-1)  # (B, T)
        loss = aux.new_zeros((), dtype=torch.float32)
        kl_sums, agree_sums = [], []
        for i, h in enumerate(ttt_unroll(self.draft, input_ids, aux, K)):  # h: (B, T, H) of step i
            n = T - 1 - i  # slots whose teacher position t+1+i exists
            if n <= 0:
                kl_sums.append(loss.new_zeros(()))
                agree_sums.append(loss.new_zeros(()))
                continue
            # slots 0..n-1; teacher shifted by 1 + i, loss mask by 2 + i (the predicted token x_{t+2+i})
            args = (h[:, :n], teacher_logp[:, 1 + i : 1 + i + n], teacher_top[:, 1 + i : 1 + i + n],
                    lmask[:, 2 + i : 2 + i + n])  # (B, n, H), (B, n, Vd), (B, n), (B, n)  # fmt: skip
            if self.checkpoint_head and torch.is_grad_enabled():
                kl, agree = grad_checkpoint(_head_stats, self.draft, *args, use_reentrant=False)
            else:
                kl, agree = _head_stats(self.draft, *args)
            loss = loss + (self.decay**i) * kl / norm[i]
            kl_sums.append(kl.detach())
            agree_sums.append(agree)
        return loss, torch.stack(kl_sums), torch.stack(agree_sums)  # (), (K,), (K,)


def step_token_counts(loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """(K,) number of loss-masked predicted tokens of each TTT step for a (B, T) loss mask."""
    T = loss_mask.shape[1]
    # step i counts loss_mask shifted by 2 + i: (B, T - 2 - i) summed to ()
    return torch.stack(
        [loss_mask[:, 2 + i :].sum() if 2 + i < T else loss_mask.new_zeros(()) for i in range(ttt_steps)]
    )  # (K,)

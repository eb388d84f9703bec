"""The optimizers of `train --optimizer`: AdamW, or Muon on the hidden matrices with AdamW on the rest.

Muon (Jordan et al. 2024; torch.optim.Muon): SGD momentum whose update, for a 2-D weight, is replaced by its
nearest semi-orthogonal matrix (5 Newton-Schulz iterations of the quintic with coefficients 3.4445, -4.7750,
2.0315), scaled by 0.2 sqrt(max(rows, cols)) so that its RMS matches AdamW's and the same --lr serves both
(torch's `adjust_lr_fn="match_rms_adamw"`). As the peers do, Muon takes the hidden matrices (fc, the decoder
layers' projections); lm_head, norms and biases keep AdamW. One optimizer object holds both parameter groups,
so the schedule, checkpoints and resume treat it as any other.
"""

from __future__ import annotations

import math

import torch
from torch import nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to g (2-D), by the Newton-Schulz quintic (in g's dtype)."""
    a, b, c = NS_COEFFS
    x = g / g.norm().clamp(min=eps)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with `muon=True` (2-D weights), AdamW on the others; one `lr` per group (the schedule's)."""

    def __init__(self, muon_params, adam_params, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-8):  # fmt: skip
        groups = [{"params": list(muon_params), "muon": True}, {"params": list(adam_params), "muon": False}]
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, eps=eps)  # fmt: skip
        super().__init__([g for g in groups if g["params"]], defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1 - lr * wd)  # decoupled weight decay, both kinds
                if group["muon"]:  # momentum, Nesterov look-ahead, orthogonalised, RMS matched to AdamW
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    upd = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                    scale = 0.2 * math.sqrt(max(p.shape))
                    p.add_(orthogonalize(upd, group["ns_steps"]), alpha=-lr * scale)
                    continue
                if not state:  # AdamW, as torch.optim.AdamW computes it
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                b1, b2 = group["betas"]
                state["step"] += 1
                t = float(state["step"])
                state["exp_avg"].lerp_(p.grad, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**t)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**t))
        return loss


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """Muon's share: 2-D weights other than the output head and embeddings."""
    return p.ndim == 2 and "lm_head" not in name and "embed" not in name


def make_optimizer(named_params: list[tuple[str, nn.Parameter]], kind: str, lr: float,
                   weight_decay: float) -> torch.optim.Optimizer:  # fmt: skip
    """The trainable parameters' optimizer for `--optimizer` (adamw, muon), betas (0.9, 0.95)."""
    params = [p for _, p in named_params]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    assert kind == "muon", kind
    muon = [p for n, p in named_params if is_hidden_matrix(n, p)]
    adam = [p for n, p in named_params if not is_hidden_matrix(n, p)]
    return MuonAdamW(muon, adam, lr=lr, weight_decay=weight_decay)

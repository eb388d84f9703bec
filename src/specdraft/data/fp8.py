"""fp8 hidden-state storage: e4m3 values with one float32 scale per token and layer.

Hidden states of large targets are wide (H = 7168 for Kimi-K2.5) and every training token stores four
of them: 57 KB per token in bf16. e4m3 halves that. Rows of a hidden state differ in magnitude by orders
(a few outlier channels, growing with depth), so the scale is per row: each (token, layer) row of H values
is divided by amax / 448 (the e4m3 maximum) before the cast, and multiplied back on load.
Relative error per value is at most 2^-4 (3 mantissa bits, round to nearest) above e4m3's normal range.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0


def encode(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, n, H) float -> (T, n, H) e4m3 values and (T, n) float32 scales."""
    x = hidden.float()
    amax = x.abs().amax(dim=-1)  # (T, n)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # (T, n)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # (T, n, H)
    return q, scale


def decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(T, n, H) e4m3 and (T, n) scales -> (T, n, H) in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)  # (T, n, H)

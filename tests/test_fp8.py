"""fp8 storage: e4m3 with a scale per (token, layer) row keeps every value within e4m3's rounding bound."""

from __future__ import annotations

import torch

from specdraft.data.fp8 import FP8_MAX, decode, encode


def test_round_trip_error_is_within_e4m3_rounding_per_row():
    torch.manual_seed(0)
    x = torch.randn(64, 4, 256) * torch.logspace(-3, 3, 64)[:, None, None]  # rows of very different size
    x[:, :, 7] *= 50  # an outlier channel
    x[5] = 0  # an all-zero row
    q, scale = encode(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (64, 4)
    y = decode(q, scale)
    assert torch.equal(y[5], x[5])
    normal = x.abs() >= scale.unsqueeze(-1) * 2**-6  # values in e4m3's normal range after scaling
    rel = (y - x).abs() / x.abs().clamp_min(1e-30)
    assert rel[normal].max() <= 2**-4  # 3 mantissa bits, round to nearest
    # values below the normal range keep an absolute error under one subnormal step of their row
    assert ((y - x).abs() <= scale.unsqueeze(-1) * 2**-9 + 1e-12)[~normal].all()
    assert torch.allclose(y.abs().amax(-1), x.abs().amax(-1), rtol=2**-4)  # each row's max lands on 448
    assert (q.float().abs().amax(-1)[torch.arange(64) != 5] == FP8_MAX).all()


def test_fp8_is_half_the_bytes_of_bf16():
    x = torch.randn(100, 4, 576)
    q, scale = encode(x)
    fp8 = q.numel() * q.element_size() + scale.numel() * scale.element_size()
    assert fp8 <= 0.51 * x.numel() * 2

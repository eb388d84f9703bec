"""`train --optimizer`: our Muon + AdamW optimizer against torch's own Muon and AdamW, step by step."""

from __future__ import annotations

import torch
from torch import nn

from specdraft.train.optim import MuonAdamW, is_hidden_matrix, make_optimizer


def test_muon_and_adamw_groups_match_torch():
    """Three steps on a 2-D weight (Muon) and a bias and lm_head (AdamW): the AdamW share equals
    torch.optim.AdamW to float precision; the Muon share equals torch.optim.Muon (match_rms_adamw), which runs
    its Newton-Schulz iterations in bf16 where ours run in the weight's dtype (to bf16's precision)."""
    g = torch.Generator().manual_seed(0)
    w0, b0, h0 = (
        torch.randn(24, 16, generator=g),
        torch.randn(24, generator=g),
        torch.randn(10, 24, generator=g),
    )
    grads = [(torch.randn(24, 16, generator=g), torch.randn(24, generator=g), torch.randn(10, 24, generator=g))
             for _ in range(3)]  # fmt: skip
    ours = [nn.Parameter(t.clone()) for t in (w0, b0, h0)]
    theirs = [nn.Parameter(t.clone()) for t in (w0, b0, h0)]
    opt = MuonAdamW([ours[0]], ours[1:], lr=0.02, weight_decay=0.1)
    muon = torch.optim.Muon([theirs[0]], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adam = torch.optim.AdamW(theirs[1:], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
    for step in grads:
        for p, q, gr in zip(ours, theirs, step):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        muon.step()
        adam.step()
    torch.testing.assert_close(ours[1], theirs[1])
    torch.testing.assert_close(ours[2], theirs[2])
    moved = (theirs[0] - w0).abs().max()
    torch.testing.assert_close(
        ours[0].detach(), theirs[0].detach(), atol=0.02 * float(moved.detach()), rtol=0
    )
    assert float(moved.detach()) > 0.01


def test_make_optimizer_splits_hidden_matrices():
    named = [("fc.weight", nn.Parameter(torch.zeros(4, 12))), ("midlayer.mlp.up_proj.weight", nn.Parameter(torch.zeros(6, 4))),
             ("lm_head.weight", nn.Parameter(torch.zeros(9, 4))), ("norm.weight", nn.Parameter(torch.ones(4)))]  # fmt: skip
    assert [is_hidden_matrix(n, p) for n, p in named] == [True, True, False, False]
    opt = make_optimizer(named, "muon", 1e-3, 0.0)
    assert [len(gr["params"]) for gr in opt.param_groups] == [2, 2]
    assert isinstance(make_optimizer(named, "adamw", 1e-3, 0.0), torch.optim.AdamW)
    state = opt.state_dict()  # checkpoints and resume: a plain optimizer state
    opt.load_state_dict(state)

"""The training losses (`train.losses`): each one's value and gradient, through the path training runs
(`ttt._head_stats`: the draft's head, the masks, the hard-label mix), against a direct fp64 implementation of
its formula on random distributions; `kl` as it always was; `--loss` parsing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft.model.draft import DraftConfig, Eagle3Draft
from specdraft.train.losses import LOSSES, divergence, parse_loss
from specdraft.train.ttt import _head_stats

M, H, VD = 7, 16, 12


def direct(name: str, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The formula as written, per position, fp64: no fused kernels, no shared terms."""
    q = torch.softmax(logits, -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if name == "kl":
        return kl
    if name == "rkl":
        return (q * (q.log() - p.log())).sum(-1)
    if name == "jsd":
        m = (p + q) / 2
        return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    if name == "tv":
        return tv
    if name == "nla":
        return -alpha.log()
    lam = torch.exp(-3 * alpha).detach()  # lk
    return lam * kl + (1 - lam) * tv


def setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=30, draft_vocab_size=VD)  # fmt: skip
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg).double()
    draft.reset_parameters(std=0.5)  # a draft far from the teacher: every term is large
    h = torch.randn(M, H, generator=g, dtype=torch.float64).requires_grad_()
    p = torch.softmax(2 * torch.randn(M, VD, generator=g, dtype=torch.float64), -1)  # (M, Vd)
    negent = (p * p.log()).sum(-1)
    top = torch.randint(-1, VD, (M,), generator=g)  # -1: outside the draft vocabulary
    mask = (torch.rand(M, generator=g) > 0.3).double()  # some positions not scored
    return draft, h, p, negent, top, mask


@pytest.mark.parametrize("name", LOSSES)
def test_each_loss_value_and_gradient_against_its_formula(name):
    draft, h, p, negent, top, mask = setup(LOSSES.index(name))
    rows = torch.arange(M)
    loss, kl_sum, _ = _head_stats(draft, h, rows, p, negent, top, mask, 0.0, {name: 1.0})
    got = torch.autograd.grad(loss, [h, draft.lm_head.weight])
    logits = draft.compute_logits(h)  # (M, Vd)
    want_loss = (direct(name, logits, p) * mask).sum()
    want = torch.autograd.grad(want_loss, [h, draft.lm_head.weight])
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(
        kl_sum, (direct("kl", logits, p) * mask).sum().detach(), rtol=1e-10, atol=1e-12
    )
    assert float(loss.detach()) > 0


def test_weighted_sum_and_hard_label_mix():
    """0.3*kl+0.7*tv is the weighted sum of the two; with --hard-weight w: (1 - w) soft + w argmax CE."""
    draft, h, p, negent, top, mask = setup(11)
    rows = torch.arange(M)
    terms = parse_loss("0.3*kl + 0.7*tv")
    loss, _, _ = _head_stats(draft, h, rows, p, negent, top, mask, 0.25, terms)
    logits = draft.compute_logits(h)
    soft = (0.3 * direct("kl", logits, p) + 0.7 * direct("tv", logits, p)) * mask
    hard = F.cross_entropy(logits, top.clamp(min=0), reduction="none") * (top >= 0) * mask
    torch.testing.assert_close(loss, 0.75 * soft.sum() + 0.25 * hard.sum(), rtol=1e-10, atol=1e-12)


def test_kl_is_todays_loss():
    """`kl` (the default) is the fused soft-target cross-entropy plus the teacher's negative entropy, as
    before the other losses existed: the same numbers to the bit, in fp32."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(M, VD, generator=g)
    p = torch.softmax(torch.randn(M, VD, generator=g), -1)
    negent = (p * p.log()).sum(-1)
    loss, kl = divergence({"kl": 1.0}, logits, p, negent)
    assert torch.equal(loss, F.cross_entropy(logits, p, reduction="none") + negent)
    assert torch.equal(kl, loss)


def test_parse_loss():
    assert parse_loss("kl") == {"kl": 1.0}
    assert parse_loss("0.5*kl+0.5*tv") == {"kl": 0.5, "tv": 0.5}
    assert parse_loss("lk + 2*jsd") == {"lk": 1.0, "jsd": 2.0}
    for bad, says in [
        ("ce", "unknown loss 'ce'"),
        ("x*kl", "'x' is not a number"),
        ("-1*kl", "must be positive"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_loss(bad)


def test_dpace_weights_are_the_chance_of_reaching_each_slot():
    """Two blocks of Q = 4: slot 1 weighs 1, slot i the product of the draft's probabilities of the labels at
    slots 1 .. i-1; after an unlabelled slot (outside the draft vocabulary) nothing is reached; the anchor 0."""
    from specdraft.train.block.objective import IGNORE, dpace_weights

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 5, generator=g)
    labels = torch.tensor([IGNORE, 1, 3, 0, IGNORE, 2, IGNORE, 4])
    q = torch.softmax(logits, -1)
    w = dpace_weights(logits, labels, 4).view(2, 4)
    want = torch.tensor([[0, 1, q[1, 1], q[1, 1] * q[2, 3]], [0, 1, 0, 0]])
    torch.testing.assert_close(w, want)


class _Target:
    """What `TeacherHead` reads of a target: its final norm and lm_head (no softcap)."""

    def __init__(self, H: int, V: int):
        from specdraft.model.draft import RMSNorm

        self.norm = RMSNorm(H, 1e-6).double()
        self.norm.weight.data = 1 + 0.1 * torch.randn(H, dtype=torch.float64)
        self.lm_head = torch.nn.Linear(H, V, bias=False).double()
        self.logit_softcap = None


@pytest.mark.parametrize("spec", ["ce", "kl", "tv", "lk", "0.5*ce+0.5*kl"])
def test_dflash_block_loss_value_and_gradient_against_its_formula(spec):
    """DFlash's --loss, through `block_loss`: at slot i of the block at anchor a (position a + i, labelled
    x_{a+i}), ce is -log q(x_{a+i}) and a soft loss compares q with the target's own distribution of that token,
    its norm + head on its final hidden state at a + i - 1, over the draft vocabulary (renormalised); each
    slot weighted exp(-(i-1)/gamma), unlabelled slots (past the end, loss-masked, outside the draft
    vocabulary) not at all. Value and gradient against the formula written out per slot in fp64."""
    from specdraft.model.dflash import DFlashConfig, DFlashDraft
    from specdraft.train.block.objective import (
        Objective,
        _chunk_logits,
        block_inputs,
        block_loss,
        target_to_draft,
    )
    from specdraft.train.ttt import TeacherHead

    torch.manual_seed(4)
    H, V, Vd, Q, T = 32, 40, 24, 4, 14
    cfg = DFlashConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=V, draft_vocab_size=Vd, num_hidden_layers=1, block_size=Q,
                       aux_layer_ids=[1, 2], mask_token_id=V - 1)  # fmt: skip
    draft = DFlashDraft(cfg).double()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V)[:Vd]] = True  # a draft vocabulary that is not the first Vd ids
    draft.set_vocab(torch.nonzero(t2d).flatten() - torch.arange(Vd), t2d)
    tgt = _Target(H, V)
    terms = parse_loss(spec, ("ce", *LOSSES))
    obj = Objective("exp", terms, None if set(terms) == {"ce"} else TeacherHead(tgt, draft.t2d))
    aux = torch.randn(T, 2 * H, dtype=torch.float64)
    final = torch.randn(T, H, dtype=torch.float64)
    ids = torch.randint(0, V, (T,))
    lm = torch.ones(T, dtype=torch.bool)
    lm[6] = False  # a loss-masked token inside a block
    anchors = torch.tensor([1, 4, 11])  # the last block runs past the end
    loss, st = block_loss(draft, aux, ids, lm, anchors, chunk=2, grad=True, obj=obj, final=final)
    params = [p for p in draft.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params)

    # the formula, slot by slot
    ctx = draft.context(aux[None])
    bids, bmask, bpos, labels = block_inputs(ids, lm, anchors, Q, target_to_draft(draft.t2d))
    logits = _chunk_logits(draft, ctx, torch.arange(T)[None], bids, bmask, bpos, anchors, Q)  # (N * Q, Vd)
    want = torch.zeros((), dtype=torch.float64)
    for r, (pos, label) in enumerate(zip(bpos.tolist(), labels.tolist())):
        i = r % Q
        if i == 0 or pos >= T or not lm[pos] or not t2d[ids[pos]]:
            assert label == IGNORE_LABEL
            continue
        logq = torch.log_softmax(logits[r], -1)
        full = tgt.lm_head(tgt.norm(final[pos - 1]))  # (V,): the target's prediction of the token at pos
        p = torch.softmax(full[t2d], -1)  # (Vd,)
        slot = terms.get("ce", 0.0) * -logq[label]
        for name, w in terms.items():
            if name != "ce":
                slot = slot + w * direct(name, logits[r][None], p[None])[0]
        want = want + torch.exp(torch.tensor(-(i - 1) / cfg.loss_decay_gamma, dtype=torch.float64)) * slot
    wgrad = torch.autograd.grad(want, params)
    # the slot losses and the teacher's head run in fp32 (as in training): agreement to fp32's precision
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, wgrad):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert (
        abs(st.loss - float(want.detach())) < 1e-5 * max(1.0, abs(float(want.detach())))
        and float(loss.detach()) > 0
    )


IGNORE_LABEL = -100

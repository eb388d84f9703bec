"""The DFlash draft and its block objective on tiny inputs, against dense references."""

from __future__ import annotations

import torch

from specdraft.model.dflash import DFlashConfig, DFlashDraft
from specdraft.train.block.objective import (
    IGNORE,
    block_inputs,
    block_loss,
    block_mask,
    evaluate,
    sample_anchors,
    target_to_draft,
    train_step,
    valid_anchors,
)


def tiny_cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                draft_vocab_size=50, num_hidden_layers=2, block_size=4, aux_layer_ids=[1, 2, 3, 4, 5],
                mask_token_id=7)  # fmt: skip
    return DFlashConfig(**{**base, **kw})


def test_config_checks():
    for bad in ({"block_size": 1}, {"aux_layer_ids": [3, 1]}, {"aux_layer_ids": []}, {"mask_token_id": 99}):
        try:
            tiny_cfg(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")
    assert tiny_cfg().loss_decay_gamma == 2.0


def test_anchor_sampling_matches_dense_reference():
    lm = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    T = lm.shape[0]
    dense = [a for a in range(T) if 1 <= a <= T - 2 and lm[a + 1]]
    assert valid_anchors(lm).tolist() == dense
    assert sample_anchors(lm, 100).tolist() == dense
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        s = sample_anchors(lm, 3, g).tolist()
        assert len(s) == 3 and len(set(s)) == 3 and s == sorted(s) and set(s) <= set(dense)
        seen |= set(s)
    assert seen == set(dense)  # every valid anchor is drawn
    assert valid_anchors(torch.ones(2, dtype=torch.bool)).numel() == 0


def test_block_mask_matches_dense_reference():
    anchors, C, Q = torch.tensor([2, 5, 6]), 8, 3
    m = block_mask(anchors, C, Q)
    N = anchors.numel()
    ref = torch.zeros(N * Q, C + N * Q, dtype=torch.bool)
    for j, a in enumerate(anchors.tolist()):
        for i in range(Q):
            r = j * Q + i
            for t in range(C):
                ref[r, t] = t < a  # context strictly before the anchor
            for jj in range(N):
                for ii in range(Q):
                    ref[r, C + jj * Q + ii] = jj == j  # the whole own block, nothing of another
    assert torch.equal(m, ref)


def test_block_inputs_labels():
    ids = torch.arange(10, 20)
    lm = torch.ones(10, dtype=torch.bool)
    lm[8] = False
    t2d = torch.ones(50, dtype=torch.bool)
    t2d[13] = False  # 13 is outside the draft vocabulary
    bids, is_mask, pos, labels = block_inputs(ids, lm, torch.tensor([2, 7]), 4, target_to_draft(t2d))
    assert pos.tolist() == [2, 3, 4, 5, 7, 8, 9, 10]
    assert is_mask.tolist() == [False, True, True, True] * 2
    assert bids.tolist()[0] == 12 and bids.tolist()[4] == 17
    # slot 0 never labelled; 13 not in the draft vocab; 14 -> draft index 13; position 8 masked; 10 past end
    assert labels.tolist() == [IGNORE, IGNORE, 13, 14, IGNORE, IGNORE, 18, IGNORE]


def _dense_block_logits(draft, aux, ids, a):
    """One block run alone: context f_0 .. f_{a-1}, block [x_a, mask..] at a .., no mask (sees all)."""
    Q = draft.cfg.block_size
    ctx = draft.context(aux[None, :a])
    kv = draft.context_kv(ctx, torch.arange(a)[None])
    bids = torch.tensor([[int(ids[a])] + [0] * (Q - 1)])
    is_mask = torch.tensor([[False] + [True] * (Q - 1)])
    return draft(bids, is_mask, torch.arange(a, a + Q)[None], kv, None)[0]


def test_batched_blocks_equal_each_block_alone():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    draft = DFlashDraft(cfg).eval()
    T, A = 12, 5 * 32
    aux, ids = torch.randn(T, A), torch.randint(0, 50, (T,))
    anchors = torch.tensor([1, 4, 5, 9])
    from specdraft.train.block.objective import _chunk_logits

    ctx = draft.context(aux[None])
    for chunk in (1, 2, 4):
        for s in range(0, 4, chunk):
            a = anchors[s : s + chunk]
            bids, bmask, bpos, _ = block_inputs(ids, torch.ones(T, dtype=torch.bool), a, cfg.block_size,
                                                target_to_draft(draft.t2d))  # fmt: skip
            got = _chunk_logits(draft, ctx, torch.arange(T)[None], bids, bmask, bpos, a, cfg.block_size)
            for j, aj in enumerate(a.tolist()):
                ref = _dense_block_logits(draft, aux, ids, aj)
                torch.testing.assert_close(got[j * 4 : (j + 1) * 4], ref, atol=1e-5, rtol=1e-5)


def test_loss_chunking_and_checkpointing_agree():
    torch.manual_seed(1)
    draft = DFlashDraft(tiny_cfg())
    T = 16
    aux, ids, lm = torch.randn(T, 160), torch.randint(0, 50, (T,)), torch.ones(T, dtype=torch.bool)
    anchors = valid_anchors(lm)
    grads = []
    for chunk, grad in ((3, True), (100, True)):
        draft.zero_grad()
        loss, st = block_loss(draft, aux, ids, lm, anchors, chunk, grad)
        loss.backward()
        grads.append(draft.fc.weight.grad.clone())
        assert abs(st.loss - float(loss.detach())) < 1e-3 and st.blocks == anchors.numel()
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    assert draft.embed_tokens.weight.grad is None  # the target's embedding stays frozen


def test_training_learns_a_block():
    """A few steps on one repeated sequence: loss falls and the per-slot accuracy rises."""
    torch.manual_seed(2)
    draft = DFlashDraft(tiny_cfg(block_size=3))
    T = 20
    seq = (torch.randn(T, 160), torch.randint(0, 50, (T,)), torch.ones(T, dtype=torch.bool))
    before = evaluate(draft, [seq]).summary()
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=5e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(25):
        train_step(draft, opt, [seq], anchors_per_seq=8, chunk=4, generator=g)
    after = evaluate(draft, [seq]).summary()
    assert after["loss"] < before["loss"] * 0.5
    assert after["acc"][0] > 0.8 and after["tau"] > before["tau"] + 0.5

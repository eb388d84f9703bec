"""TTT attention and targets: the merged-softmax attention equals the old dense masked SDPA (values and
gradients, fp32), and positions whose full-vocabulary target argmax is outside the draft vocabulary are
dropped from the loss (EAGLE-3) while accuracy is scored against the full-vocabulary argmax."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import StubDraft, stub_unroll
from torch import nn

import specdraft.train.loop as loop
import specdraft.train.ttt as ttt
from specdraft.model.draft import DraftConfig, DraftKVCache, Eagle3Draft, RMSNorm
from specdraft.train.config import TrainConfig
from specdraft.train.ttt import TeacherHead, TTTModel, keep_mask, step_token_counts, ttt_attention, ttt_unroll

# ---------------------------------------------------------------------------------------------------------
# the reference: the old dense formulation, [causal | eye | ... | eye] over (i + 1) T keys
# ---------------------------------------------------------------------------------------------------------


def ttt_mask(T: int, step: int) -> torch.Tensor:
    """bool (1, 1, T, (step + 1) T), True = attend: causal over step-0 keys, the diagonal of each later step."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)
    eye = torch.eye(T, dtype=torch.bool)  # (T, T)
    return torch.cat([causal] + [eye] * step, dim=1)[None, None]  # (1, 1, T, (step + 1) T)


def masked_attention(q: torch.Tensor, keys: list) -> torch.Tensor:
    """Dense SDPA of q (B, nh, T, d) over the concatenated keys of steps 0..i under `ttt_mask`."""
    nh, nkv, T = q.shape[1], keys[0][0].shape[1], q.shape[2]
    k = torch.cat([k for k, _ in keys], dim=2).repeat_interleave(nh // nkv, dim=1)  # (B, nh, (i+1) T, d)
    v = torch.cat([v for _, v in keys], dim=2).repeat_interleave(nh // nkv, dim=1)  # (B, nh, (i+1) T, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ttt_mask(T, len(keys) - 1))  # (B, nh, T, d)


def masked_unroll(draft: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, ttt_steps: int):
    """The old `ttt_unroll`: the draft's own forward with a DraftKVCache and `ttt_mask(T, i)`."""
    B, T = input_ids.shape
    ids = F.pad(input_ids, (0, ttt_steps + 1))  # (B, T + K + 1)
    pos = torch.arange(T)[None].expand(B, T)  # (B, T)
    h, cache = draft.fuse(aux), DraftKVCache()  # (B, T, H)
    for i in range(ttt_steps):
        mask = None if i == 0 else ttt_mask(T, i)  # (1, 1, T, (i + 1) T)
        h, _ = draft(ids[:, 1 + i : 1 + i + T], h, pos + i, mask, cache, compute_logits=False)  # (B, T, H)
        yield h


@pytest.mark.parametrize("step", [0, 1, 2, 6])
def test_reference_mask_is_the_spec(step):
    n = 5
    m = ttt_mask(n, step)
    for t in range(n):
        for j in range(step + 1):
            for u in range(n):
                assert bool(m[0, 0, t, j * n + u]) == (u <= t if j == 0 else u == t), (t, j, u)


# ---------------------------------------------------------------------------------------------------------
# the new attention == the old one
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nh,nkv,chunk", [(4, 2, 1 << 20), (4, 2, 4 * 2 * 3), (2, 2, 2 * 2 * 5), (4, 1, 1)])
def test_ttt_attention_equals_masked_sdpa(nh, nkv, chunk):
    """Values and gradients (q and every step's k, v), fp32, GQA, one chunk or many (3, 5, 1 rows)."""
    g = torch.Generator().manual_seed(nh + nkv + chunk)
    B, T, d = 2, 11, 8
    for step in range(4):
        q = torch.randn(B, nh, T, d, generator=g).requires_grad_()
        keys = [(torch.randn(B, nkv, T, d, generator=g).requires_grad_(),
                 torch.randn(B, nkv, T, d, generator=g).requires_grad_()) for _ in range(step + 1)]  # fmt: skip
        leaves = [q] + [t for kv in keys for t in kv]
        new, old = ttt_attention(q, keys, chunk), masked_attention(q, keys)  # (B, nh, T, d) each
        torch.testing.assert_close(new, old)
        grad_out = torch.randn(new.shape, generator=g)
        for a, b in zip(
            torch.autograd.grad(new, leaves, grad_out), torch.autograd.grad(old, leaves, grad_out)
        ):
            torch.testing.assert_close(a, b)


def close(a: torch.Tensor, b: torch.Tensor, **kw) -> None:
    """Equal up to summation order: fp64 to 1e-10; fp32 to 2e-5 of the tensor's largest entry (the large
    test weights make gradients ~ 500 and peaked softmaxes, so fp32 rounding reaches ~1e-4 absolute)."""
    if a.dtype == torch.float64:
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, **kw)
    else:
        torch.testing.assert_close(a, b, atol=2e-5 * float(b.detach().abs().max()), rtol=1e-5, **kw)


def tiny_draft(norm_before_residual: bool, **kw) -> Eagle3Draft:
    """kw: num_hidden_layers, fc_norm, norm_output (deeper drafts, EAGLE-3.1)."""
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=40, draft_vocab_size=16, norm_before_residual=norm_before_residual, **kw)  # fmt: skip
    draft = Eagle3Draft(cfg)
    draft.reset_parameters(std=0.3)  # large weights: attention mixing is visible
    return draft


DEEP = {"num_hidden_layers": 3}
V31 = {"fc_norm": True, "norm_output": True}  # EAGLE-3.1


@pytest.mark.parametrize("norm_before_residual,dtype,ck,kw", [(False, torch.float32, False, {}), (True, torch.float32, False, {}),
                                                              (False, torch.float64, False, {}), (False, torch.float64, True, {}),
                                                              (False, torch.float64, False, DEEP), (False, torch.float64, True, DEEP),
                                                              (False, torch.float64, False, V31), (True, torch.float64, False, {**V31, **DEEP})])  # fmt: skip
def test_ttt_unroll_equals_masked_unroll(norm_before_residual, dtype, ck, kw):
    """Every step's hidden_out and the gradients of every draft parameter equal the old masked unroll
    (ck: each step's layer recomputed in backward, `checkpoint_layer`), for deeper drafts (3 layers, each
    with its own cache) and EAGLE-3.1 (per-layer fc norms, the post-norm state fed back) too."""
    draft = tiny_draft(norm_before_residual, **kw).to(dtype)
    for m in draft.modules() if kw else ():  # norms away from 1: a norm applied twice or not at all shows
        if isinstance(m, RMSNorm):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    B, T, K = 2, 9, 4
    ids = torch.randint(0, 40, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * 32, generator=g).to(dtype)
    weights = [torch.randn(B, T, 32, generator=g).to(dtype) for _ in range(K)]  # a loss touching every step

    def run(unroll):
        draft.zero_grad()
        hs = list(unroll(draft, ids, aux, K))  # K x (B, T, H)
        sum((h * w).sum() for h, w in zip(hs, weights)).backward()
        return hs, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    new_h, new_g = run(
        lambda *a: ttt_unroll(*a, chunk_elems=B * 4 * T * 2, checkpoint_layer=ck)
    )  # 2 rows a chunk
    old_h, old_g = run(masked_unroll)
    for a, b in zip(new_h, old_h):
        close(a, b)
    assert (
        new_g.keys() == old_g.keys() and "midlayer.self_attn.k_proj.weight" in old_g and "fc.weight" in old_g
    )
    if kw.get("num_hidden_layers"):
        assert "later_layers.1.self_attn.q_proj.weight" in old_g
    if kw.get("fc_norm"):
        assert "fc_norm.2.weight" in old_g
    for n in old_g:
        close(new_g[n], old_g[n], msg=n)


@pytest.mark.parametrize("chunk,ck,kw", [(1 << 20, False, {}), (2 * 4 * 9 * 2, False, {}), (2 * 4 * 9 * 2, True, {}),
                                         (2 * 4 * 9 * 2, False, {**DEEP, **V31})])  # fmt: skip
def test_live_slots_only_equal_every_slot(chunk, ck, kw):
    """Computing each TTT step only at its live slots (`live_slots`) gives the same hidden states at every
    scored slot and the same gradients as computing every slot: fp64, ragged rows (a prompt, a gap inside
    an answer, padding), the dense attention (one chunk) and the chunked one (2 rows a chunk), with and
    without `checkpoint_layer`; a deeper EAGLE-3.1 draft too."""
    draft = tiny_draft(False, **kw).to(torch.float64)
    g = torch.Generator().manual_seed(3)
    B, T, K = 2, 9, 3
    ids = torch.randint(0, 40, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * 32, generator=g).double()
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0, 1, 0]], dtype=torch.float64)
    live = ttt.live_slots(mask, K)
    # row 1: step 0 scores slots 0, 1, 5 (tokens 2, 3, 7), step 1 slots 0, 4, step 2 slot 3
    assert live[0][1].tolist() == [True, True, False, True, True, True, False, False, False]
    assert live[2][1].tolist() == [False, False, False, True, False, False, False, False, False]
    scored = [F.pad(mask, (0, K + 2))[:, 2 + i : 2 + i + T] > 0 for i in range(K)]  # (B, T) per step
    weights = [torch.randn(B, T, 32, generator=g).double() for _ in range(K)]

    def run(lv):
        draft.zero_grad()
        hs = list(ttt_unroll(draft, ids, aux, K, chunk_elems=chunk, checkpoint_layer=ck, live=lv))
        sum((h * w * s[..., None]).sum() for h, w, s in zip(hs, weights, scored)).backward()
        return [h[s] for h, s in zip(hs, scored)], {n: p.grad.clone() for n, p in draft.named_parameters()
                                                     if p.grad is not None}  # fmt: skip

    (new_h, new_g), (old_h, old_g) = run(live), run(None)
    for a, b in zip(new_h, old_h):
        close(a, b)
    assert new_g.keys() == old_g.keys() and "midlayer.self_attn.q_proj.weight" in old_g
    for n in old_g:
        close(new_g[n], old_g[n], msg=n)


# ---------------------------------------------------------------------------------------------------------
# out-of-vocabulary target positions
# ---------------------------------------------------------------------------------------------------------

V, VD = 8, 4
KEEP = torch.tensor([True, False, True, False, True, False, True, False])  # draft vocabulary: ids 0, 2, 4, 6
ARGMAX = [2, 5, 4, 7, 0, 6]  # the full-vocabulary target argmax at teacher positions 0..5
TOP = [1, -1, 2, -1, 0, 3]  # its draft index, -1 outside the draft vocabulary (positions 1 and 3)


def oov_teacher() -> tuple[TeacherHead, torch.Tensor]:
    """A target whose norm is the identity and lm_head the identity (V = H = 8): logits = final.

    Teacher position t puts 5 on ARGMAX[t]; where that is outside the draft vocabulary, 3 on the next id
    (inside), so the argmax inside the draft vocabulary differs from the full one there.
    """
    head = nn.Linear(V, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(V))
    target = SimpleNamespace(norm=nn.Identity(), lm_head=head, logit_softcap=None)
    final = torch.zeros(1, len(ARGMAX), V)  # (B, T, V)
    for t, a in enumerate(ARGMAX):
        final[0, t, a] = 5.0
        if a % 2:  # outside the draft vocabulary: an in-vocabulary runner-up, the restricted argmax
            final[0, t, (a + 1) % V] = 3.0
    return TeacherHead(target, KEEP, chunk_elems=2 * V), final  # 2 tokens a chunk


def test_teacher_marks_out_of_vocabulary_argmax():
    teacher, final = oov_teacher()
    logits, top = teacher(final)  # (1, 6, 4), (1, 6)
    assert top[0].tolist() == TOP
    torch.testing.assert_close(logits, final[..., KEEP])


def test_teacher_under_bf16_autocast_equals_autocasts_own_cast_of_lm_head():
    """The teacher casts lm_head once for bf16 autocast (autocast would cast it at every call): the same logits and
    argmax to the bit as F.linear under autocast, and fp32 outside autocast."""
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(16, 40, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 16, generator=g))
        head.bias.copy_(torch.randn(40, generator=g))
    keep = torch.zeros(40, dtype=torch.bool)
    keep[::3] = True
    teacher = TeacherHead(
        SimpleNamespace(norm=nn.Identity(), lm_head=head, logit_softcap=None), keep, chunk_elems=80
    )
    z = torch.randn(2, 9, 16, generator=g)
    for _ in range(2):  # the second call reuses the cast
        with torch.autocast("cpu", torch.bfloat16):
            logits, top = teacher(z)
            full = torch.nn.functional.linear(z, head.weight, head.bias).float()  # autocast's own cast
        assert torch.equal(logits, full[..., keep])
        assert torch.equal(
            top, torch.where(keep[full.argmax(-1)], torch.cumsum(keep.long(), 0)[full.argmax(-1)] - 1, -1)
        )
    assert teacher._weight_cast[0].dtype == torch.bfloat16
    logits32, _ = teacher(z)  # outside autocast: lm_head as it is
    assert logits32.dtype == torch.float32
    torch.testing.assert_close(logits32, head(z).detach()[..., keep])  # (chunked: float noise of the matmul)


@pytest.mark.parametrize("oov_mask", [True, False])
def test_out_of_vocabulary_positions_are_dropped_and_scored_against_full_argmax(monkeypatch, oov_mask):
    """T = 6, K = 2, loss mask on tokens 1..5. Step i, slot t predicts token t+2+i from teacher t+1+i.

    Token p is out of vocabulary when TOP[p - 1] == -1: tokens 2 and 4. Step 0 scores tokens 2..5 (4
    positions, 2 dropped: share 1/2), step 1 tokens 3..5 (3 positions, token 4 dropped: share 1/3).
    The draft copies the teacher's draft-vocabulary logits, so its argmax is the draft-vocabulary argmax:
    right on in-vocabulary tokens, wrong on the others: acc = [2/4, 2/3] (1.0 against the restricted one).
    """
    monkeypatch.setattr(ttt, "ttt_unroll", stub_unroll)
    teacher, final = oov_teacher()
    K, T = 2, len(ARGMAX)
    b = SimpleNamespace(final=final, loss_mask=torch.tensor([[0.0, 1, 1, 1, 1, 1]]))
    t = loop._teacher(teacher, b, TrainConfig(ttt_steps=K, oov_mask=oov_mask), contextlib.nullcontext)
    kept = [0, 1, 0, 1, 0, 1] if oov_mask else [0, 1, 1, 1, 1, 1]  # tokens 2 and 4 out of vocabulary
    assert t.kl_mask[0].tolist() == kept
    assert t.counts.tolist() == [[4, 3], [2, 2] if oov_mask else [4, 3], [2, 1]]

    def run(logits, hard=0.0):
        m = TTTModel(StubDraft(logits), K, 0.8, checkpoint_head=False, hard_weight=hard)
        ids, aux = torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, 3)
        return m(
            ids, aux, t.p, t.negent, t.top, t.row, b.loss_mask, t.kl_mask, t.counts[1]
        )  # loss, kl, agree

    # the teacher is computed only where the next token is scored: positions 0..4 (tokens 1..5)
    assert t.row[0].tolist() == [0, 1, 2, 3, 4, -1] and t.p.shape == (5, VD)
    logp = torch.zeros(1, T, VD)  # (1, T, Vd) the teacher's log-probs at its positions
    logp[0, :5] = t.p.log()
    # KL: a uniform draft has KL = log Vd - entropy(teacher) at each scored teacher position
    _, kl, _ = run(torch.zeros(1, T, VD))
    per_pos = torch.log(torch.tensor(float(VD))) + F.pad(t.negent, (0, 1))  # (T,) teacher positions
    teach = [[2, 4], [2, 4]] if oov_mask else [[1, 2, 3, 4], [2, 3, 4]]  # teacher positions of kept tokens
    torch.testing.assert_close(kl, torch.stack([per_pos[p].sum() for p in teach]))
    # hard targets: the loss is the cross-entropy against the full-vocabulary argmax (log Vd for a uniform
    # draft; none where that argmax is out of vocabulary), the KL reported is the same
    loss_h, kl_h, _ = run(torch.zeros(1, T, VD), hard=1.0)
    torch.testing.assert_close(kl_h, kl)
    share = [1, 1] if oov_mask else [2 / 4, 2 / 3]  # in-vocabulary share of each step's KL positions
    hard_loss = math.log(VD) * (share[0] + 0.8 * share[1])
    assert float(loss_h) == pytest.approx(hard_loss, rel=1e-5)
    kl_loss = float(run(torch.zeros(1, T, VD))[0])
    loss_m, _, _ = run(torch.zeros(1, T, VD), hard=0.25)  # a mix: (1 - w) KL + w cross-entropy
    assert float(loss_m) == pytest.approx(0.75 * kl_loss + 0.25 * hard_loss, rel=1e-5)

    # accuracy against the full-vocabulary argmax over every loss position, and the logged shares
    loss, kl_copy, agree = run(logp)  # the draft copies the teacher's draft-vocabulary distribution
    assert float(loss.detach()) < 1e-6 and agree.tolist() == [2, 2]
    rec = loop._step_means(kl, agree, t.counts, 0.8)
    assert rec["acc"] == pytest.approx([2 / 4, 2 / 3])
    assert rec["oov_share"] == pytest.approx([1 / 2, 1 / 3])
    n_kl = [2, 2] if oov_mask else [4, 3]
    assert rec["kl"] == pytest.approx([float(kl[i]) / n_kl[i] for i in range(K)])


def test_keep_mask_shifts_onto_the_predicted_token():
    top = torch.tensor([[3, -1, 0, -1]])
    mask = torch.ones(1, 4)
    assert keep_mask(mask, top, True).tolist() == [
        [0, 1, 0, 1]
    ]  # token p dropped when top[p - 1] == -1 (0: none)
    assert keep_mask(mask, top, False) is mask
    assert step_token_counts(keep_mask(mask, top, True), 2).tolist() == [1.0, 1.0]


def test_head_checkpointing_auto_turns_on_past_the_budget():
    # K x tokens x Vd x 12 B: the quickstart's 3 x 2048 x 8192 (0.6 GB) stays off, EAGLE-3's 7 x 4096 x 32000 is on
    assert not ttt.head_checkpointing("auto", 3, 2048, 8192)
    assert ttt.head_checkpointing("auto", 7, 4096, 32000)
    assert ttt.head_checkpointing("on", 1, 1, 1) and not ttt.head_checkpointing("off", 7, 10**6, 10**6)

"""Training-time test (TTT): the draft unrolled K steps on target features, its attention, the teacher, the loss.

Alignment (one sample of T tokens x_0 .. x_{T-1}; target features f_t = cat(aux_1, aux_2, aux_3) at
position t, (T, 3H); the target's final hidden state z_t (id L, before the norm), (T, H)):

    TTT step i = 0 .. K-1, draft slot t:
        input token      x_{t+1+i}                 ids shifted by 1 + i          (B, T)
        input hidden     fc(f_t)          (i = 0)  fused target features        (B, T, H)
                         hidden_out_{i-1}[t] (i>0)  the draft's own previous output (pre-final-norm)
        position         t + i                                                  (B, T)
        predicts         x_{t+2+i}
        teacher          softmax over the draft vocabulary of lm_head(norm(z_{t+1+i}))[t2d]    (B, T, Vd)
        target top-1     argmax over the FULL vocabulary of lm_head(norm(z_{t+1+i}))        (B, T)
        loss mask        loss_mask[t+2+i] (0 where t+2+i >= T)                 (B, T)
        KL mask          loss mask * t2d[target top-1] (oov_mask, EAGLE-3's default), else the loss mask
        attention keys   step-0 keys at slots 0..t (causal prefix over target-feature keys) and, for
                         each earlier step j in 1..i, only step j's key at slot t (the same position)

    This is exactly what speculative decoding runs: after a target forward over x_0..x_{p+1}, the draft's
    first step sees features of 0..p with tokens x_1..x_{p+1} (cache of step-0 keys), and its j-th next
    step feeds its own hidden state at position p+j, attending to that cache plus its own earlier keys.

    Attention (`ttt_attention`): the causal scores over the step-0 keys (chunked, never (T, T) at once) and
    the i diagonal scores are merged in one softmax by their log-sum-exps; no (T, (i+1) T) mask is built.

    Only what the loss reads is computed: step i runs at its live slots (`live_slots`: scored at step i or
    later; step 0 still computes keys and values at every slot, the causal prefix of every query), lm_head
    at the scored slots, and the teacher at the positions whose next token is loss-masked. Prompt tokens
    and padding cost only step 0's keys and values.

    loss = sum_i decay**i * KL(teacher_i || draft_i) (a fused soft-target cross-entropy minus the
    teacher's entropy), each averaged over the KL-masked tokens of the whole
    global batch (all ranks); acc_i = share of the loss-masked tokens where the draft's top-1, mapped to a
    target id, equals the target's full-vocabulary top-1 (an out-of-vocabulary target is always a miss);
    oov_share_i = share of the loss-masked tokens whose target top-1 is outside the draft vocabulary.

Shapes: B rows, T tokens, H the target's hidden size, Vd the draft vocabulary, K the TTT steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as grad_checkpoint

from specdraft.model.draft import Eagle3Draft, apply_rotary
from specdraft.train.losses import divergence


class TeacherHead(nn.Module):
    """The target's frozen final norm + lm_head: z (B, T, H) -> draft-vocabulary logits and the full argmax.

    The logits over the draft vocabulary equal `target.logits_from_final(z)[..., t2d]`, computed by lm_head's
    t2d rows alone (`draft_logits`, a (Vd, H) copy); the full-vocabulary logits are computed `chunk_elems` at a
    time, only for their argmax (never all of (B, T, V)): the costly part, which a later epoch can skip where the
    argmax is known (`TopCache`).
    """

    def __init__(self, target, t2d: torch.Tensor, chunk_elems: int = 1 << 26):
        super().__init__()
        self.norm = copy.deepcopy(target.norm).requires_grad_(False)
        head = target.lm_head
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"the target's lm_head is a {type(head).__name__}, not a Linear: not supported yet"
            )
        keep = t2d.to(head.weight.device)
        assert keep.shape[0] == head.weight.shape[0], (
            f"t2d covers {keep.shape[0]} ids, lm_head {head.weight.shape[0]}"
        )
        self.register_buffer(
            "weight", head.weight.detach(), persistent=False
        )  # (V, H), shared with the target
        self.register_buffer(
            "bias", None if head.bias is None else head.bias.detach(), persistent=False
        )  # (V,)
        self.register_buffer("keep", keep.clone(), persistent=False)  # (V,) bool: t2d
        self.register_buffer("draft_index", torch.cumsum(keep.long(), 0) - 1, persistent=False)  # (V,)
        self.softcap = target.logit_softcap
        self.chunk_elems = chunk_elems
        self._weight_cast: tuple[torch.Tensor, torch.Tensor | None] | None = None  # `_cast`'s copy
        self._draft_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None  # `_draft_weight`'s copy
        self.draft_vocab_size = int(keep.sum())

    def _cast(self, device_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """lm_head's weight and bias in the dtype autocast would cast them to (bf16 under bf16 autocast), cast once
        and kept: autocast casts the (V, H) weight again at every call (a tenth of the teacher's time here)."""
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        if dtype is None or dtype == self.weight.dtype:
            return self.weight, self.bias
        if self._weight_cast is None or self._weight_cast[0].dtype != dtype:
            self._weight_cast = (self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype))
        return self._weight_cast

    def _draft_weight(self, device_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """lm_head's t2d rows (Vd, H) and bias, in `_cast`'s dtype: copied once (again when that dtype changes)."""
        weight, bias = self._cast(device_type)
        if self._draft_rows is None or self._draft_rows[0].dtype != weight.dtype:
            self._draft_rows = (weight[self.keep].contiguous(), None if bias is None else bias[self.keep])
        return self._draft_rows

    def _normed(self, final: torch.Tensor) -> torch.Tensor:
        """final (..., H) -> the final norm's output (n, H), flattened."""
        return self.norm(final.to(self.weight.dtype)).reshape(-1, final.shape[-1])  # (..., H) -> (n, H)

    def _softcapped(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    @torch.no_grad()
    def draft_logits(self, final: torch.Tensor) -> torch.Tensor:
        """final (..., H) -> the logits over the draft vocabulary (..., Vd) fp32: `forward`'s first output, to the
        bit, at 1/6 of its cost for SmolLM2 (Vd / V)."""
        return self._draft(self._normed(final), final.shape[:-1])

    def _draft(self, z: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        """The normed z (n, H) -> the draft-vocabulary logits (*lead, Vd) fp32."""
        weight, bias = self._draft_weight(z.device.type)
        logits = self._softcapped(F.linear(z.to(weight.dtype), weight, bias).float())  # (n, Vd)
        return logits.view(*lead, self.draft_vocab_size)

    @torch.no_grad()
    def forward(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """final (..., H) -> (logits over the draft vocabulary (..., Vd) fp32, top (...) long).

        `top` is the draft index of the full-vocabulary argmax (first maximum, as torch.argmax), -1 where
        that argmax is outside the draft vocabulary.
        """
        lead = final.shape[:-1]
        z = self._normed(final)  # (n, H)
        weight, bias = self._cast(z.device.type)
        zc = z.to(weight.dtype)
        step = max(1, self.chunk_elems // self.weight.shape[0])
        tops = []
        for s in range(0, zc.shape[0], step):
            full = self._softcapped(F.linear(zc[s : s + step], weight, bias).float())  # (c, V)
            top = full.argmax(-1)  # (c,) target ids
            tops.append(torch.where(self.keep[top], self.draft_index[top], -1))  # (c,) draft index or -1
        top = torch.cat(tops).view(lead) if tops else z.new_zeros(lead, dtype=torch.long)  # (...)
        return self._draft(z, lead), top  # (..., Vd), (...)


# ---------------------------------------------------------------------------------------------------------
# the teacher's argmax of each sample, kept: a later epoch computes the draft-vocabulary logits only
# ---------------------------------------------------------------------------------------------------------

#: The teacher costs one (V, H) lm_head product a scored position, only for the argmax over the whole vocabulary
#: (which positions count, and the accuracy); the draft-vocabulary logits need the t2d rows alone (Vd of V: 1/6
#: for SmolLM2). The target's states of a sample are the same every epoch (shards), so its argmax is too: kept
#: the first time, a later epoch and every validation after the first compute the draft-vocabulary logits only.
#: Kept as the draft index (`TeacherHead`'s `top`: -1 outside the draft vocabulary), UNKNOWN where not computed
#: yet; at most `max_entries` positions (a run whose data would not fit computes the rest each time).
UNKNOWN = -2  # a position whose argmax was not computed yet


class TopCache:
    """Sample id -> its positions' teacher top (draft index), filled as batches compute it.

    Args:
        max_entries: positions kept at most (int32 each), over all samples.
    """

    def __init__(self, max_entries: int = 1 << 26):
        self.max_entries = max_entries
        self.entries = 0
        self.tops: dict[int, torch.Tensor] = {}  # sid -> (n,) int32 on the CPU

    def known(self, sids: list[int], need: torch.Tensor) -> torch.Tensor | None:
        """The top at every `need` position of rows `sids` ((B, T) bool), as `need[need]`'s (N,) long on its
        device; None when any of them is unknown (the caller then computes them all)."""
        if len(sids) != need.shape[0]:  # a stand-in row (a rank without a sample): compute
            return None
        rows = []
        for sid, pos in zip(sids, _positions(need)):
            t = self.tops.get(sid)
            if len(pos) and (t is None or int(pos[-1]) >= len(t) or bool((t[pos] == UNKNOWN).any())):
                return None
            rows.append(t[pos] if len(pos) else torch.empty(0, dtype=torch.int32))
        return torch.cat(rows).to(need.device, torch.long)

    def record(self, sids: list[int], need: torch.Tensor, top: torch.Tensor) -> None:
        """Record `top` ((N,): `need`'s positions in row-major order) for rows `sids`."""
        if len(sids) != need.shape[0]:
            return
        top, at = top.to("cpu", torch.int32), 0
        for sid, pos in zip(sids, _positions(need)):
            t = self._row(sid, int(pos[-1]) + 1) if len(pos) else None
            if t is not None:
                t[pos] = top[at : at + len(pos)]
            at += len(pos)
        assert at == len(top), (at, len(top))

    def _row(self, sid: int, n: int) -> torch.Tensor | None:
        """Sample `sid`'s tops, at least `n` long (grown with UNKNOWN); None when that would pass max_entries."""
        t = self.tops.get(sid, torch.empty(0, dtype=torch.int32))
        if len(t) < n:
            if self.entries + n - len(t) > self.max_entries:
                return None
            self.entries += n - len(t)
            t = self.tops[sid] = torch.cat([t, torch.full((n - len(t),), UNKNOWN, dtype=torch.int32)])
        return t


def _positions(need: torch.Tensor) -> list[torch.Tensor]:
    """Each row's True positions of `need` (B, T), on the CPU (one copy of the mask, not one sync a row)."""
    return [row.nonzero().squeeze(1) for row in need.cpu()]


# ---------------------------------------------------------------------------------------------------------
# TTT attention: causal over the step-0 keys + the diagonal keys of later steps, merged in one softmax
# ---------------------------------------------------------------------------------------------------------


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in the softmax's precision: fp32, or fp64 when x is fp64."""
    return x if x.dtype == torch.float64 else x.float()


def _chunk_scores(q_c, k_b, a: int, scale: float, qpos_c=None) -> torch.Tensor:
    """Causal fp32 scores of query rows a .. a+C-1 over keys 0 .. b-1, -inf where a key's slot is past the
    query's: the query at row r sits at slot r (qpos_c None) or at slot qpos_c[:, r - a] ((B, C)).

    q_c (B, kvh, g, C, d), k_b (B, kvh, 1, b, d) -> (B, kvh, g, C, b).
    """
    C, b = q_c.shape[-2], k_b.shape[-2]
    s = _wide(torch.matmul(q_c, k_b.transpose(-1, -2))) * scale  # (B, kvh, g, C, b)
    keys = torch.arange(b, device=s.device)  # (b,)
    if qpos_c is None:
        above = keys[None] > torch.arange(a, a + C, device=s.device)[:, None]  # (C, b)
    else:
        above = (keys[None, None] > qpos_c[..., None])[:, None, None]  # (B, C, b) -> (B, 1, 1, C, b)
    return s.masked_fill(above, float("-inf"))


class _CausalLSE(torch.autograd.Function):
    """Causal attention of q over k, v and its log-sum-exp, `rows` query rows at a time (flash-style).

    Nothing of size T x T is ever held: the forward keeps (out, lse), the backward recomputes each chunk's
    probabilities. The gradient includes the lse output's (dS = P * (dP - rowsum(dO * out) + dlse)).
    q (B, kvh, g, L, d) (query heads grouped by their kv head), k, v (B, kvh, 1, T, d), qpos (B, L) the
    slot of each query row (None: row r is slot r, L = T) -> out (B, kvh, g, L, d), lse (B, kvh, g, L) fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, rows: int, qpos=None):
        L = q.shape[-2]
        # keys each chunk needs: up to its last slot (one host read of the query slots for all chunks)
        last = list(range(L)) if qpos is None else qpos.amax(0).tolist()  # (L,) max slot over the batch
        ends = [max(last[a : a + rows]) + 1 for a in range(0, L, rows)]
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=_wide(q).dtype)
        for a, b in zip(range(0, L, rows), ends):
            c = min(a + rows, L)
            qp = None if qpos is None else qpos[:, a:c]  # (B, C)
            s = _chunk_scores(q[..., a:c, :], k[..., :b, :], a, scale, qp)  # (B, kvh, g, C, b)
            lse[..., a:c] = torch.logsumexp(s, -1)  # (B, kvh, g, C)
            p = torch.exp(s - lse[..., a:c, None])  # (B, kvh, g, C, b)
            out[..., a:c, :] = torch.matmul(p.to(v.dtype), v[..., :b, :])  # (B, kvh, g, C, d)
        ctx.save_for_backward(q, k, v, out, lse, qpos)
        ctx.scale, ctx.rows, ctx.ends = scale, rows, ends
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, qpos = ctx.saved_tensors
        scale, rows, L = ctx.scale, ctx.rows, q.shape[-2]
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(_wide(k)), torch.zeros_like(_wide(v))
        delta = (_wide(d_out) * _wide(out)).sum(-1) - d_lse  # (B, kvh, g, L)
        for a, b in zip(range(0, L, rows), ctx.ends):
            c = min(a + rows, L)
            q_c, k_b, v_b, do_c = q[..., a:c, :], k[..., :b, :], v[..., :b, :], d_out[..., a:c, :]
            qp = None if qpos is None else qpos[:, a:c]  # (B, C)
            p = torch.exp(_chunk_scores(q_c, k_b, a, scale, qp) - lse[..., a:c, None])  # (B, kvh, g, C, b)
            dp = _wide(torch.matmul(do_c, v_b.transpose(-1, -2)))  # (B, kvh, g, C, b)
            ds = p * (dp - delta[..., a:c, None]) * scale  # (B, kvh, g, C, b)
            dq[..., a:c, :] = torch.matmul(ds.to(k.dtype), k_b)  # (B, kvh, g, C, d)
            # keys and values are shared by the g query heads of a group: sum over g
            dk[..., :b, :] += _wide(torch.matmul(ds.transpose(-1, -2).to(q.dtype), q_c)).sum(2, keepdim=True)
            dv[..., :b, :] += _wide(torch.matmul(p.transpose(-1, -2).to(do_c.dtype), do_c)).sum(
                2, keepdim=True
            )
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ttt_attention(q: torch.Tensor, keys: list, chunk_elems: int = 1 << 25, qpos=None) -> torch.Tensor:
    """Attention of TTT step i = len(keys) - 1 without a (T, (i+1) T) mask.

    q (B, nh, L, d): step i's queries, at slots qpos (B, L) (None: every slot, L = T); keys [(k_j, v_j)]
    of steps 0..i: step 0's over every slot (B, nkv, T, d), each later step's at the queries' slots
    (B, nkv, L, d) (GQA: query head h reads kv head h // (nh / nkv), as the draft's repeat_interleave).
    The query at slot t attends to step-0 keys 0..t (causal, chunked: about `chunk_elems` scores at a
    time) and to step j's key at slot t for j = 1..i; the two parts are merged in one softmax by their
    log-sum-exps. Returns (B, nh, L, d).
    """
    B, nh, L, d = q.shape
    nkv, T = keys[0][0].shape[1], keys[0][0].shape[2]
    assert nh % nkv == 0 and keys[0][0].shape == (B, nkv, T, d), (q.shape, keys[0][0].shape)
    assert (qpos is None and L == T) or (qpos is not None and qpos.shape == (B, L)), (q.shape, T)
    assert all(k.shape == (B, nkv, L, d) for k, _ in keys[1:]), (q.shape, [k.shape for k, _ in keys])
    if B * nh * L * (T + L * (len(keys) - 1)) <= chunk_elems:  # the dense scores fit: one fused kernel call
        return _dense_ttt_attention(q, keys, qpos)
    g, scale = nh // nkv, d**-0.5
    q5 = q.reshape(B, nkv, g, L, d)  # (B, nh, L, d) -> (B, nkv, g, L, d): heads grouped by kv head
    k0, v0 = keys[0]
    rows = max(1, chunk_elems // max(1, B * nh * T))
    out0, lse0 = _CausalLSE.apply(q5, k0[:, :, None], v0[:, :, None], scale, rows, qpos)  # (B, nkv, g, L, d|)
    if len(keys) == 1:
        return out0.reshape(B, nh, L, d)  # (B, nkv, g, L, d) -> (B, nh, L, d)
    kd = torch.stack([k for k, _ in keys[1:]], dim=3)  # (B, nkv, L, i, d): step j's key at the query's slot
    vd = torch.stack([v for _, v in keys[1:]], dim=3)  # (B, nkv, L, i, d)
    sd = _wide(torch.einsum("bkgtd,bktjd->bkgtj", q5, kd)) * scale  # (B, nkv, g, L, i) diagonal scores
    lse = torch.logsumexp(
        torch.cat([lse0[..., None], sd], dim=-1), dim=-1
    )  # (B, nkv, g, L, 1 + i) -> (.., L)
    w0 = torch.exp(lse0 - lse)[..., None]  # (B, nkv, g, L, 1): the causal part's share
    wd = torch.exp(sd - lse[..., None])  # (B, nkv, g, L, i)
    out = w0 * _wide(out0) + torch.einsum("bkgtj,bktjd->bkgtd", wd, _wide(vd))  # (B, nkv, g, L, d)
    return out.to(q.dtype).reshape(B, nh, L, d)  # (B, nkv, g, L, d) -> (B, nh, L, d)


def _dense_ttt_attention(q: torch.Tensor, keys: list, qpos=None) -> torch.Tensor:
    """`ttt_attention` as one SDPA call over the concatenated keys with a (L, T + i L) boolean mask.

    The fast path where the scores are small (short samples): the fused kernel beats the chunked merge on
    CPU at T <= ~2k. Memory grows as (i+1) T^2, so `ttt_attention` takes it only within its score budget.
    """
    nh, nkv, L, T = q.shape[1], keys[0][0].shape[1], q.shape[2], keys[0][0].shape[2]
    k = torch.cat([k for k, _ in keys], dim=2).repeat_interleave(nh // nkv, dim=1)  # (B, nh, T + i L, d)
    v = torch.cat([v for _, v in keys], dim=2).repeat_interleave(nh // nkv, dim=1)  # (B, nh, T + i L, d)
    if qpos is None and len(keys) == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, d)
    slots = torch.arange(T, device=q.device)  # (T,)
    if qpos is None:
        causal = (slots[None] <= slots[:, None])[None]  # (1, T, T): step-0 keys 0..t
    else:
        causal = slots[None, None] <= qpos[..., None]  # (B, L, T): step-0 keys up to the query's slot
    eye = torch.eye(L, dtype=torch.bool, device=q.device).expand(causal.shape[0], L, L)  # step j's key at t
    mask = torch.cat([causal] + [eye] * (len(keys) - 1), dim=2)[:, None]  # (B|1, 1, L, T + i L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, L, d)


def _take(x: torch.Tensor, idx: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """x's entries at slots idx (B, L) along `dim` (x (B, ..., T, ...) with T at `dim`) -> (B, ..., L, ...)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = idx.shape
    return x.gather(dim, idx.view(shape).expand(*x.shape[:dim], idx.shape[1], *x.shape[dim + 1 :]))


def _put(x: torch.Tensor, idx: torch.Tensor, T: int, dim: int = 1) -> torch.Tensor:
    """x (B, ..., L, ...) written at slots idx (B, L) of zeros with T slots along `dim` (`_take` undone)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = idx.shape
    full = x.new_zeros(*x.shape[:dim], T, *x.shape[dim + 1 :])
    return full.scatter(dim, idx.view(shape).expand_as(x), x)


def _ttt_layer(draft: Eagle3Draft, ids, hidden, pos, past: tuple, chunk_elems: int, idx=None) -> tuple:
    """The draft's forward (`Eagle3Draft.forward`, compute_logits=False) with `ttt_attention`.

    ids (B, T), hidden (B, T, H), pos (B, T), past: per earlier step, the (k, v) of each decoder layer
    (step 0's over every slot, later ones at the live slots). idx (B, L): the live slots (None: all). Step 0
    computes its keys and values at every slot (they are every later query's causal prefix) and the rest at
    the live slots (a deeper draft's step 0 runs at every slot: its later layers' keys need every slot's
    output); later steps compute only at the live slots. Returns hidden_out (B, L, H) and this step's
    ((k, v) per layer) (B, nkv, T or L, d). Equal to the draft's own forward with a `DraftKVCache`
    (tests/test_ttt.py).
    """
    layer, attn, cfg = draft.midlayer, draft.midlayer.self_attn, draft.cfg
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    first = not past
    if idx is not None and not first:  # a later step: only the live slots exist
        ids, hidden, pos = _take(ids, idx), _take(hidden, idx), _take(pos, idx)  # (B, L), (B, L, H), (B, L)
    B, S = ids.shape  # S = T (all slots) or L
    embeds = draft.embed_tokens(ids)  # (B, S, H)
    cos, sin = draft.rotary(pos, embeds.dtype)  # (B, 1, S, d) each
    hidden = hidden.to(embeds.dtype)
    e, g = layer.input_layernorm(embeds), layer.hidden_norm(hidden)  # (B, S, H) each
    residual = g if layer.norm_before_residual else hidden
    x = torch.cat([e, g], dim=-1)  # (B, S, 2H): embedding first, as the draft concatenates
    k = apply_rotary(attn.k_proj(x).view(B, S, nkv, d).transpose(1, 2), cos, sin)  # (B, nkv, S, d)
    v = attn.v_proj(x).view(B, S, nkv, d).transpose(1, 2)  # (B, nkv, S, d)
    if idx is not None and first:  # step 0: keys at every slot (above), the rest at the live slots
        x, residual = _take(x, idx), _take(residual, idx)  # (B, L, 2H), (B, L, H)
        cos, sin = _take(cos, idx, 2), _take(sin, idx, 2)  # (B, 1, L, d) each
    L = x.shape[1]
    q = apply_rotary(attn.q_proj(x).view(B, L, nh, d).transpose(1, 2), cos, sin)  # (B, nh, L, d)
    past0 = [p[0] for p in past]  # layer 0's (k, v) of the earlier steps
    a = (
        ttt_attention(q, [*past0, (k, v)], chunk_elems, idx).transpose(1, 2).reshape(B, L, nh * d)
    )  # (B, L, nh*d)
    residual = residual + attn.o_proj(a)  # (B, L, H)
    x = residual + layer.mlp(layer.post_attention_layernorm(residual))  # (B, L, H)
    kvs = [(k, v)]
    for j, later in enumerate(
        getattr(draft, "later_layers", ())
    ):  # deeper drafts: the same attention pattern
        assert not (first and idx is not None), "a deeper draft's step 0 runs at every slot"
        y = later.input_layernorm(x)  # (B, L, H)
        at = later.self_attn
        q = apply_rotary(at.q_proj(y).view(B, L, nh, d).transpose(1, 2), cos, sin)  # (B, nh, L, d)
        k = apply_rotary(at.k_proj(y).view(B, L, nkv, d).transpose(1, 2), cos, sin)  # (B, nkv, L, d)
        v = at.v_proj(y).view(B, L, nkv, d).transpose(1, 2)  # (B, nkv, L, d)
        pj = [p[j + 1] for p in past]
        a = ttt_attention(q, [*pj, (k, v)], chunk_elems, idx).transpose(1, 2).reshape(B, L, nh * d)
        x = x + at.o_proj(a)  # (B, L, H)
        x = x + later.mlp(later.post_attention_layernorm(x))  # (B, L, H)
        kvs.append((k, v))
    return draft.output(x), tuple(kvs)  # (B, L, H), ((B, nkv, T|L, d) x 2) per layer


def live_slots(loss_mask: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
    """K (B, T) bool: slot t is live at TTT step i when step i or a later one scores it (step j scores slot
    t when token t+2+j is loss-masked). A dead slot's output is never read: not by the loss, and not by a
    later step (slot t of step i+1 reads only slot t of step i). Prompt tokens are mostly dead."""
    B, T = loss_mask.shape
    lm = F.pad(loss_mask, (0, ttt_steps + 2)) > 0  # (B, T + K + 2)
    live, acc = [], torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
    for i in reversed(range(ttt_steps)):
        acc = acc | lm[:, 2 + i : 2 + i + T]  # (B, T): slot t scored at step i (token t+2+i)
        live.append(acc)
    return live[::-1]


def _live_index(live: torch.Tensor) -> torch.Tensor | None:
    """(B, T) bool -> (B, L) the live slots of each row in order, L = the most of any row (a row with fewer
    is filled with some of its dead slots, whose outputs are never read); None when every slot is live."""
    B, T = live.shape
    L = max(1, int(live.sum(1).max()))
    if L == T:
        return None
    key = (~live).long() * T + torch.arange(T, device=live.device)  # (B, T): live slots first, in order
    return key.argsort(dim=1)[:, :L]  # (B, L)


def ttt_unroll(
    draft: Eagle3Draft,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    ttt_steps: int,
    chunk_elems: int = 1 << 25,
    checkpoint_layer: bool = False,
    live: list | None = None,
):
    """Yield the draft's hidden_out (B, T, H) of TTT steps 0 .. K-1 (alignment in the module docstring).

    Step i: tokens shifted by 1 + i, positions + i, input hidden = step i-1's output (fused features for
    step 0); attention by `ttt_attention` over the keys of steps 0..i. `live` (`live_slots`): compute step
    i only at its live slots (the others are 0 in what is yielded); None computes every slot. With
    `checkpoint_layer` (and gradients on) each step's layer is recomputed in backward: autograd keeps per
    step only its input hidden state and k, v instead of all of its activations.
    """
    B, T = input_ids.shape
    ids = F.pad(input_ids, (0, ttt_steps + 1))  # (B, T + K + 1)
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # (B, T)
    h = draft.fuse(aux)  # (B, T, 3H) -> (B, T, H)
    keys: list = []  # per step, (k, v) per layer: step 0's over every slot; later steps' (B, nkv, T, d), 0 at dead slots
    ck = checkpoint_layer and torch.is_grad_enabled()
    deep = draft.cfg.num_hidden_layers > 1
    for i in range(ttt_steps):
        idx = None if live is None or (deep and i == 0) else _live_index(live[i])  # (B, L) or None
        ids_i = ids[:, 1 + i : 1 + i + T]  # (B, T): shifted by 1 + i, token x_{t+1+i} at slot t
        past = keys[:1] + [
            tuple(kv if idx is None else (_take(kv[0], idx, 2), _take(kv[1], idx, 2)) for kv in step)
            for step in keys[1:]
        ]
        args = (draft, ids_i, h, pos + i, tuple(past), chunk_elems, idx)  # positions shifted by i
        out, kvs = grad_checkpoint(_ttt_layer, *args, use_reentrant=False) if ck else _ttt_layer(*args)
        if idx is not None:  # back to every slot: (B, L, H) -> (B, T, H), (B, nkv, L, d) -> (B, nkv, T, d)
            out = _put(out, idx, T)
            if i > 0:
                kvs = tuple((_put(k, idx, T, 2), _put(v, idx, T, 2)) for k, v in kvs)
        h = out
        keys.append(kvs)  # (B, nkv, T, d) each
        yield h  # (B, T, H)


# ---------------------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------------------


def _head_stats(
    draft: Eagle3Draft,
    h: torch.Tensor,
    rows: torch.Tensor,
    teacher_p: torch.Tensor,
    teacher_negent: torch.Tensor,
    top: torch.Tensor,
    kl_mask: torch.Tensor,
    hard_weight: float = 0.0,
    terms: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums of the loss and of KL(teacher || draft) (both over kl_mask), and of top-1 agreement, over M
    scored slots. The loss is (1 - hard_weight) x the soft loss (`terms`, `losses.divergence`: KL by default)
    + hard_weight x the cross-entropy against the target's full-vocabulary argmax (a one-hot label; none where
    that argmax is outside the draft vocabulary).

    h (M, H) the draft's hidden states at the scored slots only (lm_head never runs elsewhere), rows (M,)
    their teacher rows in teacher_p (N, Vd) and teacher_negent (N,), top (M,) the draft index of the
    full-vocabulary target argmax (-1 outside the draft vocabulary: never agreed with), kl_mask (M,).
    KL(p || q) = sum p log p - sum p log q: the first term (`teacher_negent`) is the teacher's, computed
    once per batch; the second is one fused soft-target cross-entropy (log-softmax and its backward in
    one kernel, no (M, Vd) temporaries of our own).
    """
    logits = _wide(draft.compute_logits(h))  # (M, Vd) fp32 (fp64 in fp64 tests)
    agree = (logits.argmax(-1) == top).float()  # (M,): log-softmax keeps the argmax
    if hard_weight == 1:  # the argmax loss alone: the soft loss is only reported
        with torch.no_grad():
            kl = F.cross_entropy(logits, teacher_p[rows], reduction="none") + teacher_negent[rows]  # (M,)
        soft = None
    else:
        soft, kl = divergence(
            terms or {"kl": 1.0}, logits, teacher_p[rows], teacher_negent[rows]
        )  # (M,) each
    kl_sum = (kl * kl_mask).sum().detach()
    if hard_weight == 0:
        return (soft * kl_mask).sum(), kl_sum, agree.sum().detach()
    hard_ce = F.cross_entropy(logits, top.clamp(min=0), reduction="none") * (top >= 0)  # (M,)
    loss = hard_weight * (hard_ce * kl_mask).sum()
    if soft is not None:
        loss = loss + (1 - hard_weight) * (soft * kl_mask).sum()
    return loss, kl_sum, agree.sum().detach()


def head_checkpointing(setting: str, ttt_steps: int, tokens: int, vocab: int, budget: int = 2 << 30) -> bool:
    """Whether to recompute lm_head + loss in backward: `on`, `off`, or `auto` = on when the K steps'
    saved head activations (about 3 fp32 (tokens, Vd) tensors a step: logits, log-softmax, gradient
    buffer) would exceed `budget` bytes (2 GiB)."""
    assert setting in ("auto", "on", "off"), setting
    return setting == "on" or (setting == "auto" and ttt_steps * tokens * vocab * 12 > budget)


class TTTModel(nn.Module):
    """The draft unrolled K steps (training-time test); what DDP/FSDP wraps (one forward per optimizer step)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        ttt_steps: int,
        decay: float,
        checkpoint_head: bool = True,
        chunk_elems: int = 1 << 25,
        checkpoint_layer: bool = False,
        skip_dead: bool = True,
        hard_weight: float = 0.0,
        loss_terms: dict | None = None,
        noise: str = "none",
        noise_scale: float = 0.0,
    ):
        super().__init__()
        self.hard_weight = hard_weight  # loss: (1 - w) soft loss + w cross-entropy on the target's argmax
        self.loss_terms = dict(loss_terms or {"kl": 1.0})  # the soft loss (`losses.parse_loss`)
        self.noise, self.noise_scale = noise, noise_scale  # training-only noise on the aux features
        self.skip_dead = skip_dead  # compute each TTT step only at its live slots (`live_slots`)
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.decay = decay
        self.checkpoint_head = checkpoint_head
        self.chunk_elems = chunk_elems
        self.checkpoint_layer = checkpoint_layer

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        teacher_p: torch.Tensor,
        teacher_negent: torch.Tensor,
        teacher_top: torch.Tensor,
        teacher_row: torch.Tensor,
        loss_mask: torch.Tensor,
        kl_mask: torch.Tensor,
        norm: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One global-batch share.

        Args:
            input_ids: (B, T) token ids, right-padded.
            aux: (B, T, 3H) target aux features.
            teacher_p: (N, Vd) the teacher's probabilities at the N teacher positions that are used: those
                whose next token is loss-masked (`teacher_positions`).
            teacher_negent: (N,) sum over Vd of p log p (minus the teacher's entropy) at those positions.
            teacher_top: (B, T) draft index of the full-vocabulary target argmax at t, -1 if outside.
            teacher_row: (B, T) the row of position t in teacher_p, -1 where the teacher was not computed.
            loss_mask: (B, T) float over predicted tokens, 0 on padding: the accuracy's positions.
            kl_mask: (B, T) float over predicted tokens: the KL's positions (`keep_mask`).
            norm: (K,) the per-step divisor of the KL sums (global kl_mask counts / world size).

        Returns:
            loss (scalar), kl_sums (K,) and agree_sums (K,) of this rank, both detached.
        """
        T = input_ids.shape[1]
        K = self.ttt_steps
        if self.noise != "none" and self.noise_scale > 0 and torch.is_grad_enabled():
            aux = feature_noise(aux, self.noise, self.noise_scale, self.draft.cfg.target_hidden_size)
        lmask = F.pad(loss_mask, (0, K + 2))  # (B, T + K + 2)
        kmask = F.pad(kl_mask, (0, K + 2))  # (B, T + K + 2)
        loss = aux.new_zeros((), dtype=torch.float32)
        kl_sums, agree_sums = [], []
        for i, h in enumerate(
            ttt_unroll(
                self.draft,
                input_ids,
                aux,
                K,
                self.chunk_elems,
                self.checkpoint_layer,
                live_slots(loss_mask, K) if self.skip_dead else None,
            )
        ):  # h: (B, T, H)
            n = T - 1 - i  # slots whose teacher position t+1+i exists
            if n <= 0:
                kl_sums.append(loss.new_zeros(()))
                agree_sums.append(loss.new_zeros(()))
                continue
            # slots 0..n-1; teacher shifted by 1 + i, masks by 2 + i (the predicted token x_{t+2+i}); only
            # the scored slots (loss mask > 0; the KL's are a subset) reach lm_head
            scored = lmask[:, 2 + i : 2 + i + n] > 0  # (B, n)
            rows = teacher_row[:, 1 + i : 1 + i + n][scored]  # (M,) teacher rows of the scored slots
            assert bool((rows >= 0).all()), "a scored slot without its teacher row (teacher_positions)"
            args = (h[:, :n][scored], rows, teacher_p, teacher_negent, teacher_top[:, 1 + i : 1 + i + n][scored],
                    kmask[:, 2 + i : 2 + i + n][scored], self.hard_weight, self.loss_terms)  # (M, H), (M,), (N, Vd), (N,), (M,), (M,)  # fmt: skip
            if self.checkpoint_head and torch.is_grad_enabled():
                li, kl, agree = grad_checkpoint(_head_stats, self.draft, *args, use_reentrant=False)
            else:
                li, kl, agree = _head_stats(self.draft, *args)
            loss = loss + (self.decay**i) * li / norm[i]
            kl_sums.append(kl)
            agree_sums.append(agree)
        return loss, torch.stack(kl_sums), torch.stack(agree_sums)  # (), (K,), (K,)


def feature_noise(aux: torch.Tensor, kind: str, scale: float, width: int) -> torch.Tensor:
    """aux (B, T, n * width) with noise on each aux layer's state, relative to its size: x + scale * rms(x) * u,
    u ~ U(-1, 1) (uniform, EAGLE's regulariser) or N(0, 1) (gaussian), rms per token and layer. Drawn from the
    global generator, whose state every checkpoint keeps (a resumed run draws the same noise)."""
    x = aux.unflatten(-1, (-1, width))  # (B, T, 3H) -> (B, T, 3, H)
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)  # (B, T, 3, 1)
    u = torch.rand_like(x) * 2 - 1 if kind == "uniform" else torch.randn_like(x)  # (B, T, 3, H)
    return (x + scale * rms * u).flatten(-2)  # (B, T, 3H)


def teacher_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the teacher positions q whose next token q + 1 is loss-masked, the only ones any TTT
    step reads (step i scores slot t with the teacher at t + 1 + i and the mask at t + 2 + i)."""
    return F.pad(loss_mask[:, 1:], (0, 1)) > 0  # (B, T): shifted by 1 onto the teacher position


def keep_mask(loss_mask: torch.Tensor, teacher_top: torch.Tensor, oov_mask: bool) -> torch.Tensor:
    """(B, T) float over predicted tokens: the loss mask, without (oov_mask) the out-of-vocabulary positions.

    Token p is predicted from the teacher at p - 1: it is dropped when teacher_top[p - 1] is -1 (the
    full-vocabulary target argmax is outside the draft vocabulary), as EAGLE-3 does (`t2d[argmax]`).
    """
    if not oov_mask:
        return loss_mask
    in_vocab = (teacher_top >= 0).to(loss_mask.dtype)  # (B, T) over teacher positions
    return loss_mask * F.pad(in_vocab[:, :-1], (1, 0))  # (B, T): shifted by 1 onto the predicted token


def step_token_counts(loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """(K,) number of loss-masked predicted tokens of each TTT step for a (B, T) loss mask."""
    T = loss_mask.shape[1]
    # step i counts loss_mask shifted by 2 + i: (B, T - 2 - i) summed to ()
    return torch.stack(
        [loss_mask[:, 2 + i :].sum() if 2 + i < T else loss_mask.new_zeros(()) for i in range(ttt_steps)]
    )  # (K,)

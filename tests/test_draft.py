"""The EAGLE-3 draft: vocabulary map, forward against an independent transformers-built reference, KV cache, files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as hf

from specdraft.model.checkpoint import load_draft, save_draft
from specdraft.model.draft import (
    DraftConfig,
    DraftKVCache,
    Eagle3Draft,
    build_draft,
    build_vocab_map,
    draft_to_target_ids,
)
from specdraft.targets import wrap_model

V, H, L = 256, 64, 6


def tiny_target(seed: int = 0, **kw):
    """A random 6-layer Llama (hidden 64, 4 heads, 2 kv heads, vocab 256) wrapped as a Target."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **kw)  # fmt: skip
    return wrap_model(LlamaForCausalLM(cfg).eval(), name="tiny")


def counts(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 50, size=V)
    c[rng.choice(V, 40, replace=False)] = 0  # some tokens never seen
    return c


def randomize(draft: Eagle3Draft, seed: int = 1) -> Eagle3Draft:
    """Non-trivial norm weights so that norm placement matters in the comparisons."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return draft


# ---------------------------------------------------------------------------------------------------------
# vocabulary map
# ---------------------------------------------------------------------------------------------------------


def test_vocab_map_round_trips_every_kept_id():
    c = counts()
    d2t, t2d = build_vocab_map(c, 100)
    assert d2t.dtype == torch.int64 and d2t.shape == (100,) and t2d.dtype == torch.bool and t2d.shape == (V,)
    kept = draft_to_target_ids(d2t)
    assert torch.all(kept[1:] > kept[:-1]), "draft ids map to ascending target ids"
    assert int(t2d.sum()) == 100 and torch.equal(torch.nonzero(t2d).flatten(), kept)
    for i, t in enumerate(kept.tolist()):  # every kept id: draft i -> target t -> back to i
        assert t == i + int(d2t[i]) and t2d[t]
        assert int(t2d[:t].sum()) == i
    # the kept ids are the 100 most frequent (ties by lower id)
    want = sorted(sorted(range(V), key=lambda j: (-c[j], j))[:100])
    assert kept.tolist() == want


def test_vocab_map_caps_and_fills_unseen():
    c = np.zeros(V, dtype=np.int64)
    c[[5, 9, 200]] = [3, 7, 1]
    d2t, t2d = build_vocab_map(c, 10)
    kept = draft_to_target_ids(d2t).tolist()
    assert {5, 9, 200} <= set(kept) and len(kept) == 10
    assert kept == sorted([5, 9, 200] + [j for j in range(V) if j not in (5, 9, 200)][:7])
    d2t, t2d = build_vocab_map(c, 10**6)  # capped at V: identity map
    assert d2t.shape == (V,) and torch.all(d2t == 0) and bool(t2d.all())


# ---------------------------------------------------------------------------------------------------------
# the draft against a reference built from transformers' Llama modules, following vLLM's llama_eagle3
# ---------------------------------------------------------------------------------------------------------


def reference_forward(draft: Eagle3Draft, ids, hidden, pos, norm_before_residual: bool):
    """The EAGLE-3 layer composed from transformers' LlamaAttention/MLP/RMSNorm/rotary with the draft's weights."""
    c = draft.cfg
    lc = c.to_llama_config()
    lc._attn_implementation = "eager"
    attn = hf.LlamaAttention(lc, layer_idx=0)
    for n in ("q_proj", "k_proj", "v_proj"):  # q/k/v read 2H
        setattr(attn, n, getattr(draft.midlayer.self_attn, n))
    attn.o_proj = draft.midlayer.self_attn.o_proj
    mlp = hf.LlamaMLP(lc)
    mlp.load_state_dict(draft.midlayer.mlp.state_dict())

    def norm(mod):
        n = hf.LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        n.weight.data.copy_(mod.weight)
        return n

    rot = hf.LlamaRotaryEmbedding(lc)
    e = norm(draft.midlayer.input_layernorm)(draft.embed_tokens(ids))
    hn = norm(draft.midlayer.hidden_norm)(hidden)
    residual = hn if norm_before_residual else hidden
    x = torch.cat([e, hn], -1)
    T = ids.shape[1]
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    a, _ = attn(x, position_embeddings=rot(x, pos), attention_mask=causal)
    residual = residual + a
    residual = residual + mlp(norm(draft.midlayer.post_attention_layernorm)(residual))
    logits = draft.lm_head(norm(draft.norm)(residual))
    return residual, logits


@pytest.mark.parametrize("nbr", [False, True])
def test_forward_matches_transformers_reference(nbr):
    tgt = tiny_target()
    draft = randomize(build_draft(tgt, counts(), [1, 3, 4], draft_vocab_size=128, norm_before_residual=nbr))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 9), generator=g)
    hidden = 3 * torch.randn(2, 9, H, generator=g)
    pos = torch.arange(9)[None].repeat(2, 1) + torch.tensor([[0], [5]])
    with torch.no_grad():
        h, logits = draft(ids, hidden, pos)
        rh, rl = reference_forward(draft, ids, hidden, pos, nbr)
    assert h.shape == (2, 9, H) and logits.shape == (2, 9, 128)
    torch.testing.assert_close(h, rh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, rl, atol=1e-5, rtol=1e-5)
    # and the flag matters: the other placement gives a different output
    with torch.no_grad():
        oh, _ = reference_forward(draft, ids, hidden, pos, not nbr)
    assert (oh - h).abs().max() > 1e-3


def test_build_draft_from_target():
    tgt = tiny_target()
    draft = build_draft(tgt, counts(), [1, 3, 4], draft_vocab_size=128)
    c = draft.cfg
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (H, 4, 2, 16)
    assert c.rope_parameters["rope_theta"] == 5000.0 and c.rms_norm_eps == 1e-5 and c.target_num_layers == L
    assert torch.equal(draft.embed_tokens.weight, tgt.embed_tokens.weight)
    assert not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.lm_head.weight, tgt.lm_head.weight[draft.t2d])
    assert draft.fc.weight.shape == (H, 3 * H) and draft.midlayer.self_attn.q_proj.weight.shape == (64, 2 * H)
    names = {n for n, _ in draft.named_parameters()} | {n for n, _ in draft.named_buffers()}
    for n in ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.o_proj.weight",
              "midlayer.mlp.gate_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight",
              "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight",
              "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"):  # fmt: skip
        assert n in names, n
    # target ids of draft logits
    ids = torch.tensor([0, 5, 127])
    assert torch.equal(draft.draft_to_target(ids), draft_to_target_ids(draft.d2t)[ids])


def test_fc_init_high_passes_the_highest_aux_layer_through():
    tgt = tiny_target()
    aux = torch.randn(2, 5, 3 * H)  # (B, T, 3H): low, mid, high
    draft = build_draft(tgt, counts(), [1, 3, 4], draft_vocab_size=128, fc_init="high")
    torch.testing.assert_close(draft.fuse(aux), aux[..., 2 * H :], rtol=0, atol=0)
    random = build_draft(tgt, counts(), [1, 3, 4], draft_vocab_size=128)
    assert (random.fuse(aux) - aux[..., 2 * H :]).abs().max() > 0.1
    # only fc differs: the rest of the draft (same seed) is the same
    a, b = dict(draft.named_parameters()), dict(random.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a if n != "fc.weight")


def test_bad_config_errors_are_collected():
    with pytest.raises(ValueError, match="num_key_value_heads.*aux_layer_ids"):
        DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=3,
                    vocab_size=V, aux_layer_ids=[3, 1, 2])  # fmt: skip


def test_scaled_rope_matches_transformers():
    rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=V, rope_parameters=rope, max_position_embeddings=512)  # fmt: skip
    draft = Eagle3Draft(cfg)
    pos = torch.arange(300)[None]
    cos, sin = draft.rotary(pos, torch.float32)
    rc, rs = hf.LlamaRotaryEmbedding(cfg.to_llama_config())(torch.zeros(1), pos)
    torch.testing.assert_close(cos[:, 0], rc)
    torch.testing.assert_close(sin[:, 0], rs)


# ---------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------


def test_kv_cache_incremental_equals_full():
    tgt = tiny_target()
    draft = randomize(build_draft(tgt, counts(), [1, 3, 4], draft_vocab_size=128))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, 10), generator=g)
    hidden = torch.randn(2, 10, H, generator=g)
    pos = torch.arange(10)[None].repeat(2, 1)
    with torch.no_grad():
        full_h, full_l = draft(ids, hidden, pos)
        cache = DraftKVCache()
        h1, _ = draft(ids[:, :6], hidden[:, :6], pos[:, :6], kv_cache=cache)  # a prefill
        outs = [h1]
        for t in range(6, 10):  # then one token at a time
            h, _ = draft(ids[:, t : t + 1], hidden[:, t : t + 1], pos[:, t : t + 1], kv_cache=cache)
            outs.append(h)
        assert len(cache) == 10
        torch.testing.assert_close(torch.cat(outs, 1), full_h, atol=1e-5, rtol=1e-5)
        # two tokens at once after the prefill: causal offset mask
        cache.crop(6)
        h2, _ = draft(ids[:, 6:8], hidden[:, 6:8], pos[:, 6:8], kv_cache=cache)
        torch.testing.assert_close(h2, full_h[:, 6:8], atol=1e-5, rtol=1e-5)
        # an explicit mask equal to causal gives the same
        cache.crop(6)
        m = torch.ones(2, 8, dtype=torch.bool).tril(6)[None, None]
        h3, _ = draft(ids[:, 6:8], hidden[:, 6:8], pos[:, 6:8], attn_mask=m, kv_cache=cache)
        torch.testing.assert_close(h3, full_h[:, 6:8], atol=1e-5, rtol=1e-5)


def test_kv_cache_append_and_crop():
    c = DraftKVCache()
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float).view(2, 1, 5, 2)
    c.append(k, -k)
    c.append(k[:, :, :1] + 100, -k[:, :, :1] - 100)
    assert len(c) == 6
    c.crop(5)
    assert torch.equal(c.k, k) and torch.equal(c.v, -k)


# ---------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    tgt = tiny_target()
    draft = randomize(build_draft(tgt, counts(), [1, 3, 4], draft_vocab_size=100, norm_before_residual=True))
    save_draft(draft, tmp_path / "d")
    save_draft(draft, tmp_path / "d")  # overwriting an existing save works
    back = load_draft(tmp_path / "d")
    assert back.cfg == draft.cfg
    for (n, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    assert not back.embed_tokens.weight.requires_grad
    assert not list(tmp_path.glob(".*"))  # no temp dirs left
    with pytest.raises(FileNotFoundError, match="not a saved draft"):
        load_draft(tmp_path)

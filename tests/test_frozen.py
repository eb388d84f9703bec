"""The target's shared tensors read alone (model/frozen.py), and drafts saved without their frozen embeddings."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import build_tiny_model

from specdraft.model.checkpoint import load_draft, load_trained, save_draft
from specdraft.model.draft import WEIGHTS_FILE, build_draft
from specdraft.model.frozen import load_frozen
from specdraft.targets import load_target


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> a tiny 8-layer model of that architecture saved as an HF dir (built once per module)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            build_tiny_model(arch).save_pretrained(d)
            cache[arch] = d
        return cache[arch]

    return get


# llama: untied; gemma: tied, scaled embeddings, (1 + w) norm; gpt2: tied, LayerNorm with bias, other names;
# llava: a multimodal wrapper saved as language_model.model.*
@pytest.mark.parametrize("arch", ["llama", "gemma", "gpt2", "llava"])
def test_frozen_parts_equal_the_loaded_targets(saved, arch):
    from specdraft.train.ttt import TeacherHead

    d = saved(arch)
    parts = load_frozen(str(d))
    tgt = load_target(str(d), with_tokenizer=False)
    assert (parts.num_layers, parts.hidden_size, parts.vocab_size) == (
        tgt.num_layers,
        tgt.hidden_size,
        tgt.vocab_size,
    )
    assert parts.config_hash == tgt.config_hash and parts.logit_softcap == tgt.logit_softcap
    assert type(parts.embed_tokens) is type(tgt.embed_tokens) and type(parts.norm) is type(tgt.norm)
    assert torch.equal(parts.embed_tokens.weight, tgt.embed_tokens.weight)
    assert torch.equal(parts.lm_head.weight, tgt.lm_head.weight)
    assert parts.tied == (tgt.lm_head.weight is tgt.embed_tokens.weight)
    if parts.tied:
        assert parts.lm_head.weight is parts.embed_tokens.weight  # one tensor, as in the loaded target
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tgt.vocab_size, (2, 7), generator=g)
    z = 3 * torch.randn(2, 7, tgt.hidden_size, generator=g)
    with torch.no_grad():
        assert torch.equal(parts.embed_tokens(ids), tgt.embed_tokens(ids))  # incl. embedding scaling
        torch.testing.assert_close(parts.norm(z), tgt.norm(z), rtol=0, atol=0)
        torch.testing.assert_close(parts.logits_from_final(z), tgt.logits_from_final(z), rtol=0, atol=0)
    assert not any(
        p.requires_grad for m in (parts.embed_tokens, parts.norm, parts.lm_head) for p in m.parameters()
    )
    # what train builds from a target: the draft and its teacher
    counts = np.arange(tgt.vocab_size)[::-1].copy()
    a = build_draft(parts, counts, [2, 4, 5], draft_vocab_size=64)
    b = build_draft(tgt, counts, [2, 4, 5], draft_vocab_size=64)
    assert a.cfg == b.cfg
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n
    with torch.no_grad():
        (la, ta), (lb, tb) = TeacherHead(parts, a.t2d)(z), TeacherHead(tgt, b.t2d)(z)
    assert torch.equal(la, lb) and torch.equal(ta, tb)
    assert (
        parts.weights_fingerprint and parts.embed_source.tensor == parts.tensor_names["embed_tokens.weight"]
    )


def test_missing_shared_tensor_is_a_clear_error(tmp_path, saved):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "no-head"
    d.mkdir()
    src = saved("llama")
    (d / "config.json").write_text((src / "config.json").read_text())
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != "lm_head.weight"}
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"cannot find the target's shared tensors \['lm_head.weight'\].*looked for"
    ):
        load_frozen(str(d))


def _write_llama(d, layers: int) -> None:
    """A Llama checkpoint of `layers` layers (hidden 384), written tensor by tensor (no model built)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    H, inter, V = 384, 1024, 320
    cfg = LlamaConfig(hidden_size=H, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False)  # fmt: skip
    cfg.save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(V, H, generator=g), "model.norm.weight": torch.ones(H),
             "lm_head.weight": torch.randn(V, H, generator=g)}  # fmt: skip
    shapes = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H // 2, H), "self_attn.v_proj": (H // 2, H),
              "self_attn.o_proj": (H, H), "mlp.gate_proj": (inter, H), "mlp.up_proj": (inter, H),
              "mlp.down_proj": (H, inter)}  # fmt: skip
    for i in range(layers):
        for n, shape in shapes.items():
            state[f"model.layers.{i}.{n}.weight"] = torch.randn(shape, generator=g) * 0.02
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(H)
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(H)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


_PEAK = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    from specdraft.model.frozen import load_frozen
    from specdraft.targets import load_target

    def status(key):
        return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))  # KiB

    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM  # imported before the reset

    def target(d):  # loaded and used: every weight read
        return [p.double().sum() for p in load_target(d, with_tokenizer=False).model.parameters()]

    fn = load_frozen if sys.argv[1] == "frozen" else target
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to now: the imports' transient peak is not the load's
    before = status("VmRSS")
    parts = fn(sys.argv[2])
    print(before, status("VmHWM"))
""")


def _peak_kib(how: str, d) -> tuple[int, int]:
    """(RSS before the load, peak RSS during it) in KiB, of a fresh process that loads `d` with `how`."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, how, str(d)], capture_output=True, text=True, check=True
    )
    before, peak = out.stdout.strip().splitlines()[-1].split()
    return int(before), int(peak)


def test_load_frozen_memory_does_not_grow_with_the_layers(tmp_path, record_property):
    """8x the decoder layers (+180 MB of weights): load_frozen's peak RSS grows < 10%; load_target's does not."""
    shallow, deep = tmp_path / "4-layers", tmp_path / "32-layers"
    for d, n in ((shallow, 4), (deep, 32)):
        d.mkdir()
        _write_llama(d, n)
    (b4, f4), (b32, f32) = _peak_kib("frozen", shallow), _peak_kib("frozen", deep)
    bt, t32 = _peak_kib("target", deep)  # the control: the measurement sees the layers when they are loaded
    numbers = {
        "frozen_4_layers": (b4, f4),
        "frozen_32_layers": (b32, f32),
        "load_target_32_layers": (bt, t32),
    }
    record_property("rss_before_and_peak_kib", numbers)
    print(f"RSS before -> peak, KiB: {numbers}")
    assert f32 < 1.10 * f4, numbers
    assert t32 - bt > 180_000 and t32 > 1.10 * f4, numbers


# ---------------------------------------------------------------------------------------------------------
# drafts saved without their frozen embeddings
# ---------------------------------------------------------------------------------------------------------


def test_checkpoint_without_embeddings_round_trips(tmp_path, saved):
    from safetensors import safe_open

    d = tmp_path / "target"
    d.mkdir()
    for f in saved("llama").iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    parts = load_frozen(str(d))
    counts = np.arange(parts.vocab_size)[::-1].copy()
    draft = build_draft(parts, counts, [2, 4, 5], draft_vocab_size=64)
    with torch.no_grad():
        draft.fc.weight.add_(1.0)  # "trained"
    save_draft(draft, tmp_path / "full")
    save_draft(draft, tmp_path / "slim", embed_from=parts.embed_source)
    full, slim = ((tmp_path / n / WEIGHTS_FILE).stat().st_size for n in ("full", "slim"))
    emb_bytes = parts.vocab_size * parts.hidden_size * 4
    assert full - slim >= emb_bytes, (full, slim, emb_bytes)
    with safe_open(str(tmp_path / "slim" / WEIGHTS_FILE), framework="pt") as h:
        assert "embed_tokens.weight" not in set(h.keys())
    meta = json.loads((tmp_path / "slim" / "config.json").read_text())
    assert meta["embed_tokens"] == {"from": "target", "target": str(d), "weights_fingerprint": parts.weights_fingerprint,
                                    "tensor": "model.embed_tokens.weight"}  # fmt: skip
    for back in (
        load_draft(tmp_path / "slim"),
        load_trained(tmp_path / "slim"),
        load_draft(tmp_path / "full"),
    ):
        assert back.cfg == draft.cfg and not back.embed_tokens.weight.requires_grad
        for (n, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items()):
            assert torch.equal(a, b), n
    # export never needs them: loaded without, they are NaN (never used, never written)
    assert load_trained(tmp_path / "slim", with_embeddings=False).embed_tokens.weight.isnan().all()
    # the target's weights changed: refused, naming both fingerprints and the fix
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] + 1
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"keeps no copy of its frozen embeddings.*weights in .* changed since this "
                                         r"draft was saved \(weights fingerprint [\w:]+ then, [\w:]+ now\).*Fix"):  # fmt: skip
        load_draft(tmp_path / "slim")
    assert torch.equal(load_draft(tmp_path / "full").embed_tokens.weight, draft.embed_tokens.weight)

"""export: both formats' names and configs, and every invalid case refused with its fix."""

import json

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, needs_vllm

from specdraft.export import FORMATS, export, export_config, export_state, validate
from specdraft.model.checkpoint import save_draft
from specdraft.model.draft import build_draft
from specdraft.targets import wrap_model


@pytest.fixture(scope="module")
def target():
    return wrap_model(build_tiny_model("llama"), name="tiny")


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    """The `target` fixture's model saved as an HF dir (export reads its config to check the draft fits)."""
    d = tmp_path_factory.mktemp("tiny-llama-320")
    target.model.save_pretrained(d)
    return d


def make_draft(target, vd=64, **kw):
    counts = np.arange(target.vocab_size)[::-1].copy()
    return build_draft(target, counts, [2, 4, 5], draft_vocab_size=vd, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_layout(tmp_path, target, fmt, target_dir):
    draft = make_draft(target)
    save_draft(draft, tmp_path / "d")
    out = tmp_path / fmt
    assert export(str(tmp_path / "d"), str(out), format=fmt, target=str(target_dir), check_vllm=False) == 0
    cfg = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file

    w = load_file(str(out / "model.safetensors"))
    H, V = target.hidden_size, target.vocab_size
    layer = "layers.0." if fmt == "speculators" else "midlayer."
    assert w["fc.weight"].shape == (H, 3 * H)
    assert w[f"{layer}self_attn.q_proj.weight"].shape[1] == 2 * H
    assert {
        f"{layer}{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    } <= set(w)
    assert w["lm_head.weight"].shape == (64, H) and w["norm.weight"].shape == (H,)
    assert w["d2t"].dtype == torch.int64 and w["d2t"].shape == (64,)
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (V,)
    assert not any(n.startswith(("model.", "embed_tokens")) for n in w)
    # the round trip of the vocabulary map: kept ids are exactly those t2d marks
    assert torch.equal(torch.arange(64) + w["d2t"], torch.nonzero(w["t2d"]).flatten())
    if fmt == "speculators":
        assert cfg["speculators_model_type"] == "eagle3"
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
            1,
            3,
            4,
        ]  # SGLang counts from id + 1
    assert cfg["norm_before_residual"] is False and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == H


def test_full_vocabulary_drops_vocab_map(target):
    draft = make_draft(target, vd=target.vocab_size)
    state = export_state(draft, "speculators")
    assert "d2t" not in state and "t2d" not in state


def _valid(target, fmt="speculators"):
    draft = make_draft(target)
    cfg = export_config(draft.cfg, fmt, "tiny", 3, "float32")
    return cfg, export_state(draft, fmt), draft.cfg


@pytest.mark.parametrize(
    "breakage,message",
    [
        (lambda c, s, t: s.pop("lm_head.weight"), "lm_head.weight missing.*export it"),
        (lambda c, s, t: s.pop("d2t"), "d2t/t2d missing"),
        (lambda c, s, t: c.pop("norm_before_residual"), "norm_before_residual must be written"),
        (
            lambda c, s, t: c.update(eagle_aux_hidden_state_layer_ids=[2, 2, 5]),
            "repeat.*too shallow.*--layers",
        ),
        (lambda c, s, t: c.update(eagle_aux_hidden_state_layer_ids=[5, 2, 4]), "must be written sorted"),
        (lambda c, s, t: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 9]), "out of range"),
        (lambda c, s, t: s.update({"model.fc.weight": s.pop("fc.weight")}), "must not start with 'model.'"),
        (lambda c, s, t: s.update({"layers.0.self_attn.q_proj.bias": torch.zeros(4)}), "all of q/k/v/o"),
        (lambda c, s, t: s.update(d2t=s["d2t"].int()), "d2t must be int64"),
    ],
)
def test_invalid_exports_are_refused_with_fix(target, breakage, message):
    cfg, state, dcfg = _valid(target)
    assert validate(cfg, state, "speculators", dcfg.vocab_size, dcfg.target_num_layers) == []
    breakage(cfg, state, dcfg)
    problems = validate(cfg, state, "speculators", dcfg.vocab_size, dcfg.target_num_layers)
    assert any(__import__("re").search(message, p) for p in problems), problems


def test_map_present_with_full_vocabulary_is_refused(target):
    draft = make_draft(target, vd=target.vocab_size)
    cfg = export_config(draft.cfg, "speculators", "tiny", 3, "float32")
    state = export_state(draft, "speculators")
    state["d2t"] = torch.zeros(target.vocab_size, dtype=torch.long)
    assert any(
        "vLLM fails to load it" in p for p in validate(cfg, state, "speculators", target.vocab_size, 8)
    )


def test_export_refuses_bad_arguments(tmp_path, target):
    save_draft(make_draft(target), tmp_path / "d")
    with pytest.raises(ValueError, match="--format must be one of.*--dtype must be one of"):
        export(str(tmp_path / "d"), str(tmp_path / "o"), format="gguf", dtype="int4")


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"hidden_size": 128},
            r"target's hidden size is 128 but the draft's fc reads hidden states of size 64",
        ),
        (
            {"vocab_size": 300},
            r"target's vocabulary has 300 ids but the draft's vocabulary map \(t2d: 320, d2t: 64\)",
        ),
        (
            {"num_hidden_layers": 4},
            r"draft reads the target's layers \[2, 4, 5\] but the target has 4 layers",
        ),
    ],
    ids=["hidden", "vocab", "layers"],
)
def test_export_refuses_a_target_the_draft_does_not_fit(tmp_path, target, change, message):
    """Before writing anything: both values named, and the fix (the draft's own target, or a new draft)."""
    from conftest import tiny_config

    other = tmp_path / "other-target"
    cfg = tiny_config("llama")
    for k, v in change.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(other)  # its config is all export reads of it
    draft = make_draft(target)
    draft.cfg.target_name = "/models/the-draft-target"
    save_draft(draft, tmp_path / "d")
    with pytest.raises(ValueError, match=message) as e:
        export(str(tmp_path / "d"), str(tmp_path / "out"), target=str(other), check_vllm=False)
    assert f"refusing to write a draft for target {other}" in str(e.value)
    assert "Fix: export against the draft's own target (--target /models/the-draft-target)" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_export_checks_its_target_exists(tmp_path, target):
    save_draft(make_draft(target), tmp_path / "d")
    with pytest.raises(ValueError, match="cannot read the target's config.*does not exist"):
        export(str(tmp_path / "d"), str(tmp_path / "out"), target="/nonexistent/target", check_vllm=False)


# ---------------------------------------------------------------------------------------------------------
# what an export states about its target: its architectures and bos/eos ids, and whether vLLM can serve it
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_target(tmp_path_factory):
    """A tiny random Qwen2 target saved with its own bos/eos ids (300/301, not Llama's 1/2)."""
    model = build_tiny_model("qwen2")
    model.config.bos_token_id, model.config.eos_token_id = 300, 301
    d = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(d)
    return d, wrap_model(model, name=str(d))


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_states_the_targets_architectures_and_special_ids(tmp_path, qwen_target, fmt):
    """verifier.architectures is the target's (was always []); the layer's bos/eos are the target's (were
    Llama's 1/2 for any target)."""
    d, target = qwen_target
    save_draft(make_draft(target), tmp_path / "d")
    assert export(str(tmp_path / "d"), str(tmp_path / fmt), format=fmt, target=str(d), check_vllm=False) == 0
    cfg = json.loads((tmp_path / fmt / "config.json").read_text())
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    assert (layer["bos_token_id"], layer["eos_token_id"]) == (300, 301)
    if fmt == "speculators":
        assert cfg["speculators_config"]["verifier"]["architectures"] == ["Qwen2ForCausalLM"]


def test_special_ids_come_from_the_config_then_the_generation_config(tmp_path, target):
    """The config's ids first, else the generation config's (eos may be a list); none known: None, never 1/2."""
    from conftest import tiny_config

    from specdraft.export import target_facts

    def facts(name, config_ids, generation):
        d = tmp_path / name
        cfg = tiny_config("qwen2")
        cfg.architectures = ["Qwen2ForCausalLM"]
        cfg.bos_token_id, cfg.eos_token_id = config_ids
        cfg.save_pretrained(d)
        (d / "generation_config.json").write_text(json.dumps(generation))
        return target_facts(str(d))

    both = facts("both", (300, 301), {"bos_token_id": 5, "eos_token_id": [6, 7]})
    assert (both["bos_token_id"], both["eos_token_id"]) == (300, 301)
    gen = facts("gen", (None, None), {"bos_token_id": 300, "eos_token_id": [301, 302]})
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (300, [301, 302])
    none = facts("none", (None, None), {})
    assert (none["bos_token_id"], none["eos_token_id"]) == (None, None)
    assert none["architectures"] == ["Qwen2ForCausalLM"]
    layer = export_config(make_draft(target).cfg, "speculators", "t", 3, "float32", none)[
        "transformer_layer_config"
    ]
    assert layer["bos_token_id"] is None and layer["eos_token_id"] is None


def test_no_vllm_serve_command_when_vllm_cannot_serve_the_target(tmp_path):
    """With vLLM's refusal, export prints why and what serves it instead, and no `vllm serve` line."""
    from specdraft.export import _serve_lines

    why = "GemmaForCausalLM: SupportsEagle3: no; what to do: serve with SGLang"
    spec = "\n".join(_serve_lines("runs/draft", "/t", tmp_path / "x", "speculators", 3, why))
    assert "vllm serve" not in spec and f"vLLM cannot serve this draft: {why}" in spec
    assert "specdraft export runs/draft OUT --format eagle3" in spec
    eagle = "\n".join(_serve_lines("runs/draft", "/t", tmp_path / "x", "eagle3", 3, why))
    assert "vllm serve" not in eagle and "sglang.launch_server --model-path /t" in eagle
    fine = "\n".join(_serve_lines("runs/draft", "/t", tmp_path / "x", "speculators", 3, ""))
    assert "vllm serve /t --speculative-config" in fine and "cannot" not in fine


@pytest.mark.vllm
@needs_vllm
def test_export_of_a_draft_vllm_cannot_serve_prints_no_vllm_command(tmp_path, capsys):
    """A Gemma target (vLLM's GemmaForCausalLM does not implement SupportsEagle3): the installed vLLM is asked,
    and export says it cannot serve the draft instead of printing `vllm serve` commands that would fail."""
    model = build_tiny_model("gemma")
    d = tmp_path / "gemma"
    model.save_pretrained(d)
    target = wrap_model(model, name=str(d))
    save_draft(make_draft(target), tmp_path / "d")
    assert export(str(tmp_path / "d"), str(tmp_path / "out"), target=str(d)) == 0
    out = capsys.readouterr().out
    assert "vLLM cannot serve this draft" in out and "GemmaForCausalLM" in out
    assert "vllm serve" not in out and "--format eagle3" in out

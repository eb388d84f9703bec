"""export: both formats' names and configs, and every invalid case refused with its fix."""

import json

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, needs_vllm

from specdraft.export import FORMATS, export, export_config, export_state, named_hub_id, validate
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


# ---------------------------------------------------------------------------------------------------------
# the target's hub id, and the serve commands every supported vLLM release accepts
# ---------------------------------------------------------------------------------------------------------


def _export_with(tmp_path, target, target_dir, capsys, **kw):
    """Export a small draft against `target_dir`; (config.json, marker, printed lines)."""
    from specdraft.export import MARKER_FILE

    save_draft(make_draft(target), tmp_path / "d")
    out = tmp_path / "out"
    assert export(str(tmp_path / "d"), str(out), target=str(target_dir), check_vllm=False, **kw) == 0
    cfg = json.loads((out / "config.json").read_text())
    marker = json.loads((out / MARKER_FILE).read_text())
    return cfg, marker, capsys.readouterr().out


def test_verifier_option_is_recorded(tmp_path, target, target_dir, capsys):
    """--verifier ORG/NAME is what the speculators config names; the marker keeps the local target too."""
    cfg, marker, out = _export_with(tmp_path, target, target_dir, capsys, verifier="acme/tiny-llama")
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "acme/tiny-llama"
    assert (marker["verifier"], marker["verifier_from"], marker["target"]) == (
        "acme/tiny-llama", "--verifier", str(target_dir)
    )  # fmt: skip
    assert marker["verifier_note"] is None and named_hub_id(tmp_path / "out") == "acme/tiny-llama"
    assert f"serve: vllm serve {tmp_path / 'out'}   # its config names the target, acme/tiny-llama" in out
    assert "verifier: acme/tiny-llama (the target's Hugging Face id, from --verifier)" in out
    for bad in (
        str(target_dir),
        "tiny-llama",
        "acme/../x",
    ):  # a path, no ORG, not a valid id: refused at once
        with pytest.raises(ValueError, match="--verifier must be the target's Hugging Face id ORG/NAME"):
            export(str(tmp_path / "d"), str(tmp_path / "out2"), target=str(target_dir), verifier=bad)
    assert not (tmp_path / "out2").exists()


def _copy_target(src, dest, name_or_path=None):
    """A copy of the target directory, its config's `_name_or_path` set when given."""
    import shutil

    shutil.copytree(src, dest)
    if name_or_path is not None:
        cfg = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**cfg, "_name_or_path": name_or_path}))
    return dest


def test_hub_id_read_from_the_target(tmp_path, target, target_dir, capsys):
    """The target config's `_name_or_path` when it is ORG/NAME (not a path), or a Hugging Face cache snapshot's
    ORG/NAME; a path in `_name_or_path` is no hub id."""
    from specdraft.export import find_hub_id

    named = _copy_target(target_dir, tmp_path / "named", "acme/tiny-llama")
    cfg, marker, out = _export_with(tmp_path / "a", target, named, capsys)
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "acme/tiny-llama"
    assert marker["verifier_from"] == "its config's _name_or_path" and "# its config names the target" in out
    snap = _copy_target(target_dir, tmp_path / "hub" / "models--acme--tiny-2" / "snapshots" / "0123abc")
    assert find_hub_id(str(snap), snap) == ("acme/tiny-2", "its Hugging Face cache path")
    pathy = _copy_target(target_dir, tmp_path / "pathy", "/fsx/ckpt/tiny")
    assert find_hub_id(str(pathy), pathy) == (None, "")
    assert find_hub_id("acme/tiny-3", None) == ("acme/tiny-3", "--target")  # given as a cached hub id
    assert find_hub_id("smollm2-135m", None)[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_only_a_local_path_is_said_plainly(tmp_path, target, target_dir, capsys):
    """No hub id known: the export names the local path, says so in one line with the fix (printed and in the
    marker), and prints no `vllm serve EXPORT` (vLLM 0.33 refuses a local verifier) but says where it works."""
    cfg, marker, out = _export_with(tmp_path, target, target_dir, capsys)
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert (
        marker["verifier"] is None
        and marker["target"] == str(target_dir)
        and not named_hub_id(tmp_path / "out")
    )
    plain = (
        f"the export names only the target's local path {target_dir}, which exists on this machine alone: "
        "pass --verifier ORG/NAME (the target's Hugging Face id)"
    )
    assert marker["verifier_note"] == plain and f"verifier: {plain}" in out.splitlines()[1]
    serves = [line for line in out.splitlines() if "serve: vllm serve" in line]
    assert serves == [
        f"  serve: vllm serve {target_dir} --speculative-config "
        f'\'{{"method": "eagle3", "model": "{tmp_path / "out"}", "num_speculative_tokens": 3}}\''
    ]
    assert "note: `vllm serve EXPORT` works on vLLM 0.16.0-0.32.0 only: vLLM 0.33.0 refuses" in out


@pytest.mark.parametrize("hub", [None, "acme/tiny-llama"])
def test_printed_serve_commands_match_the_table(hub):
    """Every vLLM command printed is a form of SERVE_FORMS that every release 0.16.0..0.33.0 accepts, and each
    such form is printed; each applicable form that only some releases accept is a note naming them."""
    from specdraft.export import SERVE_FORMS, VLLM_RELEASES, serve_commands, serve_notes

    assert VLLM_RELEASES == ("0.16.0", "0.33.0")
    cmds = [c for c in serve_commands("/t", "/x", None, 3, hub=hub) if c.startswith("vllm")]
    by_name = {f.name: f for f in SERVE_FORMS}
    want = [
        "the target with --speculative-config",
        f"the export alone, naming {'a hub id' if hub else 'a local path'}",
    ]
    if not hub:  # a local verifier: `vllm serve EXPORT` works on 0.16.0-0.32.0 only, so it is not printed
        want = want[:1]
    assert len(cmds) == len(want)
    for c, name in zip(cmds, want):
        f = by_name[name]
        assert (f.first, f.last) == ("0.16.0", "0.33.0") and c.startswith(f.command.split("{")[0])
    assert '"method": "eagle3"' in cmds[0]  # without a method no release serves it as EAGLE-3
    notes = serve_notes(hub)
    partial = [
        f
        for f in SERVE_FORMS
        if f.first and (f.first, f.last) != VLLM_RELEASES and f.needs in ("", "local" if not hub else "hub")
    ]
    assert len(notes) == len(partial) and all(
        f"vLLM {f.first}-{f.last} only" in n for f, n in zip(partial, notes)
    )
    assert not any(f.name.endswith("no method") for f in partial)  # accepted by none: never suggested


def test_serve_commands_follow_the_table(monkeypatch):
    """The commands come from the table: a form declared for every release is printed, one narrowed is not."""
    import dataclasses

    from specdraft import export as ex

    widened = tuple(
        dataclasses.replace(f, last="0.33.0") if f.needs == "local" else f for f in ex.SERVE_FORMS
    )
    monkeypatch.setattr(ex, "SERVE_FORMS", widened)
    assert "vllm serve /x" in ex.serve_commands("/t", "/x", None, 3)
    narrowed = tuple(dataclasses.replace(f, first="0.17.0") if not f.needs else f for f in widened)
    monkeypatch.setattr(ex, "SERVE_FORMS", narrowed)
    assert not any("--speculative-config" in c for c in ex.serve_commands("/t", "/x", None, 3))


# the 1-layer default export's names and config keys as they were before EAGLE-3.1 and deeper drafts existed
_DEFAULT_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
_DEFAULT_KEYS = {"architectures", "speculators_model_type", "speculators_version", "transformer_layer_config",
                 "speculators_config", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
                 "eagle_aux_hidden_state_layer_ids", "torch_dtype", "specdraft_version"}  # fmt: skip


def test_default_export_unchanged_and_variants_carry_their_keys(target):
    """The default (1 layer, no EAGLE-3.1) writes exactly the names and keys it always wrote; EAGLE-3.1 adds
    fc_norm / norm_output and fc_norm.{0,1,2}; a 3-layer draft adds layers.1 and layers.2, whose q/k/v read H;
    the eagle3 format (SGLang's one plain layer) refuses either, naming the fix."""
    base = make_draft(target)
    assert set(export_state(base, "speculators")) == _DEFAULT_NAMES
    cfg = export_config(base.cfg, "speculators", "tiny", 3, "float32")
    assert set(cfg) == _DEFAULT_KEYS and cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    v31 = make_draft(target, fc_norm=True, norm_output=True)
    c31, s31 = export_config(v31.cfg, "speculators", "tiny", 3, "float32"), export_state(v31, "speculators")
    assert c31["fc_norm"] is True and c31["norm_output"] is True
    assert set(s31) == _DEFAULT_NAMES | {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert validate(c31, s31, "speculators", target.vocab_size, 6) == []
    deep = make_draft(target, num_hidden_layers=3)
    cd, sd = export_config(deep.cfg, "speculators", "tiny", 3, "float32"), export_state(deep, "speculators")
    assert cd["transformer_layer_config"]["num_hidden_layers"] == 3 and "fc_norm" not in cd
    H = target.hidden_size
    assert sd["layers.2.self_attn.q_proj.weight"].shape[1] == H and "layers.2.hidden_norm.weight" not in sd
    assert validate(cd, sd, "speculators", target.vocab_size, 6) == []
    sd["layers.1.self_attn.q_proj.weight"] = torch.zeros(8, 2 * H)
    assert any(
        "layers.1.self_attn.q_proj.weight must read H" in p
        for p in validate(cd, sd, "speculators", target.vocab_size, 6)
    )
    from specdraft.export import sglang_problems

    assert sglang_problems(base.cfg) == []
    assert "--format speculators" in sglang_problems(deep.cfg)[0]

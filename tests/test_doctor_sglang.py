"""doctor --against sglang==X: what SGLang reads of our eagle3 export, checked statically (fake pair and real wheels).

`tests/engine_pair/sgl1` and `sgl2` are a tiny stand-in for SGLang's readers (`fakesgl`): v1 loads the
export as written; v2 refuses our `hidden_act`, stops reading `draft_vocab_size`, renames the draft's
layer module without mapping `midlayer.*`, and shifts the aux layer ids by one (as real SGLang does).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from specdraft.doctor.formats import against as format_against
from specdraft.doctor.formats.against import check_format_engine, format_engine_for
from specdraft.doctor.formats.check import check_formats
from specdraft.doctor.formats.model import entry_classes, safetensors_names
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.formats import (
    EAGLE3_SAMPLE,
    EAGLE3_WEIGHTS,
    SGLANG_FORMATS,
    ConfigReader,
    ExportFormat,
    FormatEngine,
    LayerIds,
)

PAIR = Path(__file__).parent / "engine_pair"
_MODELS = "fakesgl.models"

#: SGLANG_FORMATS' eagle3 declaration, pointed at the fake package
FAKE_SGL_FORMAT = ExportFormat(
    name="eagle3",
    engine="fakesgl",
    sample=EAGLE3_SAMPLE,
    readers=(
        ConfigReader(f"{_MODELS}.llama_eagle3", ("config", "self.config"), model=True),
        ConfigReader("fakesgl.runner_parts.aux|fakesgl.runner", ("draft_model_config.hf_config",)),
    ),
    relies_on=SGLANG_FORMATS[0].relies_on,
    unread_ok=SGLANG_FORMATS[0].unread_ok,
    architecture="architectures",
    weights=EAGLE3_WEIGHTS,
    weight_loader=f"{_MODELS}.llama_eagle3:LlamaForCausalLMEagle3",
    layer_ids=LayerIds(
        f"{_MODELS}.llama:LlamaForCausalLM.set_eagle3_layers_to_capture",
        "layer_ids",
        "eagle_config.eagle_aux_hidden_state_layer_ids",
    ),
)
FAKE_SGL = FormatEngine("fakesgl", (FAKE_SGL_FORMAT,), registry=_MODELS)


def _breaks(problems):
    return [p for p in problems if p.severity == "break"]


def _check(version: str, config=None, weights=None):
    configs = None if config is None else {"eagle3": config}
    return check_formats([FAKE_SGL_FORMAT], SourceTree(PAIR / version), configs, _MODELS, weights=weights)


def test_v1_loads_the_export_as_written():
    problems = _check("sgl1")
    assert _breaks(problems) == [], [p.message for p in _breaks(problems)]
    info = " | ".join(p.message for p in problems)
    assert "reads `norm_before_residual` nowhere" in info and "norm_before_residual=False" in info
    assert entry_classes(SourceTree(PAIR / "sgl1"), _MODELS) == {
        "LlamaForCausalLM": f"{_MODELS}.llama",
        "LlamaForCausalLMEagle3": f"{_MODELS}.llama_eagle3",
    }


def test_v2_refuses_drops_and_shifts():
    msgs = [p.message for p in _breaks(_check("sgl2"))]
    text = " | ".join(msgs)
    assert "`hidden_act` is 'silu'" in text and "['gelu']" in text  # refused value (model reader)
    assert "reads `draft_vocab_size` nowhere" in text  # relied-on field dropped
    assert "under `midlayer.`" in text and "skips them silently" in text  # weights dropped
    assert "entering layers [0, 1, 4] (id k -> layer k+0)" in text  # v2 stopped shifting the aux ids
    assert len(msgs) == 4, text


def test_config_values_decide_what_breaks():
    """A multi-layer draft, a trained norm_before_residual, a non-default rope, an unknown architecture."""
    cfg = dict(EAGLE3_SAMPLE, num_hidden_layers=2, norm_before_residual=True, architectures=["Nope"])
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5}
    text = " | ".join(p.message for p in _breaks(_check("sgl1", cfg)))
    assert "`num_hidden_layers` is 2; this version accepts only ['1']" in text
    assert "`norm_before_residual` nowhere" in text  # True is not what SGLang builds
    assert "architecture 'Nope'" in text
    assert "rope_parameters" not in text  # v1 reads rope_parameters
    no_ids = dict(EAGLE3_SAMPLE, eagle_config={"use_aux_hidden_state": True})
    assert not any("entering layers" in p.message for p in _check("sgl2", no_ids))  # defaults are not shifted


def _safetensors(path: Path, names) -> None:
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                         for i, n in enumerate(names)}).encode()  # fmt: skip
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * (4 * len(names)))


def test_against_a_contractless_engine_checks_its_formats(tmp_path, monkeypatch):
    """`doctor --against fakesgl-tree [--export DIR]` goes through format_against, not the vLLM contract."""
    from specdraft.doctor.command import run_doctor

    monkeypatch.setattr(format_against, "FORMAT_ENGINES", {"fakesgl": FAKE_SGL})
    assert format_engine_for("fakesgl==2.0") is FAKE_SGL and format_engine_for("vllm==0.33.0") is None
    assert format_engine_for(str(PAIR / "sgl2")) is FAKE_SGL
    report = run_doctor(against=str(PAIR / "sgl2"), device="cpu", quiet=True)
    assert len([p for p in report.breaks if p.check == "format"]) == 4, report.format_text()
    assert "export formats only" in report.info["against"]
    # an export whose weights use the v2 names and whose ids follow v2's convention: only the refusals remain
    ids = list(EAGLE3_SAMPLE["eagle_aux_hidden_state_layer_ids"])
    cfg = dict(EAGLE3_SAMPLE, hidden_act="gelu", eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _safetensors(
        tmp_path / "model.safetensors", [w.replace("midlayer.", "layers.0.") for w in EAGLE3_WEIGHTS]
    )
    assert set(safetensors_names([tmp_path / "model.safetensors"])) >= {
        "fc.weight",
        "layers.0.mlp.up_proj.weight",
    }
    _, problems = check_format_engine(FAKE_SGL, str(PAIR / "sgl2"), str(tmp_path))
    assert [p.message for p in _breaks(problems)] == [
        next(p.message for p in problems if "draft_vocab_size" in p.message)
    ]
    (tmp_path / "config.json").write_text(json.dumps({"speculators_config": {}}))
    _, problems = check_format_engine(FAKE_SGL, str(PAIR / "sgl1"), str(tmp_path))
    assert "reads only ['eagle3']" in _breaks(problems)[0].message


def test_sglang_is_declared_for_the_eagle3_export_only():
    from specdraft.doctor.release.wheel import flavours
    from specdraft.engine.formats import FORMAT_ENGINES

    assert [f.name for f in FORMAT_ENGINES["sglang"].formats] == ["eagle3"]
    assert flavours("sglang") == ["sglang"]  # no sglang-cpu: one package only
    assert format_engine_for("sglang==0.5.23") is FORMAT_ENGINES["sglang"]


def test_declared_weights_are_what_export_writes():
    """EAGLE3_WEIGHTS (what the weight check reads) are the names export.export_state writes for eagle3."""
    from specdraft.export import export_state
    from specdraft.model.draft import DraftConfig, Eagle3Draft

    cfg = DraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=64, draft_vocab_size=32, aux_layer_ids=[1, 2, 5], target_num_layers=8)  # fmt: skip
    assert sorted(export_state(Eagle3Draft(cfg), "eagle3")) == sorted(EAGLE3_WEIGHTS)


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", ["0.4.10.post2", "0.5.10", "0.5.23"])
def test_against_real_sglang_release(version):
    """Real SGLang wheels (downloaded once into the cache): every version reads our eagle3 export as written.
    Every one of them shifts the aux layer ids by one (`set_eagle3_layers_to_capture`: val + 1), which the
    export's `eagle_config` ids account for (k - 1); before that fix each version reported exactly that break."""
    from specdraft.engine.formats import FORMAT_ENGINES

    described, problems = check_format_engine(FORMAT_ENGINES["sglang"], f"sglang=={version}")
    if not described:
        pytest.fail(f"cannot read sglang=={version}: {problems[0].message}", pytrace=False)
    breaks = [p.message for p in _breaks(problems)]
    assert breaks == [], breaks
    assert not any("not found" in p.message for p in problems), [p.message for p in problems]

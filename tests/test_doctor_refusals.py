"""doctor finds the refusals a release adds on values we pass or write (tests/engine_pair/refusals/README.md)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specdraft.doctor.refusals.check import new_refusals
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.contract import Contract, Entry
from specdraft.engine.formats import ConfigReader, ExportFormat
from specdraft.engine.usage import OptionKeys

PAIRS = Path(__file__).parent / "engine_pair" / "refusals"

#: what the fake engine's export reader reads of our speculators-like export
FORMAT = ExportFormat(
    name="speculators",
    engine="fakeengine",
    sample={
        "speculators_model_type": "eagle3",
        "target_hidden_size": 64,
        "speculators_config": {
            "proposal_methods": [{"speculative_tokens": 3}],
            "verifier": {"name_or_path": "/models/target"},
        },
    },
    readers=(ConfigReader("fakeengine.speculators:load", ("config_dict",)),),
)

CONTRACT = Contract(
    engine="fakeengine",
    entries=(
        Entry("fake.LLM", "fakeengine:LLM", positional=1, keywords=("dtype", "seed", "speculative_config")),
    ),
    option_keys=(
        OptionKeys(
            "speculative_config",
            keys=("method", "num_speculative_tokens"),
            values=(("method", "eagle3"),),
            config_class="fakeengine.config:SpeculativeConfig",
        ),
    ),
    formats=(FORMAT,),
)


def _against_base(release: str, contract: Contract = CONTRACT, **kw):
    return new_refusals(SourceTree(PAIRS / release), SourceTree(PAIRS / "base"), contract, **kw)


def _found(problems):
    return [p for p in problems if p.severity != "info" or "adds no refusal" not in p.message]


def test_value_check_added_in_an_export_reader():
    (p,) = _found(_against_base("value_check"))
    assert (p.severity, p.subject, p.location) == (
        "break",
        "speculators export",
        "fakeengine/speculators.py:14",
    )
    assert "`hidden % 128`" in p.message and "is not a multiple of 128" in p.message
    assert "`target_hidden_size`" in p.symbol and p.passed == "target_hidden_size=64"


def test_a_verifier_check_through_a_try_and_a_path_alias():
    """vLLM 0.33's shape: `try: validate_repo_id(v) except ...: raise`, and `p = Path(v); if p.exists(): raise`."""
    found = sorted(_found(_against_base("verifier_path")), key=lambda p: p.location)
    assert [(p.severity, p.location) for p in found] == [
        ("warning", "fakeengine/speculators.py:25"),
        ("warning", "fakeengine/speculators.py:28"),
    ]
    handler, alias = found
    assert "raises(_validate_repo_id(verifier), KeyError)" in handler.message
    assert "`local.exists()`" in alias.message
    assert all("speculators_config.verifier.name_or_path" in p.symbol for p in found)


def test_assert_added_in_an_entry_point_and_a_reworded_check():
    found = {p.location: p for p in _found(_against_base("entry_assert"))}
    assert set(found) == {"fakeengine/entrypoints.py:12", "fakeengine/entrypoints.py:14"}, found
    new = found["fakeengine/entrypoints.py:12"]
    assert new.severity == "warning" and new.subject == "fake.LLM" and "`dtype`" in new.symbol
    assert (
        "`dtype not in ('auto', 'bfloat16')` (an assert)" in new.message and "is not supported" in new.message
    )
    reworded = found["fakeengine/entrypoints.py:14"]
    assert "worded differently" in reworded.message and "seed must be >= 0" in reworded.installed
    assert "`seed < 0`" in reworded.message and "`seed`" in reworded.symbol


def test_validator_added_on_an_option_we_pass():
    (p,) = _found(_against_base("validator"))
    assert (p.severity, p.subject, p.location) == (
        "break",
        "speculative_config option",
        "fakeengine/config.py:16",
    )
    assert (
        "`method not in ('ngram', 'draft_model')`" in p.message and "unknown speculative method" in p.message
    )
    assert p.symbol == "`speculative_config.method`" and p.passed == "speculative_config.method='eagle3'"


def test_a_pair_without_new_refusals_is_clean():
    """clean/ moves the refusals on our values and adds some on what we do not pass: none is reported."""
    problems = _against_base("clean")
    assert [p.severity for p in problems] == ["info"] and "adds no refusal" in problems[0].message
    assert "3 such refusal(s)" in problems[0].message
    # and the base release against itself
    same = new_refusals(SourceTree(PAIRS / "base"), SourceTree(PAIRS / "base"), CONTRACT)
    assert [p.severity for p in same] == ["info"]


@pytest.mark.parametrize(
    "hidden, exported, severity",
    [
        (64, False, "break"),  # the sample fails the new check
        (128, False, "warning"),  # the sample passes; another export's value may not
        (128, True, "info"),  # the export's own value passes
        (96, True, "break"),
    ],
)
def test_export_verdict_follows_our_value(hidden, exported, severity):
    config = {**FORMAT.sample, "target_hidden_size": hidden}
    if exported:
        (p,) = _found(_against_base("value_check", configs={"speculators": config}))
    else:
        contract = replace(CONTRACT, formats=(replace(FORMAT, sample=config),))
        (p,) = _found(_against_base("value_check", contract))
    assert p.severity == severity and p.location == "fakeengine/speculators.py:14"


@pytest.mark.parametrize(
    "values, severity",
    [
        (None, "warning"),
        ({"dtype": "float32"}, "break"),
        ({"dtype": "auto"}, "info"),
        ({"dtype": "bfloat16"}, "info"),
    ],
)
def test_entry_verdict_follows_our_value(values, severity):
    given = {"fake.LLM": values} if values is not None else None
    found = {p.location: p for p in _found(_against_base("entry_assert", values=given))}
    assert found["fakeengine/entrypoints.py:12"].severity == severity


def test_option_verdict_follows_our_dispatch_value():
    ngram = replace(CONTRACT, option_keys=(replace(CONTRACT.option_keys[0], values=(("method", "ngram"),)),))
    (p,) = _found(_against_base("validator", ngram))
    assert p.severity == "info" and p.passed == "speculative_config.method='ngram'"
    both = replace(
        CONTRACT,
        option_keys=(replace(CONTRACT.option_keys[0], values=(("method", "ngram"), ("method", "eagle3"))),),
    )
    (p,) = _found(_against_base("validator", both))
    assert p.severity == "break" and p.passed == "speculative_config.method='eagle3'"  # one mode we use fails


def _fake_modules() -> list[str]:
    return [m for m in sys.modules if m == "fakeengine" or m.startswith("fakeengine.")]


def test_doctor_against_reports_them(monkeypatch, request):
    """`doctor --against RELEASE` compares the release with the installed one (here: base on sys.path)."""
    from specdraft.doctor.command import run_doctor

    for name in _fake_modules():
        monkeypatch.delitem(sys.modules, name)
    # this test's fakeengine leaves with it (before monkeypatch puts back what was there): a later test in the
    # process (test_doctor_formats under pytest-xdist) imports its own
    request.addfinalizer(lambda: [sys.modules.pop(m) for m in _fake_modules()])
    monkeypatch.syspath_prepend(str(PAIRS / "base"))
    report = run_doctor(against=str(PAIRS / "validator"), contracts=[CONTRACT], device="cpu", quiet=True)
    refusals = [p for p in report.problems if p.check == "refusal"]
    assert [(p.severity, p.location) for p in refusals] == [("break", "fakeengine/config.py:16")]
    assert "fakeengine/config.py:16" in report.format_text() and [p.check for p in report.breaks] == [
        "refusal"
    ]
    clean = run_doctor(against=str(PAIRS / "clean"), contracts=[CONTRACT], device="cpu", quiet=True)
    assert [p.severity for p in clean.problems if p.check == "refusal"] == ["info"]

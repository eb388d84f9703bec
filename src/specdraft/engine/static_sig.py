"""Engine signatures read from source with :mod:`ast` -- no import, no install, no GPU.

:class:`SourceTree` finds where a symbol of an engine package is defined (following re-exports,
relative imports and vLLM's lazy ``MODULE_ATTRS`` table), walks base classes in the same package,
and builds the signature of what makes a class callable: an explicit or inherited ``__init__``,
dataclass and pydantic-dataclass fields, decorators marked ``dataclass_transform`` (vLLM's
``@config``), ``InitVar``/``ClassVar``/``KW_ONLY``/``field(init=False)``, msgspec structs and
``TypedDict``. :class:`SigInfo` is the signature model shared with the import-based reader of
:mod:`specdraft.engine.check`, and :func:`unguarded_cuda_calls` finds ``torch.cuda.*`` calls a CPU
machine would run.

``specdraft doctor --against vllm==X`` uses this module to check the contract against a release that
is not installed.
"""

from __future__ import annotations

import ast
import difflib
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "KW_ONLY",
    "POS_KW",
    "POS_ONLY",
    "VAR_KW",
    "VAR_POS",
    "Found",
    "Param",
    "SigInfo",
    "SourceTree",
    "top_statements",
    "unguarded_cuda_calls",
]

#: ``inspect.Parameter`` kind names, as stored in :attr:`Param.kind`
POS_ONLY, POS_KW, VAR_POS, KW_ONLY, VAR_KW = (
    "POSITIONAL_ONLY",
    "POSITIONAL_OR_KEYWORD",
    "VAR_POSITIONAL",
    "KEYWORD_ONLY",
    "VAR_KEYWORD",
)
_SAFE_CUDA = {"is_available", "device_count", "is_initialized", "current_device", "get_device_name"}
_FIELD_FUNCS = {"field", "Field", "PydanticField", "msgspec.field", "dataclasses.field", "pydantic.Field"}


# ---------------------------------------------------------------------------------------------
# the signature model
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
        return {p.name for p in self.params if p.kind in (POS_KW, KW_ONLY)}

    def has(self, kind: str) -> bool:
        """True when a parameter of ``kind`` exists."""
        return any(p.kind == kind for p in self.params)


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


def top_statements(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Module-level statements, looking inside ``if``/``try`` blocks."""
    for s in body:
        yield s
        if isinstance(s, ast.If):
            yield from top_statements(s.body)
            yield from top_statements(s.orelse)
        elif isinstance(s, ast.Try):
            yield from top_statements(s.body)
            for h in s.handlers:
                yield from top_statements(h.body)
            yield from top_statements(s.orelse)
            yield from top_statements(s.finalbody)


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
            for s in top_statements(tree.body)
            if isinstance(s, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name
        ]
        if defs:
            real = [d for d in defs if not _is_overload(d)] or defs
            d = real[-1]
            return Found("class" if isinstance(d, ast.ClassDef) else "function", module, path, d)
        for s in top_statements(tree.body):
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
                params.append(Param(s.target.id, KW_ONLY if kw_only else POS_KW, required))
        return params

    def _function_sig(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> list[Param]:
        a = fn.args
        positional = a.posonlyargs + a.args
        n_defaults = len(a.defaults)
        params = []
        for i, p in enumerate(positional):
            kind = POS_ONLY if i < len(a.posonlyargs) else POS_KW
            params.append(Param(p.arg, kind, i < len(positional) - n_defaults))
        if a.vararg:
            params.append(Param(a.vararg.arg, VAR_POS, False))
        for p, dflt in zip(a.kwonlyargs, a.kw_defaults):
            params.append(Param(p.arg, KW_ONLY, dflt is None))
        if a.kwarg:
            params.append(Param(a.kwarg.arg, VAR_KW, False))
        if drop_first and params and params[0].kind in (POS_ONLY, POS_KW):
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
        if p.kind == KW_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind == VAR_POS:
            star = True
            parts.append(f"*{p.name}")
        elif p.kind == VAR_KW:
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

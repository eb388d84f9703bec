"""``doctor --scan``: walk a package's source and record every reference into the engine.

:class:`Walker` reads each module of the scanned package once with :mod:`ast` (nothing is imported) and
interprets it abstractly: imports (star imports followed, in the package and in the engine), attribute
chains, constructor and function calls with their positional count and keyword names, ``self``
attributes of the package's classes, return values (annotated, or inferred from ``return``), values
passed to the package's own functions, ``types.MethodType(f, obj)`` (``f``'s ``self`` is ``obj``),
``super()`` of classes extending engine classes, and classes handed to the engine by name to be mixed
into its own (``worker_extension_cls``). The walk repeats until what it learned stops changing; the last
pass records :class:`~specdraft.doctor.scan.values.Site` objects for :mod:`specdraft.doctor.scan.check`.
"""

from __future__ import annotations

import ast
import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator

from specdraft.doctor.check import shorten
from specdraft.doctor.scan.expr import ExprMixin, last_name
from specdraft.doctor.scan.source import ScanTarget
from specdraft.doctor.scan.values import (
    UNKNOWN,
    LocalClass,
    LocalFunc,
    Scope,
    Site,
    Val,
    engine_attr,
    engine_lookup,
    val_of,
)
from specdraft.doctor.source.reader import SourceTree, absolute, decorators

__all__ = ["PLUGS", "Walker"]

#: keywords through which the engine receives a class of the scanned package (its dotted path) and mixes
#: it into its own classes: that class's ``self`` has those classes' members (vLLM's worker extension)
PLUGS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "worker_extension_cls": ("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker"),
    },
}

_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


class Walker(ExprMixin):
    """The abstract interpreter over a scanned package (see the module docstring)."""

    def __init__(self, target: ScanTarget, tree: SourceTree, engine: str = "vllm",
                 plugs: dict[str, tuple[str, ...]] | None = None):  # fmt: skip
        """Walk ``target`` against the engine source ``tree`` (``plugs``: see :data:`PLUGS`)."""
        self.target, self.tree, self.engine = target, tree, engine
        self.plugs = PLUGS.get(engine, {}) if plugs is None else plugs
        self.sources: dict[str, str] = {}
        self.parsed: dict[str, ast.Module | None] = {}
        self.menv: dict[str, Scope] = {}
        self.stars: dict[str, list[Val]] = {}
        self.classes: dict[int, LocalClass] = {}
        self.funcs: dict[int, LocalFunc] = {}
        self.sites: list[Site] = []
        self.opaque_attrs: dict[str, Val] = {}
        self.recording = False
        self.changed = False
        self.unknown_calls: Counter[str] = Counter()
        self._walked: set[str] = set()
        self._seen: set[tuple] = set()

    # -----------------------------------------------------------------------------------------
    # driver
    # -----------------------------------------------------------------------------------------
    def run(self, max_passes: int = 6) -> list[Site]:
        """Walk every module until nothing new is learned, then once more recording the sites."""
        for _ in range(max_passes):
            self.changed = False
            self._pass()
            if not self.changed:
                break
        self.recording = True
        self._pass()
        return self.sites

    def _pass(self) -> None:
        """Walk every module once (a module reached first through a star import is not walked twice)."""
        self._walked = set()
        for module in self.target.modules:
            self.module_scope(module)

    def module_scope(self, module: str) -> Scope:
        """The module's scope, walking the module first in this pass (star imports need it complete)."""
        scope = self.menv.setdefault(module, Scope(module))
        if module in self._walked or module not in self.target.modules:
            return scope
        self._walked.add(module)
        tree = self._parse(module)
        if tree is not None:
            self.stars[module] = []
            self.block(tree.body, scope)
        return scope

    def _parse(self, module: str) -> ast.Module | None:
        """The module's syntax tree, read once (None when it does not parse)."""
        if module not in self.parsed:
            path = self.target.modules[module]
            text = path.read_text(encoding="utf-8", errors="replace")
            self.sources[module] = text
            try:
                self.parsed[module] = ast.parse(text)
            except SyntaxError:
                self.parsed[module] = None
        return self.parsed[module]

    # -----------------------------------------------------------------------------------------
    # sites
    # -----------------------------------------------------------------------------------------
    def site(self, kind: str, node: ast.AST, scope: Scope, **kw) -> None:
        """Record a reference into the engine (last pass only)."""
        line = getattr(node, "lineno", 0)
        key = (kind, scope.module, line, getattr(node, "col_offset", 0), kw.get("name", ""))
        if not self.recording or key in self._seen:
            return
        self._seen.add(key)
        text = ast.get_source_segment(self.sources.get(scope.module, ""), node) or kw.get("name", "")
        path = str(self.target.modules[scope.module].relative_to(self.target.root))
        text = shorten(" ".join(text.split()), 160)
        self.sites.append(Site(kind, path, line, text, guarded=scope.guarded, **kw))

    def learn(self, table: dict[str, Val], key: str, val: Val) -> None:
        """Remember ``val`` under ``key`` unless something is known there already."""
        if val.kind == "unknown" or table.get(key, UNKNOWN).kind != "unknown":
            return
        table[key] = val
        self.changed = True

    # -----------------------------------------------------------------------------------------
    # statements
    # -----------------------------------------------------------------------------------------
    def block(self, body: Iterable[ast.stmt], scope: Scope) -> None:
        """Walk statements in order."""
        for s in body:
            self.stmt(s, scope)

    def stmt(self, s: ast.stmt, scope: Scope) -> None:
        """Walk one statement."""
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            self.imports(s, scope)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.function(s, scope)
        elif isinstance(s, ast.ClassDef):
            self.classdef(s, scope)
        elif isinstance(s, ast.Assign):
            v = self.ev(s.value, scope)
            for t in s.targets:
                self.bind(t, v, scope)
        elif isinstance(s, ast.AnnAssign):
            v = self.ev(s.value, scope) if s.value is not None else UNKNOWN
            if v.kind == "unknown":
                v = self.annotation(s.annotation, scope)
            self.bind(s.target, v, scope)
        elif isinstance(s, ast.AugAssign):
            self.ev(s.value, scope)
            if isinstance(s.target, ast.Attribute):
                self.ev(s.target.value, scope)
        elif isinstance(s, ast.Return):
            v = self.ev(s.value, scope)
            fn = scope.vars.get("__function__")  # the function whose body this is
            if fn is not None and fn.ref.returns.kind == "unknown" and v.kind != "unknown":
                fn.ref.returns, self.changed = v, True
        else:
            self.compound(s, scope)

    def compound(self, s: ast.stmt, scope: Scope) -> None:
        """Walk a loop, ``with``, ``try``, ``if``, ``match`` or any other statement: its expressions, then
        its blocks."""
        if isinstance(s, (ast.For, ast.AsyncFor)):
            self.bind(s.target, self.element(self.ev(s.iter, scope)), scope)
            self.block(s.body + s.orelse, scope)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                v = self.ev(item.context_expr, scope)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, self.entered(v), scope)
            self.block(s.body, scope)
        elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            self.tryblock(s, scope)
        elif isinstance(s, ast.If):
            self.ev(s.test, scope)
            checked = _hasattr_checks(s.test)
            body = scope.variant(guards=scope.guards | checked) if checked else scope
            with self.narrowed(s.test, scope):
                self.block(s.body, body)
            self.block(s.orelse, scope)
        elif isinstance(s, ast.Match):
            self.ev(s.subject, scope)
            for case in s.cases:
                self.block(case.body, scope)
        else:  # Expr, While, Raise, Assert, Delete, ...: every expression, then nested blocks
            for _name, value in ast.iter_fields(s):
                if isinstance(value, ast.expr):
                    self.ev(value, scope)
                elif isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    self.block(value, scope)
                elif isinstance(value, list):
                    for v in value:
                        if isinstance(v, ast.expr):
                            self.ev(v, scope)

    @contextlib.contextmanager
    def narrowed(self, test: ast.expr, scope: Scope) -> Iterator[None]:
        """Inside ``if isinstance(x, C):`` (``and`` parts too), the name ``x`` is an instance of ``C`` (a class of
        the package or of the engine): its members are looked up there, not on what ``x`` was declared as.
        Afterwards ``x`` is what it was, unless the block bound it anew."""
        narrow: dict[str, Val] = {}
        for name, cls_node in _isinstance_checks(test):
            cls = self.ev(cls_node, scope)
            if cls.kind == "lclass":
                narrow[name] = Val("linst", ref=cls.ref)
            elif cls.kind == "eclass":
                narrow[name] = Val("einst", cls.finds)
        saved = {n: scope.vars[n] for n in narrow if n in scope.vars}
        scope.vars.update(narrow)
        try:
            yield
        finally:
            for n, v in narrow.items():
                if scope.vars.get(n) is v and n in saved:
                    scope.vars[n] = saved[n]
                elif scope.vars.get(n) is v:
                    del scope.vars[n]

    def tryblock(self, s: ast.Try, scope: Scope) -> None:
        """A ``try``: imports in its body are guarded when a handler catches ``ImportError``."""
        caught = {n for h in s.handlers for n in _names(h.type)}
        bare = any(h.type is None for h in s.handlers)
        inner = scope.variant(
            guarded=scope.guarded or bool(caught & _IMPORT_ERRORS) or bare,
            attr_errors=scope.attr_errors or "AttributeError" in caught,
        )
        self.block(s.body, inner)
        for h in s.handlers:
            self.ev(h.type, scope)
            if h.name:
                scope.vars[h.name] = UNKNOWN
            self.block(h.body, scope)
        self.block(s.orelse + s.finalbody, scope)

    # -----------------------------------------------------------------------------------------
    # imports
    # -----------------------------------------------------------------------------------------
    def _is_engine(self, module: str) -> bool:
        """Whether ``module`` belongs to the engine package."""
        return module.split(".")[0] == self.engine

    def _is_local(self, module: str) -> bool:
        """Whether ``module`` belongs to the scanned package."""
        return module in self.target.modules

    def module_val(self, module: str, node: ast.AST, scope: Scope) -> Val:
        """The value of an imported module, recording an engine import site."""
        if self._is_engine(module):
            found = self.tree.submodule(module)
            self.site("import", node, scope, name=module, hit=found,
                      why="" if found else f"module {module} not found under {self.tree.root}")  # fmt: skip
            return Val("emod", (found,)) if found is not None else UNKNOWN
        if self._is_local(module):
            return Val("lmod", ref=module)
        return Val("ext", oid=module)

    def imports(self, s: ast.Import | ast.ImportFrom, scope: Scope) -> None:
        """Bind imported names; record engine imports (a missing module or name is a break)."""
        if isinstance(s, ast.Import):
            for a in s.names:
                v = self.module_val(a.name, s, scope)
                if a.asname:
                    scope.vars[a.asname] = v
                else:
                    top = a.name.split(".")[0]
                    scope.vars[top] = v if top == a.name else self.module_val(top, s, scope)
            return
        src = absolute(scope.module, self.target.modules[scope.module], s.level, s.module)
        for a in s.names:
            if a.name == "*":
                self.stars.setdefault(scope.module, []).append(self.module_val(src, s, scope))
                if self._is_local(src):
                    self.module_scope(src)
                continue
            scope.vars[a.asname or a.name] = self.imported(src, a.name, s, scope)

    def imported(self, src: str, name: str, node: ast.AST, scope: Scope) -> Val:
        """The value of ``from src import name``."""
        if self._is_engine(src):
            hit = engine_lookup(self.tree, src, name)
            self.site("import", node, scope, name=f"{src}:{name}", hit=hit)
            return val_of(self.tree, hit) if hit is not None else UNKNOWN
        if self._is_local(src):
            return self.module_member(src, name)
        return Val("ext", oid=f"{src}.{name}")

    def from_stars(self, module: str, name: str, depth: int = 0) -> Val:
        """``name`` bound in ``module`` by one of its star imports."""
        if depth > 8 or name.startswith("_"):
            return UNKNOWN
        for src in self.stars.get(module, []):
            if src.kind == "emod":
                hit = engine_lookup(self.tree, src.finds[0].module, name)
                if hit is not None:
                    return engine_attr(self.tree, src, name)
            elif src.kind == "lmod":
                inner = self.module_scope(src.ref)
                if name in inner.vars:
                    return inner.vars[name]
                v = self.from_stars(src.ref, name, depth + 1)
                if v.kind != "unknown":
                    return v
        return UNKNOWN

    # -----------------------------------------------------------------------------------------
    # definitions
    # -----------------------------------------------------------------------------------------
    def function(self, s: ast.FunctionDef | ast.AsyncFunctionDef, scope: Scope) -> None:
        """Register a function and walk its body with its parameters bound."""
        for d in [*s.decorator_list, *s.args.defaults, *(d for d in s.args.kw_defaults if d is not None)]:
            self.ev(d, scope)
        fn = self.funcs.setdefault(id(s), LocalFunc(scope.module, s, scope.cls if scope.class_body else None))
        scope.vars[s.name] = Val("lfunc", ref=fn)
        outer = scope.parent if scope.class_body else scope
        inner = (outer or scope).child(cls=fn.cls)
        inner.vars["__function__"] = Val("lfunc", ref=fn)
        if fn.returns.kind == "unknown" and s.returns is not None:
            ann = self.annotation(s.returns, scope)
            if ann.kind != "unknown":
                fn.returns, self.changed = ann, True
        self._bind_params(fn, inner, scope)
        self.block(s.body, inner)

    def _bind_params(self, fn: LocalFunc, inner: Scope, scope: Scope) -> None:
        """Bind ``fn``'s parameters in its scope: ``self``/``cls``, what callers passed, else the annotation."""
        a = fn.node.args
        params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
        decos = decorators(fn.node)
        for i, p in enumerate(params):
            v = fn.params.get(p.arg, UNKNOWN)
            if i == 0 and fn.cls is not None and "staticmethod" not in decos and p in a.posonlyargs + a.args:
                v = Val("lclass" if "classmethod" in decos else "linst", ref=fn.cls)
            elif v.kind == "unknown" and p.annotation is not None:
                v = self.annotation(p.annotation, scope)
            inner.vars[p.arg] = v

    def classdef(self, s: ast.ClassDef, scope: Scope) -> None:
        """Register a class (its bases: engine classes it extends) and walk its body."""
        cls = self.classes.setdefault(id(s), LocalClass(scope.module, s, f"{scope.module}.{s.name}"))
        cls.bases = [self.ev(b, scope) for b in s.bases]
        for d in [*s.decorator_list, *(k.value for k in s.keywords)]:
            self.ev(d, scope)
        scope.vars[s.name] = Val("lclass", ref=cls)
        body = scope.child(class_body=True, cls=cls)
        self.block(s.body, body)
        for name, v in body.vars.items():
            if v.kind not in ("lfunc", "unknown"):
                self.learn(cls.attrs, name, v)

    def plug(self, keyword: str, value: ast.expr, scope: Scope) -> None:
        """A class of the package handed to the engine through ``keyword``: mix the engine classes in."""
        path = value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else ""
        local = self.ev(value, scope) if not path else UNKNOWN
        cls = local.ref if local.kind == "lclass" else None
        if path and "." in path:
            mod, _, name = path.rpartition(".")
            if self._is_local(mod):
                v = self.module_scope(mod).vars.get(name, UNKNOWN)
                cls = v.ref if v.kind == "lclass" else None
        if cls is None:
            return
        for symbol in self.plugs.get(keyword, ()):
            found, _ = self.tree.resolve(symbol)
            if found is not None and all(found.node is not f.node for f in cls.plugged):
                cls.plugged.append(found)
                self.changed = True


def _required_calls(test: ast.expr, name: str) -> list[list[ast.expr]]:
    """The arguments of each two-argument call of builtin ``name`` a condition requires (``and`` parts)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [c for v in test.values for c in _required_calls(v, name)]
    ok = isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == name
    return [test.args] if ok and len(test.args) == 2 else []


def _hasattr_checks(test: ast.expr) -> frozenset[tuple[str, str]]:
    """``(expression, name)`` of each ``hasattr(expression, "name")`` a condition requires."""
    return frozenset((ast.unparse(o), a.value) for o, a in _required_calls(test, "hasattr")
                     if isinstance(a, ast.Constant) and isinstance(a.value, str))  # fmt: skip


def _isinstance_checks(test: ast.expr) -> list[tuple[str, ast.expr]]:
    """``(name, class)`` of each ``isinstance(name, Class)`` a condition requires."""
    return [(o.id, c) for o, c in _required_calls(test, "isinstance")
            if isinstance(o, ast.Name) and not isinstance(c, ast.Tuple)]  # fmt: skip


def _names(node: ast.AST | None) -> set[str]:
    """Exception class names in a handler's ``except`` clause."""
    if node is None:
        return set()
    if isinstance(node, ast.Tuple):
        return {n for e in node.elts for n in _names(e)}
    return {last_name(node)}

"""``doctor --scan``: the expression half of the package walker (``Walker`` in scan/walk.py).

Evaluates an expression of the scanned package to a :class:`~specdraft.doctor.scan.values.Val`, recording
an ``attr`` site for each attribute read on an engine value, a ``call`` site for each call of one (with
its positional count and keyword names) and a ``store`` site for each attribute assigned on one.
"""

from __future__ import annotations

import ast
from collections import Counter
from typing import Any

from specdraft.doctor.scan.values import (
    UNKNOWN,
    LocalClass,
    LocalFunc,
    Scope,
    Val,
    call_result,
    engine_attr,
    homogeneous,
    is_none,
    unquoted,
)
from specdraft.doctor.source.reader import decorators, defines_member

__all__ = ["PASSTHROUGH", "ExprMixin"]

#: calls whose result holds the engine objects passed in (iterating it yields them)
PASSTHROUGH = {"enumerate", "zip", "list", "tuple", "iter", "next", "reversed", "sorted", "islice", "filter"}

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


class ExprMixin:
    """Expression evaluation; the host class provides the scopes, sites and module tables."""

    tree: Any
    plugs: dict[str, tuple[str, ...]]
    recording: bool
    unknown_calls: Counter[str]  # per module: method calls on values of unknown origin
    opaque_attrs: dict[str, Val]  # what the package assigns on engine objects of unknown type

    # provided by Walker
    def site(self, kind: str, node: ast.AST, scope: Scope, **kw: Any) -> None: ...
    def learn(self, table: dict[str, Val], key: str, val: Val) -> None: ...
    def module_scope(self, module: str) -> Scope: ...
    def from_stars(self, module: str, name: str, depth: int = 0) -> Val: ...
    def plug(self, keyword: str, value: ast.expr, scope: Scope) -> None: ...
    def _is_local(self, module: str) -> bool: ...

    # -----------------------------------------------------------------------------------------
    def ev(self, node: ast.AST | None, scope: Scope) -> Val:
        """The value of an expression, recording engine sites on the way."""
        if node is None:
            return UNKNOWN
        if isinstance(node, ast.Name):
            return self.lookup(node.id, scope)
        if isinstance(node, ast.Attribute):
            return self.attr_of(self.ev(node.value, scope), node.attr, node, scope)
        if isinstance(node, ast.Call):
            return self.call(node, scope)
        if isinstance(node, ast.Subscript):
            v = self.ev(node.value, scope)
            self.ev(node.slice, scope)
            return self.element(v)
        if isinstance(node, ast.NamedExpr):
            v = self.ev(node.value, scope)
            self.bind(node.target, v, scope)
            return v
        if isinstance(node, (ast.IfExp, ast.BoolOp)):
            vals = [self.ev(c, scope) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]
            vals = vals[1:] if isinstance(node, ast.IfExp) else vals
            return next((v for v in vals if v.kind != "unknown"), UNKNOWN)
        if isinstance(node, (ast.Await, ast.Starred)):
            return self.ev(node.value, scope)
        if isinstance(node, ast.Lambda):
            inner = scope.child()
            for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                inner.vars[a.arg] = UNKNOWN
            self.ev(node.body, inner)
            return UNKNOWN
        if isinstance(node, _COMPREHENSIONS):
            return self.comprehension(node, scope)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.ev(child, scope)
        return UNKNOWN

    def lookup(self, name: str, scope: Scope) -> Val:
        """A name: the scope chain (enclosing class bodies skipped), then the module's star imports."""
        s: Scope | None = scope
        first = True
        while s is not None:
            if (first or not s.class_body) and name in s.vars:
                return s.vars[name]
            first, s = False, s.parent
        return self.from_stars(scope.module, name)

    def comprehension(self, node: ast.expr, scope: Scope) -> Val:
        """A comprehension: its targets bound to the elements of what it iterates."""
        inner = scope.child()
        for gen in node.generators:  # type: ignore[attr-defined]
            self.bind(gen.target, self.element(self.ev(gen.iter, inner)), inner)
            for cond in gen.ifs:
                self.ev(cond, inner)
        for part in ("elt", "key", "value"):
            if hasattr(node, part):
                self.ev(getattr(node, part), inner)
        return UNKNOWN

    def element(self, v: Val) -> Val:
        """An element of ``v`` (subscript, iteration): the element class of an engine container, or an
        opaque engine object when ``v`` is another engine value."""
        if v.kind == "econt":
            return Val("einst", v.finds)
        return Val("opaque", oid=f"{v.describe()}[]") if v.engine else UNKNOWN

    def entered(self, v: Val) -> Val:
        """What ``with v as x`` binds."""
        return Val("opaque", oid=f"{v.describe()}.__enter__()") if v.engine else UNKNOWN

    # -----------------------------------------------------------------------------------------
    # attributes
    # -----------------------------------------------------------------------------------------
    def attr_of(self, recv: Val, attr: str, node: ast.AST, scope: Scope, tolerant: bool = False) -> Val:
        """``recv.<attr>``: recorded when ``recv`` is an engine value (or a class extending one)."""
        if recv.kind == "econt":
            return UNKNOWN  # a list's, an iterator's methods
        if recv.engine:
            tolerant = tolerant or scope.tolerates(node, attr)
            self.site("attr", node, scope, recv=recv, name=attr, tolerant=tolerant)
            stored = self.opaque_attrs.get(f"{recv.oid}.{attr}") if recv.kind == "opaque" else None
            return stored if stored is not None else engine_attr(self.tree, recv, attr)
        if recv.kind in ("linst", "lclass"):
            v = self.local_member(recv.ref, attr)
            # a method taken from the class (``Cls.meth``) is called with its ``self`` passed
            if v is not None and v.kind == "lfunc" and recv.kind == "lclass":
                return Val("lfunc", ref=v.ref, via_class=True)
            if v is not None:
                return v
            bases = recv.ref.engine_bases()
            if bases:
                ev = Val("einst" if recv.kind == "linst" else "eclass", bases, combined=True)
                self.site("attr", node, scope, recv=ev, name=attr, tolerant=tolerant)
                return engine_attr(self.tree, ev, attr)
            return UNKNOWN
        if recv.kind == "lmod":
            return self.module_member(recv.ref, attr)
        if recv.kind == "ext":
            return Val("ext", oid=f"{recv.oid}.{attr}")
        return UNKNOWN

    def module_member(self, module: str, name: str) -> Val:
        """``name`` of the package's ``module``: bound there, by a star import, or a submodule."""
        inner = self.module_scope(module)
        if name in inner.vars:
            return inner.vars[name]
        v = self.from_stars(module, name)
        if v.kind != "unknown":
            return v
        sub = f"{module}.{name}"
        return Val("lmod", ref=sub) if self._is_local(sub) else UNKNOWN

    def local_member(self, cls: LocalClass, attr: str, depth: int = 0) -> Val | None:
        """``attr`` defined by the package's class ``cls`` or its package bases (None: not defined there)."""
        for s in cls.node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == attr:
                fn = getattr(self, "funcs", {}).get(id(s))
                return Val("lfunc", ref=fn) if fn is not None else UNKNOWN
        if attr in cls.attrs:
            return cls.attrs[attr]
        if attr in cls.stored or any(defines_member(s, attr) for s in cls.node.body):
            return UNKNOWN
        for b in cls.bases:
            if b.kind == "lclass" and depth < 10:
                v = self.local_member(b.ref, attr, depth + 1)
                if v is not None:
                    return v
        return None

    # -----------------------------------------------------------------------------------------
    # assignment targets
    # -----------------------------------------------------------------------------------------
    def bind(self, target: ast.AST, v: Val, scope: Scope) -> None:
        """Assign ``v`` to a target: a name, ``obj.attr`` (recorded on engine objects), a tuple."""
        if isinstance(target, ast.Name):
            scope.vars[target.id] = v
        elif isinstance(target, ast.Attribute):
            recv = self.ev(target.value, scope)
            if recv.kind in ("linst", "lclass"):
                recv.ref.stored.add(target.attr)
                self.learn(recv.ref.attrs, target.attr, v)
            elif recv.engine and recv.kind != "econt":
                self.site("store", target, scope, recv=recv, name=target.attr)
                if recv.kind == "opaque":
                    self.learn(self.opaque_attrs, f"{recv.oid}.{target.attr}", v)
        elif isinstance(target, ast.Subscript):
            self.ev(target.value, scope)
            self.ev(target.slice, scope)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for i, e in enumerate(target.elts):
                item = Val("opaque", oid=f"{v.describe()}[{i}]") if v.engine else UNKNOWN
                self.bind(e.value if isinstance(e, ast.Starred) else e, item, scope)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, v, scope)

    def annotation(self, node: ast.AST | None, scope: Scope) -> Val:
        """The instance an annotation promises: ``X``, ``"X"``, ``X | None``, ``Optional[X]``."""
        if node is None:
            return UNKNOWN
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return self.annotation(unquoted(node), scope)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self._union([node.left, node.right], scope)
        if isinstance(node, ast.Subscript):
            base = last_name(node.value)
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if base in ("Optional", "Union"):
                return self._union(elts, scope)
            if base == "Annotated":
                return self.annotation(elts[0], scope)
            if homogeneous(base, elts):
                inner = self.annotation(elts[0], scope)
                return Val("econt", inner.finds) if inner.kind == "einst" else UNKNOWN
            return UNKNOWN
        v = self.ev(node, scope)
        if v.kind == "eclass":
            return Val("einst", v.finds)
        if v.kind == "lclass":
            return Val("linst", ref=v.ref)
        return UNKNOWN

    def _union(self, members: list[ast.expr], scope: Scope) -> Val:
        """A union annotation: the engine instances it names; ``partial`` when another member is not one (the
        value may be something else: names missing on the engine classes are then unchecked)."""
        finds: list = []
        partial = False
        for m in members:
            if is_none(m):
                continue
            v = self.annotation(m, scope)
            finds.extend(v.finds if v.kind == "einst" else [])
            partial = partial or v.kind != "einst" or v.partial
        return Val("einst", tuple(finds), partial=partial) if finds else UNKNOWN

    # -----------------------------------------------------------------------------------------
    # calls
    # -----------------------------------------------------------------------------------------
    def call(self, node: ast.Call, scope: Scope) -> Val:
        """A call: engine callees are recorded and typed; the package's functions learn their arguments."""
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("super", "getattr", "hasattr"):
            if self.lookup(f.id, scope).kind == "unknown":
                return self.builtin(f.id, node, scope)
        fv = self.ev(f, scope)
        args = [self.ev(a, scope) for a in node.args]
        kws = {k.arg: self.ev(k.value, scope) for k in node.keywords}
        if fv.engine:
            for k in [k for k in node.keywords if k.arg in self.plugs]:
                self.plug(k.arg, k.value, scope)
            if fv.kind not in ("emod", "econt"):
                self.site("call", node, scope, recv=fv, **_shape(node))
            return call_result(self.tree, fv, f"{fv.describe()}()")
        if fv.kind == "lclass":
            return self.construct(fv.ref, node, args, kws, scope)
        if fv.kind == "lfunc":
            fn: LocalFunc = fv.ref
            self.pass_args(fn, node, args, kws, skip_first=_bound_first(fn, fv.via_class))
            return fn.returns
        if fv.kind == "ext":
            return self.external_call(fv, args)
        if self.recording and fv.kind == "unknown" and isinstance(f, ast.Attribute):
            self.unknown_calls[scope.module] += 1
        return UNKNOWN

    def construct(self, cls: LocalClass, node: ast.Call, args: list[Val], kws: dict, scope: Scope) -> Val:
        """Instantiating the package's class: its ``__init__`` learns the arguments, or the engine class's
        ``__init__`` it inherits is bound."""
        init = self.local_member(cls, "__init__")
        if init is not None and init.kind == "lfunc":
            self.pass_args(init.ref, node, args, kws, skip_first=True)
        elif init is None and cls.engine_bases():
            self.site("call", node, scope, recv=Val("eclass", cls.engine_bases()[:1]), **_shape(node))
        return Val("linst", ref=cls)

    def pass_args(self, fn: LocalFunc, node: ast.Call, args: list[Val], kws: dict, skip_first: bool) -> None:
        """Let ``fn``'s parameters learn the values passed (positional up to the first ``*args``)."""
        if fn is None:
            return
        a = fn.node.args
        params = (a.posonlyargs + a.args)[1 if skip_first else 0 :]
        for p, arg_node, v in zip(params, node.args, args):
            if isinstance(arg_node, ast.Starred):
                break
            self.learn(fn.params, p.arg, v)
        for k, v in [(k, v) for k, v in kws.items() if k is not None]:
            self.learn(fn.params, k, v)

    def external_call(self, fv: Val, args: list[Val]) -> Val:
        """A call outside package and engine: ``types.MethodType(f, obj)`` binds ``f``'s ``self`` to
        ``obj``; iteration helpers pass engine objects through."""
        last = fv.oid.split(".")[-1]
        if last == "MethodType" and len(args) >= 2 and args[0].kind == "lfunc" and args[0].ref is not None:
            fn: LocalFunc = args[0].ref
            params = fn.node.args.posonlyargs + fn.node.args.args
            if params:
                self.learn(fn.params, params[0].arg, args[1])
            return UNKNOWN
        tainted = next((a for a in args if a.engine), None)
        if tainted is not None and last in PASSTHROUGH:
            same = last not in ("enumerate", "zip", "next") and tainted.kind in ("econt", "opaque")
            return tainted if same else Val("opaque", oid=tainted.describe())
        return UNKNOWN

    def builtin(self, name: str, node: ast.Call, scope: Scope) -> Val:
        """``super()`` (the engine classes a class extends), ``getattr(obj, "name"[, default])``, ``hasattr``."""
        args = [self.ev(a, scope) for a in node.args]
        if name == "super":
            cls = scope.cls
            if cls is None:
                return UNKNOWN
            bases = cls.engine_bases()
            if bases:
                return Val("einst", bases, combined=True)
            local = next((b for b in cls.bases if b.kind == "lclass"), None)
            return Val("linst", ref=local.ref) if local is not None else UNKNOWN
        if name == "getattr" and len(node.args) >= 2:
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return self.attr_of(args[0], key.value, node, scope, tolerant=len(node.args) >= 3)
        return UNKNOWN


def _bound_first(fn: LocalFunc | None, via_class: bool) -> bool:
    """Whether Python fills ``fn``'s first parameter itself: a method's ``self`` through an instance, a
    classmethod's ``cls`` either way; never a staticmethod's or a plain function's."""
    if fn is None or fn.cls is None:
        return False
    decos = decorators(fn.node)
    if "staticmethod" in decos:
        return False
    return "classmethod" in decos or not via_class


def _shape(node: ast.Call) -> dict[str, Any]:
    """What a call passes: positional count, keyword names, ``*args``/``**kwargs``."""
    return {
        "n_pos": sum(1 for a in node.args if not isinstance(a, ast.Starred)),
        "keywords": tuple(k.arg for k in node.keywords if k.arg is not None),
        "splat": any(isinstance(a, ast.Starred) for a in node.args),
        "dsplat": any(k.arg is None for k in node.keywords),
    }


def last_name(node: ast.AST) -> str:
    """The last name of a dotted expression or call (``functools.cached_property`` -> ``cached_property``)."""
    if isinstance(node, ast.Call):
        return last_name(node.func)
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""

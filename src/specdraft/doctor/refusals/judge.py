"""A refusal's condition evaluated by Python itself on our values, three-valued: True (refused), False
(accepted), None (unknown).

The condition's ``ast`` is compiled and run, with each part that holds one of our values (a field, an alias of
one, a local assigned once) bound to that value, module constants and key tables bound to theirs, a small set
of pure builtins, and everything else (engine state, a value we do not know, another call) bound to a fresh
:class:`Unknown`, whose every operation (``bool()``, a comparison, ``len()``, iteration, ``in``, an attribute,
a call, ``is``, ``isinstance``) raises :class:`Undecided`: then the verdict is unknown, never a guess. So
``(x or 0) > 4096``, ``len(ids or []) < 4``, chained comparisons, ``any(...)``, ``d.get(k, 0)`` behave as in
Python. A condition's top-level ``and``/``or``/``not`` combine truths (``unknown and False`` is False).
A path of ours is tested on this machine, where the engine runs (``Path(v).exists()``,
``os.path.isdir(v)``), and ``raises(CALL, TYPE)`` (a ``try`` whose handler refuses) calls CALL when it is a
library validator of :data:`VALIDATORS` (:func:`_raises`).
"""

from __future__ import annotations

import ast
import builtins
import copy
import importlib
import os
import pathlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

__all__ = ["DESCEND", "NOT_CONSTANT", "VALIDATORS", "Undecided", "Unknown", "constant", "truth"]

#: library functions that only validate their argument (no engine code, no I/O): a refusal made of one
#: of them failing is judged by calling it on our value
VALIDATORS = frozenset(
    {
        "huggingface_hub.utils.validate_repo_id",
        "huggingface_hub.utils._validators.validate_repo_id",
        "huggingface_hub.validate_repo_id",
    }
)


class Undecided(Exception):
    """An operation on an :class:`Unknown`: the condition cannot be told for our values."""


class Unknown:
    """A value not known statically: every operation on it raises :class:`Undecided`."""

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name

    def _undecided(self, *args: Any, **kwargs: Any) -> Any:
        raise Undecided(object.__getattribute__(self, "name"))


for _op in (
    "bool len iter contains hash index int float fspath format str repr bytes call getitem getattr instancecheck "
    "neg pos abs invert round eq ne lt le gt ge add sub mul truediv floordiv mod pow matmul and or xor lshift "
    "rshift divmod radd rsub rmul rtruediv rfloordiv rmod rpow rmatmul rand ror rxor rlshift rrshift rdivmod"
).split():
    setattr(Unknown, f"__{_op}__", Unknown._undecided)

#: the return of a lookup for a node that holds none of our values: its parts are looked up instead
DESCEND: Any = object()


def _isinstance(obj: Any, types: Any) -> bool:
    spec = types if isinstance(types, tuple) else (types,)
    if isinstance(obj, Unknown) or not all(isinstance(t, type) for t in spec):
        raise Undecided("isinstance")
    return isinstance(obj, spec)


def _getattr(obj: Any, name: str, *default: Any) -> Any:
    if not isinstance(name, str) or name.startswith("_"):
        raise Undecided("getattr")
    return getattr(obj, name, *default)


def _is(a: Any, b: Any) -> bool:
    if isinstance(a, Unknown) or isinstance(b, Unknown):
        raise Undecided("is")  # an unknown value may be any object, None included
    return a is b


_PURE = (
    "len any all min max int float str bool tuple list set frozenset dict sorted abs sum round zip enumerate "
    "reversed hasattr"
).split()
BUILTINS: dict[str, Any] = {
    **{k: getattr(builtins, k) for k in _PURE},
    **{k: v for k, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)},
    "isinstance": _isinstance,
    "getattr": _getattr,
    "__is__": _is,
}


class _Path:
    """``pathlib.Path`` of our value, read-only: the tests of a path on this machine, nothing that writes."""

    _READ = frozenset({"exists", "is_dir", "is_file", "is_symlink", "name", "suffix", "stem", "parts"})

    def __init__(self, *parts: Any) -> None:
        self._p = pathlib.Path(*(str(p._p) if isinstance(p, _Path) else p for p in parts))

    def __getattr__(self, name: str) -> Any:
        if name not in self._READ:
            raise Undecided(f"Path.{name}")
        return getattr(self._p, name)

    def __fspath__(self) -> str:
        return str(self._p)

    __str__ = __fspath__


_OS_PATH = {f"os.path.{f}": getattr(os.path, f) for f in ("exists", "lexists", "isdir", "isfile", "islink")}
#: dotted names (after the module's imports) bound to what they are
_KNOWN: dict[str, Any] = {
    **{p: _Path for p in ("Path", "pathlib.Path", "PurePath", "pathlib.PurePath")},
    "os": SimpleNamespace(
        path=SimpleNamespace(**{k.rsplit(".", 1)[1]: f for k, f in _OS_PATH.items()}), fspath=str
    ),
    "os.fspath": str,
    **_OS_PATH,
}


def _imported(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module or "builtins"), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _raises(kind: str, *calls: Callable[[], Any]) -> bool:
    """``raises(CALL..., TYPE)`` (see :mod:`.collect`): True when one call raises TYPE, False when every call
    returns; :class:`Undecided` otherwise (a call of an unknown function, another failure)."""
    exc_type = _imported(kind)
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        raise Undecided(kind)
    for call in calls:
        try:
            call()
        except Undecided:
            raise
        except exc_type:
            return True
        except Exception as exc:  # another failure: not this refusal's
            raise Undecided(kind) from exc
    return False


class _Bind(ast.NodeTransformer):
    """The condition with our values' nodes replaced by names bound to them (:attr:`bound`)."""

    def __init__(self, lookup: Callable[[ast.AST], Any], qualify: Callable[[str], str], local: set[str]):
        self.lookup, self.qualify, self.local = lookup, qualify, local
        self.bound: dict[str, Any] = {}

    def _bind(self, value: Any, node: ast.AST) -> ast.Name:
        name = f"_v{len(self.bound)}"
        self.bound[name] = copy.deepcopy(value) if not isinstance(value, Unknown) else value
        return ast.copy_location(ast.Name(id=name, ctx=ast.Load()), node)

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Constant):
            if not (isinstance(node, ast.Name) and node.id in self.local):
                got = self.lookup(node)
                if isinstance(got, ast.expr):  # an alias or local, inlined (a copy: the tree is the engine's)
                    return self.visit(copy.deepcopy(got))
                if got is not DESCEND:
                    return self._bind(got, node)
        return super().visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        if node.attr.startswith("__"):
            return self._bind(Unknown(node.attr), node)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> Any:
        if node.id in self.local or node.id in BUILTINS:
            return node
        q = self.qualify(node.id)
        known = _KNOWN.get(q, _imported(q) if q in VALIDATORS else None)
        return self._bind(known if known is not None else Unknown(node.id), node)

    def visit_Compare(self, node: ast.Compare) -> Any:
        node = self.generic_visit(node)
        if not any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            return node
        parts: list[ast.expr] = []
        for a, op, b in zip([node.left, *node.comparators], node.ops, node.comparators):
            if isinstance(op, (ast.Is, ast.IsNot)):
                test: ast.expr = ast.Call(ast.Name("__is__", ast.Load()), [a, b], [])
                parts.append(ast.UnaryOp(ast.Not(), test) if isinstance(op, ast.IsNot) else test)
            else:
                parts.append(ast.Compare(a, [op], [b]))
        return ast.copy_location(ast.BoolOp(ast.And(), parts) if len(parts) > 1 else parts[0], node)

    def visit_Call(self, node: ast.Call) -> Any:
        if isinstance(node.func, ast.Name) and node.func.id == "raises" and len(node.args) > 1:
            *calls, kind = node.args
            thunks = [ast.Lambda(ast.arguments([], [], None, [], [], None, []), self.visit(c)) for c in calls]
            kind_name = ast.Constant(self.qualify(ast.unparse(kind)))
            return ast.copy_location(ast.Call(self._bind(_raises, node), [kind_name, *thunks], []), node)
        return self.generic_visit(node)


def _evaluate(test: ast.expr, lookup: Callable[[ast.AST], Any], qualify: Callable[[str], str]) -> bool | None:
    nodes = list(ast.walk(test))  # the names it binds itself: comprehension and := targets, lambda parameters
    local = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    binder = _Bind(lookup, qualify, local | {a.arg for a in nodes if isinstance(a, ast.arg)})
    expr = ast.fix_missing_locations(ast.Expression(binder.visit(copy.deepcopy(test))))
    try:
        code = compile(expr, "<refusal>", "eval")
        return bool(eval(code, {"__builtins__": BUILTINS, **binder.bound}))  # noqa: S307 -- sandboxed: see module doc
    except Exception:  # Undecided, or the condition failing on our value (the engine raises elsewhere)
        return None


#: the nodes of a constant expression (no call, attribute or comprehension: nothing of the engine runs)
_CONSTANT_NODES = (
    ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple,
    ast.List, ast.Set, ast.Dict, ast.Name, ast.Subscript, ast.Slice, ast.Load, ast.operator, ast.unaryop,
    ast.boolop, ast.cmpop,
)  # fmt: skip
NOT_CONSTANT: Any = object()


def constant(expr: ast.expr, names: dict[str, Any]) -> Any:
    """The value Python gives a constant expression (``1 << 12``, ``64 * 1024``, ``MAX * 2``, ``("a",) + B``)
    with ``names`` the constants it may read; :data:`NOT_CONSTANT` for anything else (a call, an unknown name,
    a shift or power past 4096)."""
    tree = ast.Expression(expr)
    for n in ast.walk(tree):
        if not isinstance(n, _CONSTANT_NODES) or (isinstance(n, ast.Name) and n.id not in names):
            return NOT_CONSTANT
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Pow, ast.LShift)):
            right = n.right.value if isinstance(n.right, ast.Constant) else None
            if not isinstance(right, int) or right > 4096:
                return NOT_CONSTANT
    try:
        code = compile(ast.fix_missing_locations(tree), "<constant>", "eval")
        return eval(code, {"__builtins__": {}, **names})  # noqa: S307 -- constant nodes only: see above
    except Exception:
        return NOT_CONSTANT


def truth(
    test: ast.expr, lookup: Callable[[ast.AST], Any], qualify: Callable[[str], str] = str
) -> bool | None:
    """Whether ``test`` is true for our values: True, False, or None when it cannot be told.

    Args:
        test: the condition.
        lookup: for a node, our value it holds (an :class:`Unknown` when ours and not known), an expression
            to evaluate in its place (an alias inlined), or :data:`DESCEND` (none of ours: its parts are
            looked up).
        qualify: the dotted name a name of the engine's module stands for (its imports followed).
    """
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        t = truth(test.operand, lookup, qualify)
        return None if t is None else not t
    if isinstance(test, ast.BoolOp):
        parts = [truth(v, lookup, qualify) for v in test.values]
        decisive = isinstance(test.op, ast.Or)  # True decides an `or`, False an `and`
        return decisive if decisive in parts else (None if None in parts else not decisive)
    return _evaluate(test, lookup, qualify)

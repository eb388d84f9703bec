"""A refusal's condition evaluated on our value, three-valued: True (refused), False (accepted), None (unknown).

Only what is certain is evaluated: literals, module constants, our known values, comparisons (chained,
``in``, ``is``), ``and``/``or``/``not``, arithmetic, ``len`` and ``isinstance`` with builtin types. Anything
else (a call, an engine object, a value we do not know) is unknown, and so is a condition using it unless
the rest decides it (``unknown and False`` is False).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

__all__ = ["UNKNOWN", "truth", "value"]

#: a value not known statically
UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "UNKNOWN"})()

_COMPARE: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_ARITH: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_TYPES: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "set": set,
}

Lookup = Callable[[ast.AST], Any]


def truth(node: ast.AST, lookup: Lookup) -> bool | None:
    """Whether ``node`` is true for our values: True, False, or None when it cannot be told."""
    v = value(node, lookup)
    if v is UNKNOWN:
        return None
    try:
        return bool(v)
    except Exception:  # an object whose truth raises: not ours to decide
        return None


def _boolop(node: ast.BoolOp, lookup: Lookup) -> Any:
    parts = [truth(v, lookup) for v in node.values]
    decisive = isinstance(node.op, ast.Or)  # True decides an `or`, False an `and`
    if decisive in parts:
        return decisive
    return UNKNOWN if None in parts else not decisive


def _compare(node: ast.Compare, lookup: Lookup) -> Any:
    left = value(node.left, lookup)
    result: Any = True
    for op, right_node in zip(node.ops, node.comparators):
        right = value(right_node, lookup)
        if left is UNKNOWN or right is UNKNOWN:
            result = UNKNOWN
        else:
            try:
                ok = _COMPARE[type(op)](left, right)
            except Exception:  # comparing what cannot be compared: the engine raises elsewhere, not here
                return UNKNOWN
            if not ok:
                return False
        left = right
    return result


def _call(node: ast.Call, lookup: Lookup) -> Any:
    name = node.func.id if isinstance(node.func, ast.Name) else ""
    if name == "len" and len(node.args) == 1:
        v = value(node.args[0], lookup)
        return UNKNOWN if v is UNKNOWN or not hasattr(v, "__len__") else len(v)
    if name == "isinstance" and len(node.args) == 2:
        v = value(node.args[0], lookup)
        spec = node.args[1]
        names = spec.elts if isinstance(spec, ast.Tuple) else [spec]
        types = [_TYPES.get(n.id) if isinstance(n, ast.Name) else None for n in names]
        if v is UNKNOWN or None in types:
            return UNKNOWN
        return isinstance(v, tuple(t for t in types if t is not None))
    return lookup(node)


def value(node: ast.AST, lookup: Lookup) -> Any:
    """The value of ``node`` for our values, or :data:`UNKNOWN`; ``lookup`` gives names, attributes,
    subscripts and calls (our fields, module constants) or :data:`UNKNOWN`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        elts = [value(e, lookup) for e in node.elts]
        if any(e is UNKNOWN for e in elts):
            return UNKNOWN
        try:
            return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](elts)
        except TypeError:  # an unhashable member of a set
            return UNKNOWN
    if isinstance(node, ast.BoolOp):
        return _boolop(node, lookup)
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.Not):
            t = truth(node.operand, lookup)
            return UNKNOWN if t is None else not t
        v = value(node.operand, lookup)
        if isinstance(node.op, ast.USub) and isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v
        return UNKNOWN
    if isinstance(node, ast.Compare):
        return _compare(node, lookup)
    if isinstance(node, ast.BinOp):
        a, b = value(node.left, lookup), value(node.right, lookup)
        op = _ARITH.get(type(node.op))
        if op is None or a is UNKNOWN or b is UNKNOWN:
            return UNKNOWN
        try:
            return op(a, b)
        except Exception:  # a division by zero, a type mismatch: unknown here
            return UNKNOWN
    if isinstance(node, ast.Call):
        return _call(node, lookup)
    return lookup(node)

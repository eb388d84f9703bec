"""A refusal's condition evaluated on our value, three-valued: True (refused), False (accepted), None (unknown).

Only what is certain is evaluated: literals, module constants, our known values, comparisons (chained,
``in``, ``is``), ``and``/``or``/``not``, arithmetic, ``len`` and ``isinstance`` with builtin types, a
filesystem test of a path we pass (``Path(v).exists()``, ``os.path.isdir(v)``: on this machine, where the
engine runs), and ``raises(CALL, TYPE)`` (a ``try`` whose handler refuses) when CALL is a library validator
of :data:`VALIDATORS`, called on our value where that library is installed (:func:`raises`). Anything
else (another call, an engine object, a value we do not know) is unknown, and so is a condition using it
unless the rest decides it (``unknown and False`` is False).
"""

from __future__ import annotations

import ast
import importlib
import operator
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["UNKNOWN", "VALIDATORS", "raises", "truth", "value"]

#: library functions that only validate their argument (no engine code, no I/O): a refusal made of one
#: of them failing is judged by calling it on our value
VALIDATORS = frozenset(
    {
        "huggingface_hub.utils.validate_repo_id",
        "huggingface_hub.utils._validators.validate_repo_id",
        "huggingface_hub.validate_repo_id",
    }
)
#: filesystem tests on a path value
_PATH_METHODS = frozenset({"exists", "is_dir", "is_file", "is_symlink"})
_OS_PATH: dict[str, Callable[[str], bool]] = {
    "os.path.exists": os.path.exists,
    "os.path.lexists": os.path.lexists,
    "os.path.isdir": os.path.isdir,
    "os.path.isfile": os.path.isfile,
    "os.path.islink": os.path.islink,
}

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


def _path_test(node: ast.Call, lookup: Lookup) -> Any:
    """``p.exists()`` (``p`` a ``Path`` of our value) or ``os.path.exists(v)``, on this machine; else UNKNOWN."""
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in _PATH_METHODS and not node.args and not node.keywords:
        v = value(f.value, lookup)
        if isinstance(v, (str, Path)):
            return getattr(Path(v), f.attr)()
    dotted = ast.unparse(f)
    if dotted in _OS_PATH and len(node.args) == 1 and not node.keywords:
        v = value(node.args[0], lookup)
        if isinstance(v, (str, Path)):
            return _OS_PATH[dotted](str(v))
    return UNKNOWN


def _imported(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module or "builtins"), name)
    except (ImportError, AttributeError, ValueError):
        return None


def raises(node: ast.Call, lookup: Lookup, qualify: Callable[[str], str]) -> Any:
    """``raises(CALL..., TYPE)`` (see :mod:`.collect`): True when a call of a library validator
    (:data:`VALIDATORS`) on our value raises TYPE, False when every call returns; UNKNOWN otherwise (another
    function, a value we do not know, the library not installed here).

    Args:
        node: the ``raises(...)`` call.
        lookup: our values, as for :func:`value`.
        qualify: the dotted name a name of the engine's module stands for (its imports followed).
    """
    *calls, kind = node.args
    exc_type = _imported(qualify(ast.unparse(kind)))
    if not calls or not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        return UNKNOWN
    for call in calls:
        if (
            not isinstance(call, ast.Call)
            or call.keywords
            or qualify(ast.unparse(call.func)) not in VALIDATORS
        ):
            return UNKNOWN
        fn = _imported(qualify(ast.unparse(call.func)))
        args = [value(a, lookup) for a in call.args]
        if fn is None or any(a is UNKNOWN for a in args):
            return UNKNOWN
        try:
            fn(*args)
        except exc_type:
            return True
        except Exception:  # another failure: not this refusal's
            return UNKNOWN
    return False


def _call(node: ast.Call, lookup: Lookup) -> Any:
    tested = _path_test(node, lookup)
    if tested is not UNKNOWN:
        return tested
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

"""The refusals of one function, read with ``ast``: each ``raise`` and ``assert``, the condition it refuses
under, its message, and the fields of our values that condition reads.

A ``raise`` refuses under the conjunction of the ``if`` tests around it (``not test`` in an ``else``); an
``assert test`` refuses under ``not test``. Raises inside ``except`` handlers react to another failure and
are left out, and so are nested functions and classes (they run elsewhere, if at all).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specdraft.doctor.formats.reads import _Reader

__all__ = ["Refusal", "fields_read", "refusals_in"]

Path = tuple[str, ...]
#: comparisons whose negation is another operator for any values (not ``<``: ``not a < b`` is not ``a >= b``
#: for values that do not compare)
_INVERSE: dict[type, type] = {
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Refusal:
    """One refusal in a function.

    Attributes:
        kind: ``raise`` or ``assert``.
        condition: the condition it refuses under, as source ('' for an unconditional raise).
        message: the exception raised (``ValueError(f"...")``) or the assert's message, as source.
        line: the line of the ``raise`` or ``assert``.
        test_line: the line of the innermost ``if`` around a raise (0: none).
        tests: the conjuncts of the condition (not compared).
    """

    kind: str
    condition: str
    message: str
    line: int
    test_line: int = 0
    tests: tuple[ast.expr, ...] = field(default=(), compare=False, hash=False, repr=False)


def _negate(test: ast.expr) -> ast.expr:
    """``not test``, without a double negation."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _INVERSE:
        return ast.Compare(left=test.left, ops=[_INVERSE[type(test.ops[0])]()], comparators=test.comparators)
    return ast.UnaryOp(op=ast.Not(), operand=test)


def _condition(tests: Sequence[ast.expr]) -> str:
    if not tests:
        return ""
    node = tests[0] if len(tests) == 1 else ast.BoolOp(op=ast.And(), values=list(tests))
    return ast.unparse(node)


def _walk(stmts: Iterable[ast.stmt], tests: tuple[ast.expr, ...], if_line: int, out: list[Refusal]) -> None:
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # runs elsewhere, if at all
        if isinstance(s, ast.If):
            _walk(s.body, (*tests, s.test), s.lineno, out)
            _walk(s.orelse, (*tests, _negate(s.test)), s.lineno, out)
        elif isinstance(s, ast.Raise) and s.exc is not None:
            out.append(Refusal("raise", _condition(tests), ast.unparse(s.exc), s.lineno, if_line, tests))
        elif isinstance(s, ast.Assert):
            conj = (*tests, _negate(s.test))
            msg = ast.unparse(s.msg) if s.msg is not None else ""
            out.append(Refusal("assert", _condition(conj), msg, s.lineno, s.lineno, conj))
        elif isinstance(s, ast.Try):  # the handlers react to another failure: left out
            for body in (s.body, s.orelse, s.finalbody):
                _walk(body, tests, if_line, out)
        elif isinstance(s, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
            _walk(s.body, tests, if_line, out)
            _walk(getattr(s, "orelse", []), tests, if_line, out)


def refusals_in(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Refusal]:
    """Every ``raise`` (outside ``except`` handlers) and ``assert`` in the body of ``fn``."""
    out: list[Refusal] = []
    _walk(fn.body, (), 0, out)
    return out


def fields_read(tests: Sequence[ast.expr], reader: _Reader) -> list[Path]:
    """The paths of the roots' values that ``tests`` read (``seed``, ``("speculative_config", "method")``),
    the longest of each chain only (``d["a"]["b"]``, not also ``d["a"]``)."""
    paths: set[Path] = set()
    for test in tests:
        for node in ast.walk(test):
            if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
                p = reader.path_of(node, False, frozenset())
                if p:
                    paths.add(p)
    return sorted(p for p in paths if not any(q != p and q[: len(p)] == p for q in paths))

"""The refusals of one function, read with ``ast``: each ``raise`` and ``assert``, the condition it refuses
under, its message, and the fields of our values that condition reads.

A ``raise`` refuses under the conjunction of the ``if`` tests around it (``not test`` in an ``else``); an
``assert test`` refuses under ``not test``. A ``raise`` directly in an ``except`` handler refuses under
``raises(BODY..., TYPE)``: the try body's expressions failing with the handler's type (a validator called
on our value), which the judge cannot evaluate. Nested functions and classes are left out (they run
elsewhere, if at all).
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
        elif isinstance(s, ast.Try):
            for body in (s.body, s.orelse, s.finalbody):
                _walk(body, tests, if_line, out)
            for h in s.handlers:  # a handler's raise refuses when the try body fails on our value
                _walk_handler(s, h, tests, out)
        elif isinstance(s, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
            _walk(s.body, tests, if_line, out)
            _walk(getattr(s, "orelse", []), tests, if_line, out)


def _walk_handler(t: ast.Try, h: ast.ExceptHandler, tests: tuple[ast.expr, ...], out: list[Refusal]) -> None:
    """The raises directly in handler `h` (not under its own ``if``), refusing under ``raises(BODY, TYPE)``:
    the try body's expressions (a call that validates our value) failing with the handler's type."""
    exprs = [
        n.value
        for n in t.body
        if isinstance(n, (ast.Expr, ast.Assign, ast.AnnAssign, ast.Return)) and n.value
    ]
    if not exprs:
        return
    kind = h.type if h.type is not None else ast.Name(id="Exception", ctx=ast.Load())
    test = ast.Call(func=ast.Name(id="raises", ctx=ast.Load()), args=[*exprs, kind], keywords=[])
    for s in h.body:
        if isinstance(s, ast.Raise) and s.exc is not None:
            line = t.body[0].lineno
            out.append(
                Refusal(
                    "raise", _condition((*tests, test)), ast.unparse(s.exc), s.lineno, line, (*tests, test)
                )
            )


def refusals_in(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Refusal]:
    """Every ``raise`` and ``assert`` in the body of ``fn``."""
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

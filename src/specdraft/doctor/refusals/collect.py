"""The refusals of one function, read with ``ast``: each ``raise`` and ``assert``, the condition it refuses
under, its message, and the fields of our values that condition reads.

A ``raise`` refuses under the conjunction of the ``if`` tests around it (``not test`` in an ``else``); an
``assert test`` refuses under ``not test``. A ``raise`` directly in an ``except`` handler refuses under
``raises(BODY..., TYPE)``: the try body's expressions failing with the handler's type (a validator called
on our value), which the judge cannot evaluate. A ``case`` of a ``match`` refuses under its pattern as a test
on the subject (and its guard), after every earlier case failed; a name a condition binds with ``:=`` stands for
its value wherever the conjunction reads it. Nested functions and classes are left out (they run elsewhere, if
at all).
"""

from __future__ import annotations

import ast
import copy
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from specdraft.doctor.formats.reads import _Reader

__all__ = ["Refusal", "fields_read", "refusals_in", "sites_in"]

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
    expr: ast.expr | None = field(default=None, compare=False, hash=False, repr=False)


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
        # where the statement calls something (:func:`sites_in`)
        out += [Refusal("site", "", "", s.lineno, if_line, _unwalrus(tests), expr=e) for e in _evaluated(s)]
        if isinstance(s, ast.If):
            _walk(s.body, (*tests, s.test), s.lineno, out)
            _walk(s.orelse, (*tests, _negate(s.test)), s.lineno, out)
        elif isinstance(s, ast.Raise) and s.exc is not None:
            exc = ast.unparse(s.exc)
            out.append(Refusal("raise", _condition(tests), exc, s.lineno, if_line, _unwalrus(tests)))
        elif isinstance(s, ast.Assert):
            conj = (*tests, _negate(s.test))
            msg = ast.unparse(s.msg) if s.msg is not None else ""
            out.append(Refusal("assert", _condition(conj), msg, s.lineno, s.lineno, _unwalrus(conj)))
        elif isinstance(s, ast.Match):
            _walk_match(s, tests, out)
        elif isinstance(s, ast.Try):
            start = len(out)
            _walk(s.body, tests, if_line, out)
            if s.handlers:  # what the body calls fails into the handlers (judged there: ``raises``)
                out[start:] = [replace(r, kind="caught") if r.kind == "site" else r for r in out[start:]]
            _walk([*s.orelse, *s.finalbody], tests, if_line, out)
            for h in s.handlers:  # a handler's raise refuses when the try body fails on our value
                _walk_handler(s, h, tests, out)
        elif isinstance(s, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
            _walk([*s.body, *getattr(s, "orelse", [])], tests, if_line, out)


def _walk_handler(t: ast.Try, h: ast.ExceptHandler, tests: tuple[ast.expr, ...], out: list[Refusal]) -> None:
    """The raises directly in handler `h` (not under its own ``if``), refusing under ``raises(BODY, TYPE)``:
    the try body's expressions (a call that validates our value) failing with the handler's type."""
    exprs = [
        n.value
        for n in t.body
        if isinstance(n, (ast.Expr, ast.Assign, ast.AnnAssign, ast.Return)) and n.value
    ]
    kind = h.type if h.type is not None else ast.Name(id="Exception", ctx=ast.Load())
    conj = (*tests, ast.Call(func=ast.Name(id="raises", ctx=ast.Load()), args=[*exprs, kind], keywords=[]))
    out += [Refusal("raise", _condition(conj), ast.unparse(s.exc), s.lineno, t.body[0].lineno, conj)
            for s in h.body if exprs and isinstance(s, ast.Raise) and s.exc is not None]  # fmt: skip


class _Inline(ast.NodeTransformer):
    """Names replaced by expressions (``:=`` names and ``case`` captures by what they hold)."""

    def __init__(self, names: dict[str, ast.expr]):
        self.names = names

    def visit_NamedExpr(self, node: ast.NamedExpr) -> ast.AST:
        return self.visit(node.value)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.names:
            return ast.copy_location(copy.deepcopy(self.names[node.id]), node)
        return node


def _unwalrus(tests: tuple[ast.expr, ...], names: dict[str, ast.expr] | None = None) -> tuple[ast.expr, ...]:
    """``tests`` with each name bound by ``:=`` (in source order) read as the value it was bound to, and the
    names in ``names`` as theirs: one side of an ``and`` reads what the other bound, as in Python."""
    bound = dict(names or {})
    for t in tests:
        for n in ast.walk(t):
            if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name):
                bound[n.target.id] = _Inline(dict(bound)).visit(copy.deepcopy(n.value))
    return tuple(_Inline(bound).visit(copy.deepcopy(t)) for t in tests) if bound else tests


def _pattern(p: ast.pattern, subject: ast.expr, captures: dict[str, ast.expr]) -> ast.expr:
    """The test a ``case`` pattern makes of ``subject`` (Python's matching, for values and alternatives; a
    structural pattern is ``__match__(subject)``, which the judge cannot tell); its captures into ``captures``."""
    if isinstance(p, ast.MatchValue):
        return ast.Compare(left=subject, ops=[ast.Eq()], comparators=[p.value])
    if isinstance(p, ast.MatchSingleton):
        return ast.Compare(left=subject, ops=[ast.Is()], comparators=[ast.Constant(p.value)])
    if isinstance(p, ast.MatchOr):
        return ast.BoolOp(op=ast.Or(), values=[_pattern(q, subject, captures) for q in p.patterns])
    if isinstance(p, ast.MatchAs):
        if p.name is not None:
            captures[p.name] = subject
        return ast.Constant(True) if p.pattern is None else _pattern(p.pattern, subject, captures)
    return ast.Call(func=ast.Name(id="__match__", ctx=ast.Load()), args=[subject], keywords=[])


def _walk_match(m: ast.Match, tests: tuple[ast.expr, ...], out: list[Refusal]) -> None:
    """Each ``case`` refuses under: every earlier case not matching, its pattern, its guard."""
    earlier: list[ast.expr] = []
    for case in m.cases:
        captures: dict[str, ast.expr] = {}
        test = _pattern(case.pattern, m.subject, captures)
        if case.guard is not None:
            test = ast.BoolOp(op=ast.And(), values=[test, case.guard])
        test = _unwalrus((test,), captures)[0]
        inner: list[Refusal] = []
        _walk(case.body, (*tests, *earlier, test), case.pattern.lineno, inner)
        out += [replace(r, tests=_unwalrus(r.tests, captures)) for r in inner]
        earlier.append(_negate(test))


def _evaluated(s: ast.stmt) -> list[ast.expr]:
    """The expressions statement ``s`` evaluates itself (not those of the blocks it holds)."""
    if isinstance(s, (ast.If, ast.While, ast.Assert)):
        return [s.test]
    if isinstance(s, (ast.For, ast.AsyncFor)):
        return [s.iter]
    if isinstance(s, (ast.With, ast.AsyncWith)):
        return [i.context_expr for i in s.items]
    if isinstance(s, ast.Match):
        return [s.subject]
    value = getattr(s, "value", None)
    ok = isinstance(s, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return))
    return [value] if ok and value else []


@functools.lru_cache(maxsize=4096)
def _walked(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Refusal]:
    out: list[Refusal] = []
    _walk(fn.body, (), 0, out)
    return out


def refusals_in(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Refusal]:
    """Every ``raise`` and ``assert`` in the body of ``fn``."""
    return [r for r in _walked(fn) if r.kind in ("raise", "assert")]


def sites_in(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Refusal]:
    """Every expression ``fn``'s statements evaluate (``kind`` ``site``, in ``expr``), with the tests on the way
    to it: where it may call a function or read a property that refuses our value."""
    return [r for r in _walked(fn) if r.kind == "site"]


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

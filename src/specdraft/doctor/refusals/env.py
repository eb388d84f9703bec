"""Refusals an environment variable turns on: ``os.environ.get("X") == "1" and ...``, ``os.getenv("X")``,
``os.environ["X"]``, ``"X" in os.environ``, vLLM's ``envs.X`` (a module named ``envs``).

The condition is judged with the variable's value substituted, as Python reads it: the value this machine has
(unset: the read's default), and the first value that turns the variable's test on (a constant the test
compares it with, else ``"1"``). Our value refused with the variable as it is here is a break; refused only
once it is turned on, a warning naming the variable and that value (the user did not set it: the refusal is
off today, not gone).
"""

from __future__ import annotations

import ast
import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from specdraft.doctor.refusals.collect import Refusal
from specdraft.doctor.refusals.judge import DESCEND, truth
from specdraft.doctor.source.reader import dotted_name

__all__ = ["READ", "EnvGate", "env_gate"]

_GET = {"os.environ.get", "os.getenv", "environ.get", "getenv", "os.environ.setdefault"}
_ENVIRON = {"os.environ", "environ"}
_UNSET: Any = object()
#: every variable a condition was judged with (a result cache holds while their values are unchanged)
READ: set[str] = set()


@dataclass(frozen=True)
class EnvGate:
    """How a refusal behind environment variable ``var`` fares: ``refused`` with it as it is here, ``on`` the
    value that turns it on and ``refused_on`` our values' verdict then, ``here`` its value here ('' unset)."""

    var: str
    on: Any
    here: str
    refused: bool | None
    refused_on: bool | None
    case: str


def _str(node: ast.AST) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""


def _read(node: ast.AST, qualify: Callable[[str], str]) -> str:
    """The variable ``node`` reads ('' when it reads none)."""
    if isinstance(node, ast.Call) and qualify(dotted_name(node.func)) in _GET and node.args:
        return _str(node.args[0])
    if isinstance(node, ast.Subscript) and qualify(dotted_name(node.value)) in _ENVIRON:
        return _str(node.slice)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
        return _str(node.left) if qualify(dotted_name(node.comparators[0])) in _ENVIRON else ""
    if isinstance(node, ast.Attribute) and node.attr.isupper() and dotted_name(node.value):
        return node.attr if qualify(dotted_name(node.value)).split(".")[-1] == "envs" else ""
    return ""


class _Set(ast.NodeTransformer):
    """The reads of ``var`` replaced by the value they give when the variable is ``value`` (_UNSET: unset)."""

    def __init__(self, var: str, value: Any, qualify: Callable[[str], str]):
        self.var, self.value, self.qualify = var, value, qualify

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.expr) and _read(node, self.qualify) == self.var:
            return ast.copy_location(self._value(node), node)
        return super().visit(node)

    def _value(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Compare):  # "X" in os.environ
            return ast.Constant((self.value is not _UNSET) == isinstance(node.ops[0], ast.In))
        if self.value is not _UNSET:
            return ast.Constant(self.value)
        if isinstance(node, ast.Call):
            return copy.deepcopy(node.args[1]) if len(node.args) > 1 else ast.Constant(None)
        return ast.Name(id="__unset__", ctx=ast.Load())  # os.environ["X"], envs.X: what it does is unknown


def _set(r: Refusal, var: str, value: Any, qualify: Callable[[str], str]) -> Refusal:
    return replace(r, tests=tuple(_Set(var, value, qualify).visit(copy.deepcopy(t)) for t in r.tests))


def _turns_on(r: Refusal, var: str, qualify: Callable[[str], str]) -> Any:
    """The first value of ``var`` that makes every test reading it (and nothing else of ours) true."""
    atoms, reading = list(r.tests), []
    while atoms:  # the conjuncts reading the variable
        t = atoms.pop(0)
        if isinstance(t, ast.BoolOp) and isinstance(t.op, ast.And):
            atoms += t.values
        elif any(_read(n, qualify) == var for n in ast.walk(t)):
            reading.append(t)
    compared = [n.value for t in reading for n in ast.walk(t) if isinstance(n, ast.Constant)]
    for value in [*(v for v in compared if isinstance(v, (str, int)) and v != var), "1", True]:
        tests = _set(replace(r, tests=tuple(reading)), var, value, qualify).tests
        if all(truth(t, lambda n: DESCEND, qualify) is True for t in tests):
            return value
    return "1"


def env_gate(
    r: Refusal, qualify: Callable[[str], str], verdict: Callable[[Refusal], tuple[bool | None, str]]
) -> EnvGate | None:
    """How refusal ``r`` fares with the environment variable its condition reads (None: it reads none);
    ``verdict`` judges a refusal on our values."""
    var = next((v for t in r.tests for n in ast.walk(t) if (v := _read(n, qualify))), "")
    if not var:
        return None
    READ.add(var)
    here = os.environ.get(var, _UNSET)
    refused, case = verdict(_set(r, var, here, qualify))
    on = _turns_on(r, var, qualify)
    refused_on, case_on = verdict(_set(r, var, on, qualify))
    return EnvGate(var, on, "" if here is _UNSET else here, refused, refused_on, case if refused else case_on)

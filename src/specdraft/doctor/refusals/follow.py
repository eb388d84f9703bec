"""Where a scope hands our values on: the functions it calls with them and the properties it reads, read as
scopes of their own (to :data:`DEPTH` calls deep), and the loops over our lists.

A call ``f(x)`` (a function of the scope's module, of a module it imports, ``mod.f(x)``) whose arguments
hold our values is a scope with ``f``'s parameters bound to them; on an object our values become (a config
class's ``self``), ``self.m(...)`` is its method ``m`` and ``self.p`` its property ``p``, both run on the
same object. The call runs under the tests on the way to it: a callee is reached when our values pass them,
not when they fail them (its refusals pass), and maybe when none of our values decides them (a refusal
there is then a warning naming that test, never a break). A ``for`` over a list of ours binds its variable
to the list's elements (``[]`` in the path: each element is judged).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable
from dataclasses import replace

from specdraft.doctor.formats.reads import ITEM, _Reader
from specdraft.doctor.refusals.collect import Refusal, sites_in
from specdraft.doctor.refusals.scopes import Scope
from specdraft.doctor.source.reader import Found, SourceTree, decorators, dotted_name

__all__ = ["DEPTH", "bind_loops", "callees"]

#: how many calls deep a scope's callees are read
DEPTH = 3
Path = tuple[str, ...]


def bind_loops(fn: ast.AST, reader: _Reader) -> None:
    """Bind the variable of each ``for`` over a list of ours (``for x in ids``, ``for i, x in enumerate(ids)``)
    to the list's elements."""
    for _ in range(3):  # a loop over the elements of an element
        changed = False
        for n in [n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension))]:
            it, target = n.iter, n.target
            if isinstance(it, ast.Call) and dotted_name(it.func) == "enumerate" and it.args:
                if isinstance(target, ast.Tuple) and len(target.elts) == 2:
                    it, target = it.args[0], target.elts[1]
            if isinstance(target, ast.Name) and target.id not in reader.env:
                path = reader.path_of(it, False, frozenset())
                if path is not None:
                    reader.env[target.id] = reader.values[target.id] = (*path, ITEM)
                    changed = True
        if not changed:
            return


def _callee(tree: SourceTree, scope: Scope, reader: _Reader, node: ast.AST) -> tuple[Found, bool] | None:
    """The function ``node`` runs (a call, or a property read on our object) and whether its first parameter is
    the object it runs on; None when it is not the engine's own function or holds none of our values."""
    target = node.func if isinstance(node, ast.Call) else node
    on_ours = (
        scope.owner is not None
        and isinstance(target, ast.Attribute)
        and reader.path_of(target.value, False, frozenset()) == ()
    )
    if isinstance(node, ast.Attribute) and on_ours and isinstance(node.ctx, ast.Load):
        m = tree.member(scope.owner, node.attr)
        ok = m is not None and m.kind == "function" and decorators(m.node) & {"property", "cached_property"}
        return (m, True) if ok else None
    if not isinstance(node, ast.Call):
        return None
    if on_ours:
        m = tree.member(scope.owner, node.func.attr)
        if m is None or m.kind != "function" or decorators(m.node) & {"property", "cached_property"}:
            return None
        return m, "staticmethod" not in decorators(m.node)
    args = [*node.args, *(k.value for k in node.keywords)]
    if not any(reader.path_of(a, False, frozenset()) is not None for a in args) or not dotted_name(node.func):
        return None
    found = tree.resolve_expr(scope.module, node.func)
    return (found, False) if found is not None and found.kind == "function" and found.owner is None else None


def _roots(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, node: ast.AST, reader: _Reader, bound: bool
) -> dict[str, Path]:
    """The parameters of ``fn`` that the call ``node`` fills with our values, and the paths they hold."""
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    roots: dict[str, Path] = {}
    if bound and params:
        roots[params.pop(0)] = ()
    if isinstance(node, ast.Call):
        positional = itertools.takewhile(lambda arg: not isinstance(arg, ast.Starred), node.args)
        for name, arg in [*zip(params, positional), *((k.arg, k.value) for k in node.keywords if k.arg)]:
            path = reader.path_of(arg, False, frozenset())
            if path is not None:
                roots[name] = path
    return roots


def _and(a: bool | None, b: bool | None) -> bool | None:
    return False if False in (a, b) else (None if None in (a, b) else True)


def callees(
    tree: SourceTree, scope: Scope, reader: _Reader, reached: Callable[[Refusal], bool | None]
) -> list[Scope]:
    """The scopes ``scope`` hands our values to (see the module doc); ``reached(site)`` judges the tests on the
    way to a call in ``scope`` (a ``site`` of :func:`~.collect.sites_in`: True, False or None)."""
    out: list[Scope] = []
    for site in sites_in(scope.fn):
        for node in ast.walk(site.expr):
            hit = _callee(tree, scope, reader, node)
            if hit is None or hit[0].node is scope.fn:
                continue
            found, bound = hit
            roots = _roots(found.node, node, reader, bound)
            if not roots:
                continue
            here = reached(site) if site.tests else True
            gate = scope.gate or (" and ".join(ast.unparse(t) for t in site.tests) if here is None else "")
            out.append(replace(scope, module=found.module, fn=found.node, roots=roots, judged=frozenset(),
                               tables={}, owner=scope.owner if bound else None,
                               reached=_and(scope.reached, here), gate=gate))  # fmt: skip
    return out

"""Which keys of a config an engine function reads, read from its source with :mod:`ast`.

Given a function (or a whole module) and the names that hold a config -- a dict parameter such as
``config_dict``, or a config object such as ``self.config`` -- :func:`config_reads` lists every key path
read from it: ``d["a"]["b"]`` and ``d["a"][0]["c"]`` (required: a missing key raises), ``d.get("a", x)``
and ``getattr(c, "a", x)`` (optional, with the default's source text), ``"a" in d`` / ``hasattr(c, "a")``
(presence tests), and with ``attrs`` plain attribute reads of a config object (``config.hidden_size``,
required). Local aliases are followed (``spec = d["speculators_config"]; spec["verifier"]``,
``ec = getattr(c, "eagle_config", None) or {}``), a read guarded by an ``if`` that tests the same key, or
inside a ``try`` whose handler catches the failure, is optional, and a ``if value not in TABLE: raise``
(or ``if value != CONST: raise``) on a read value records the values the engine accepts (``TABLE`` a
literal, a local or module-level dict, or a table filled by a registering decorator such as vLLM's
``@register_speculator("eagle3")``).
With ``follow``, a call handing the config (or a part of it) to a function of the engine's own package
(``_cfg_get(config, "block_size", None)``, ``_get_dflash_config(config)``) is read into: that function is
read with its parameter as the root, a string passed for another parameter as that key, and the call's
value is the config path the function returns (its first ``return`` of one), up to ``depth`` calls deep; its
reads are located at the call.
``d.get("k", d)`` is ``d`` itself (a config without ``k``, as ours are: SGLang's ``text_config`` fallback).
A key the function itself stores before it reads it (``d["k"] = {...}`` then ``d["k"]["x"]``) is its own
value, not a read of the config: from the store on (to the end of the ``if``/loop/``try`` block holding the
store; after an ``if`` whose every branch stores it, to the end of the function) its reads are not recorded.
:func:`config_writes` lists the keys a function writes into a dict (``out["k"] = ...``).

Nothing is imported; :mod:`specdraft.engine.formats` declares which functions read our exports.
"""

from __future__ import annotations

import ast
import functools
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specdraft.doctor.source.reader import dotted_name

__all__ = ["Follow", "KeyRead", "config_reads", "config_writes", "registered_keys", "registered_function"]

#: a list element in a key path (``d["methods"][0]`` -> ``("methods", "[]")``)
ITEM = "[]"

#: finds a called function in the engine's source: (module calling it, name called) -> (its definition,
#: its module), or None when it is not the engine's own (a builtin, another package, a method)
Follow = Callable[[str, str], "tuple[ast.FunctionDef, str] | None"]


@dataclass(frozen=True)
class KeyRead:
    """One read of a config key path.

    Attributes:
        path: the key path below the config (``("speculators_config", "verifier", "name_or_path")``).
        kind: ``required`` (a missing key raises), ``default`` (a default applies), ``presence`` (tested only).
        default: the default's source text (``default`` reads).
        line: the line of the read.
        allowed: the values the engine accepts there (``value not in TABLE: raise``), None when unchecked.
        via: ``item`` (``d["k"]``, ``d.get``, ``in``) or ``attr`` (``getattr``/``hasattr`` on an object).
    """

    path: tuple[str, ...]
    kind: str
    default: str | None = None
    line: int = 0
    allowed: tuple[str, ...] | None = None
    via: str = "item"


_MISSING = object()


def _lookup(config: Any, path: Sequence[str]) -> Any:
    """The value at ``path`` in a nested config (``[]``: the first list element); ``_MISSING`` when absent."""
    cur = config
    for part in path:
        if part == ITEM:
            if not isinstance(cur, list) or not cur:
                return _MISSING
            cur = cur[0]
        elif isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        else:
            return _MISSING
    return cur


def _split(dotted: str) -> tuple[str, ...]:
    return tuple(p for p in dotted.split(".") if p)


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


#: calls that give the same value in another type: their result is still the path of their argument
_SAME_VALUE = frozenset({"Path", "pathlib.Path", "PurePath", "pathlib.PurePath", "str", "os.fspath"})


@dataclass(frozen=True)
class _Calls:
    """How a reader follows calls: the resolver, the module being read, how many calls deeper it may go."""

    follow: Follow
    module: str
    depth: int


class _Reader:
    """Walks one function (or module) and collects the key reads of the config roots."""

    def __init__(
        self,
        roots: Sequence[str],
        tables: Mapping[str, tuple[str, ...]],
        attrs: bool = False,
        calls: _Calls | None = None,
    ):
        self.env: dict[str, tuple[str, ...]] = {r: () for r in roots}  # name -> config path
        self.values: dict[str, tuple[str, ...]] = {}  # name -> path of the value it holds
        self.tables = ChainMap(
            {}, tables
        )  # name -> keys of a dict literal / registry (read when first asked)
        self.reads: list[KeyRead] = []
        self.attrs = attrs  # plain attribute reads of the config object are key reads
        self.caught = 0  # depth of ``try`` bodies whose handler catches a missing key
        self.written: frozenset = frozenset()  # paths the function has stored by now (its own values)
        self.calls = calls  # following calls into the engine's functions (None: not)
        self.consts: dict[str, str] = {}  # parameter -> the key string the caller passed for it
        self.texts: dict[str, str] = {}  # parameter -> the caller's argument text (for defaults)

    def _key(self, node: ast.AST | None) -> str | None:
        """A key string: a literal, or a parameter the caller passed one for."""
        key = _const_str(node)
        return self.consts.get(node.id) if key is None and isinstance(node, ast.Name) else key

    def _text(self, node: ast.AST) -> str:
        return self.texts.get(node.id, node.id) if isinstance(node, ast.Name) else ast.unparse(node)

    # -- paths -------------------------------------------------------------------------------
    def path_of(self, node: ast.AST, record: bool, guarded: frozenset) -> tuple[str, ...] | None:
        """The config path ``node`` evaluates to (None: not the config); records the reads on the way."""
        dotted = dotted_name(node)
        if dotted in self.env:
            return self.env[dotted]
        if isinstance(node, ast.Subscript):
            base = self.path_of(node.value, record, guarded)
            if base is None:
                return None
            key = self._key(node.slice)
            if key is None:
                return (*base, ITEM)
            path = (*base, key)
            if record and isinstance(node.ctx, ast.Load):
                self._add(KeyRead(path, "default" if path in guarded else "required", None, node.lineno))
            return path
        if isinstance(node, ast.Call):
            return self._call_path(node, record, guarded)
        if self.attrs and isinstance(node, ast.Attribute):
            base = self.path_of(node.value, record, guarded)
            if base is None or (base and base[-1] == ITEM) or node.attr.startswith("__"):
                return None
            path = (*base, node.attr)
            if record and isinstance(node.ctx, ast.Load):
                kind = "default" if path in guarded else "required"
                self._add(KeyRead(path, kind, None, node.lineno, via="attr"))
            return path
        return None

    def _call_path(self, node: ast.Call, record: bool, guarded: frozenset) -> tuple[str, ...] | None:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and node.args:
            base = self.path_of(f.value, record, guarded)
            key = self._key(node.args[0])
            if base is None or key is None:
                return None
            dflt = self._text(node.args[1]) if len(node.args) > 1 else "None"
            if record:
                self._add(KeyRead((*base, key), "default", dflt, node.lineno))
                for a in node.args[1:]:
                    self.visit(a, guarded)  # the default is evaluated too
            if len(node.args) > 1 and self.path_of(node.args[1], False, frozenset()) == base:
                return base  # d.get("k", d): d itself for a config without k
            return (*base, key)
        if dotted_name(f) in _SAME_VALUE and len(node.args) == 1 and not node.keywords:
            return self.path_of(node.args[0], record, guarded)  # Path(x), str(x): still our value x
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(node.args) >= 2:
            base = self.path_of(node.args[0], record, guarded)
            key = self._key(node.args[1])
            if base is None or key is None:
                return None
            if record:
                if f.id == "hasattr":
                    self._add(KeyRead((*base, key), "presence", None, node.lineno, via="attr"))
                else:
                    dflt = self._text(node.args[2]) if len(node.args) > 2 else None
                    for a in node.args[2:]:
                        self.visit(a, guarded)
                    kind = "default" if dflt is not None or (*base, key) in guarded else "required"
                    self._add(KeyRead((*base, key), kind, dflt, node.lineno, via="attr"))
            return (*base, key) if f.id == "getattr" else None
        return self._followed(node, record)

    # -- following calls -------------------------------------------------------------------------
    def _followed(self, node: ast.Call, record: bool) -> tuple[str, ...] | None:
        """A call handing the config to a function of the engine: its reads (when ``record``) are ours, its
        value the config path it returns (None: not such a call, or it returns none)."""
        calls = self.calls
        if calls is None or calls.depth <= 0 or not isinstance(node.func, ast.Name):
            return None
        args = [*node.args, *(k.value for k in node.keywords)]
        if not any(self.path_of(a, False, frozenset()) is not None for a in args):
            return None
        hit = calls.follow(calls.module, node.func.id)
        if hit is None:
            return None
        fn, module = hit
        sub = _Reader([], {}, self.attrs, _Calls(calls.follow, module, calls.depth - 1))
        sub.bind_params(fn, node, self)
        sub.aliases(fn.body)
        if record:
            for s in fn.body:
                sub.visit(s, frozenset())
            for r in sub.reads:
                self._add(replace(r, line=node.lineno))  # located at the call, in the function read
        return sub.returned(fn)

    def bind_params(self, fn: ast.FunctionDef, call: ast.Call, caller: _Reader) -> None:
        """The roots of ``fn`` called by ``call`` in ``caller``: each parameter receiving a config path, and the
        key strings passed for the others."""
        params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
        pairs = [*zip(params, call.args), *((k.arg, k.value) for k in call.keywords if k.arg)]
        for name, arg in pairs:
            path = caller.path_of(arg, False, frozenset())
            if path is not None:
                self.env[name] = self.values[name] = path
            elif caller._key(arg) is not None:
                self.consts[name] = caller._key(arg)
            self.texts[name] = caller._text(arg)

    def returned(self, fn: ast.FunctionDef) -> tuple[str, ...] | None:
        """The config path ``fn`` returns: its first ``return`` (in source order) of one."""
        rets = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
        for r in sorted(rets, key=lambda n: n.lineno):
            path = self.path_of(r.value, False, frozenset())
            if path is not None:
                return path
        return None

    def _add(self, r: KeyRead) -> None:
        if any(r.path[: len(w)] == w for w in self.written):
            return  # the function reads back what it stored: not a key of the config
        if self.caught and r.kind == "required":
            r = replace(r, kind="default", default=r.default or "None (the failure is caught)")
        self.reads.append(r)

    # -- statements ----------------------------------------------------------------------------
    def aliases(self, body: Sequence[ast.stmt]) -> None:
        """Names bound to parts of the config (``x = d["a"]``, ``x = d.get("a", {})``), to a fixpoint."""
        for _ in range(4):
            before = (dict(self.env), dict(self.values))
            for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    self._bind(node.targets[0], node.value)
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    self._bind(node.target, node.value)
            if before == (self.env, self.values):
                return

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        name = dotted_name(target)
        if not name or name in self.env and not self.env[name]:
            return
        if isinstance(target, ast.Attribute) and self.path_of(target.value, False, frozenset()) is not None:
            return  # ``config.k = v`` stores into the config: no alias
        if isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or):
            value = value.values[0]  # ``x = d.get("k") or {}``: x is d["k"] (or an empty stand-in)
        # ``x = d.get("k") if ... else getattr(d, "k")``: the branch holding a path
        if isinstance(value, ast.IfExp):
            no_path = self.path_of(value.body, False, frozenset()) is None
            value = value.orelse if no_path else value.body
        if isinstance(value, ast.Dict):
            keys = tuple(k for k in (_const_str(k) for k in value.keys) if k is not None)
            if keys:
                self.tables[name] = keys
            return
        path = self.path_of(value, False, frozenset())
        if path is not None:
            self.env.setdefault(name, path)
            self.values.setdefault(name, path)

    def _block(self, body: Sequence[ast.AST], guarded: frozenset) -> frozenset:
        """Visit the statements of one block; the paths stored in it (kept to its end only) are returned."""
        before = self.written
        for child in body:
            self.visit(child, guarded)
        stored, self.written = self.written, before
        return stored

    def _store(self, node: ast.Assign | ast.AnnAssign, guarded: frozenset) -> None:
        """``d["k"] = v`` / ``config.k = v``: the value is read first, then ``k`` holds the function's own
        value."""
        if node.value is not None:
            self.visit(node.value, guarded)
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if isinstance(t, (ast.Subscript, ast.Attribute)):
                path = self.path_of(t, True, guarded)
                if path is not None and path and ITEM not in path:
                    self.written |= {path}
                    continue
            self.visit(t, guarded)

    def visit(self, node: ast.AST, guarded: frozenset) -> None:
        """Record every read under ``node``; an ``if`` guards the keys its test reads, a ``try`` those of its body."""
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            self._store(node, guarded)
            return
        if isinstance(node, ast.Try):
            catches = any(_catches_missing(h) for h in node.handlers)
            self.caught += catches
            self._block(node.body, guarded)
            self.caught -= catches
            for part in (*node.handlers, node.orelse):
                self._block(part if isinstance(part, list) else [part], guarded)
            self.written |= self._block(node.finalbody, guarded)  # a finally block always runs
            return
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tested = self._tested(node.test)
            self.visit(node.test, guarded)
            if isinstance(node, ast.If):
                self._constraint(node)
            inner = guarded | tested
            body = self._block(node.body if isinstance(node.body, list) else [node.body], inner)
            other = self._block(node.orelse if isinstance(node.orelse, list) else [node.orelse], inner)
            if isinstance(node, ast.If):
                self.written |= body & other  # stored on every branch: stored after the ``if``
            return
        if isinstance(node, (ast.For, ast.AsyncFor)):
            self.visit(node.iter, guarded)
            self._block([*node.body, *node.orelse], guarded)
            return
        if isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
            key = self._key(node.left)
            base = self.path_of(node.comparators[0], True, guarded)
            if key is not None and base is not None:
                self._add(KeyRead((*base, key), "presence", None, node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and self.attrs:
            # a method call on the config (``config.to_dict()``) is not a key read
            if node.func.attr != "get" and self.path_of(node.func.value, True, guarded) is not None:
                for child in node.args + [k.value for k in node.keywords]:
                    self.visit(child, guarded)
                return
        if isinstance(node, (ast.Subscript, ast.Call, ast.Attribute)):
            if self.path_of(node, True, guarded) is not None:
                for child in ast.iter_child_nodes(node):
                    if not isinstance(child, (ast.Subscript, ast.Call, ast.Attribute, ast.Name)):
                        self.visit(child, guarded)
                return
        for child in ast.iter_child_nodes(node):
            self.visit(child, guarded)

    def _tested(self, test: ast.AST) -> frozenset:
        """Key paths an ``if`` test reads (the body may then read them by subscript safely)."""
        probe = _Reader([], self.tables, self.attrs)
        probe.env, probe.values = self.env, self.values
        probe.visit(test, frozenset())
        names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        return frozenset({r.path for r in probe.reads} | {self.values[n] for n in names if n in self.values})

    def _constraint(self, node: ast.If) -> None:
        """``if VALUE not in TABLE: raise`` -> the values accepted at VALUE's path."""
        t = node.test
        if not (
            isinstance(t, ast.Compare)
            and len(t.ops) == 1
            and isinstance(t.ops[0], (ast.NotIn, ast.NotEq))
            and any(isinstance(s, ast.Raise) for s in node.body)
        ):
            return
        left, right = t.left, t.comparators[0]
        path = (
            self.values.get(left.id) if isinstance(left, ast.Name) else self.path_of(left, False, frozenset())
        )
        if isinstance(t.ops[0], ast.NotEq):
            ok = isinstance(right, ast.Constant) and isinstance(right.value, (str, int, float, bool))
            allowed = (str(right.value),) if ok else None
        else:
            allowed = self._table(right)
        if path is not None and allowed is not None:
            self._add(KeyRead(path, "default", None, node.lineno, allowed))

    def _table(self, node: ast.AST) -> tuple[str, ...] | None:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return tuple(v for v in (_const_str(e) for e in node.elts) if v is not None)
        return self.tables.get(dotted_name(node))


def _catches_missing(handler: ast.ExceptHandler) -> bool:
    """Whether an ``except`` clause catches a missing key or attribute (bare, Exception, KeyError, ...)."""
    caught = {"Exception", "BaseException", "KeyError", "AttributeError", "TypeError", "LookupError"}
    t = handler.type
    names = [] if t is None else (t.elts if isinstance(t, ast.Tuple) else [t])
    return t is None or any(dotted_name(n).split(".")[-1] in caught for n in names)


def config_reads(
    nodes: Iterable[ast.AST],
    roots: Sequence[str],
    tables: Mapping[str, tuple[str, ...]] | None = None,
    attrs: bool = False,
    follow: Follow | None = None,
    module: str = "",
    depth: int = 0,
) -> list[KeyRead]:
    """Every read of the config held by ``roots`` in ``nodes`` (functions or module bodies), merged by path.

    Args:
        nodes: the syntax trees to read (a function, a class, a module).
        roots: names holding the config (``config_dict``, ``self.config``).
        tables: names of module-level key tables (``{"SUPPORTED": ("eagle3", ...)}``) for constraints.
        attrs: the roots are config objects: ``config.k`` reads key ``k`` (method calls excepted).
        follow: finds the engine's functions a call hands the config to; ``module`` is the one read, ``depth``
            how many calls deep to follow (0: none).
    """
    out: dict[tuple[str, ...], KeyRead] = {}
    rank = {"required": 0, "default": 1, "presence": 2}
    for node in nodes:
        calls = _Calls(follow, module, depth) if follow is not None and depth > 0 else None
        r = _Reader(roots, {} if tables is None else tables, attrs, calls)
        body = node.body if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)) else [node]
        r.aliases(body)
        for s in body:
            r.visit(s, frozenset())
        for read in r.reads:
            old = out.setdefault(read.path, read)
            merged = old if rank[old.kind] <= rank[read.kind] else read
            out[read.path] = replace(
                merged, default=old.default or read.default, allowed=old.allowed or read.allowed
            )
    return list(out.values())


def config_writes(node: ast.AST, root: str) -> set[str]:
    """Keys ``node`` writes into the dict ``root`` (``root["k"] = ...``)."""
    return {k for k in (_const_str(t.slice) for t in _stores_into(node, root)) if k}


def _stores_into(node: ast.AST, root: str | None) -> list[ast.Subscript]:
    """Every ``root[key] = ...`` target in ``node`` (None: into any name)."""
    targets = [t for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets]
    return [t for t in targets if isinstance(t, ast.Subscript) and root in (None, dotted_name(t.value))]


@functools.lru_cache(maxsize=1024)
def _table_index(
    module: ast.Module,
) -> tuple[dict[str, list], list[tuple[int, str, str]], dict[str, set[str]]]:
    """One walk of ``module`` for :func:`registered_keys`: every assignment by target name, in walk order
    ``(position, keys or None when built at run time)``; every ``@name("key")`` decorator ``(position, name,
    key)``; and per top-level function, the names it writes ``name[...] = ...`` into."""
    assigned: dict[str, list] = {}
    decorators: list[tuple[int, str, str]] = []
    for i, n in enumerate(ast.walk(module)):
        if isinstance(n, ast.Assign):
            literal = isinstance(
                n.value, (ast.Dict, ast.Tuple, ast.List, ast.Set)
            )  # SUPPORTED = ("eagle3", ...)
            items = (n.value.keys if isinstance(n.value, ast.Dict) else n.value.elts) if literal else []
            keys = [k for k in map(_const_str, items) if k] if literal else None
            for t in n.targets:
                assigned.setdefault(dotted_name(t), []).append((i, keys))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            calls = [d for d in n.decorator_list if isinstance(d, ast.Call) and d.args]
            decorators += [(i, dotted_name(d.func).split(".")[-1], _const_str(d.args[0])) for d in calls]
    writes = {
        f.name: {dotted_name(t.value) for t in _stores_into(f, None)}
        for f in module.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    return assigned, decorators, writes


def registered_keys(module: ast.Module, table: str) -> tuple[str, ...] | None:
    """The keys of ``table`` in ``module``: a dict literal's, plus every ``@register("key")`` that fills it (a
    function of the module whose body writes ``table[...] = ...``); None when the module never assigns it or
    builds it at run time (a call, a comprehension: its keys are not known, not "none")."""
    assigned, decorators, writes = _table_index(module)
    if table not in assigned or any(keys is None for _, keys in assigned[table]):
        return None
    fillers = {name for name, roots in writes.items() if table in roots}
    found = [(i, k) for i, keys in assigned[table] for k in keys]
    found += [(i, key) for i, name, key in decorators if name in fillers and key]
    return tuple(k for _, k in sorted(found, key=lambda ik: ik[0]))


def registered_function(module: ast.Module, key: str) -> ast.FunctionDef | None:
    """The function registered under ``key`` by a decorator call ``@something("key")`` in ``module``."""
    for s in module.body:
        if isinstance(s, ast.FunctionDef):
            for d in s.decorator_list:
                if isinstance(d, ast.Call) and d.args and _const_str(d.args[0]) == key:
                    return s
    return None

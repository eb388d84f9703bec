"""Where an engine sees our values, and which values: the scopes whose refusals matter to us.

* each declared entry point we pass something to: the function or method, or for a class its ``__init__``,
  ``__post_init__`` and pydantic validators (``field_validator``, ``model_validator``, ``validator``,
  ``root_validator``), through its bases; the class our ``**kwargs`` travel on to (``LLM`` ->
  ``EngineArgs``) likewise. The values: the arguments we pass (known values from ``values``, the keys and
  dispatch values of a dict option from the contract's ``option_keys``);
* the config class of each dict option we pass (``speculative_config`` -> ``SpeculativeConfig``), its
  fields being the option's keys;
* each reader of our export formats, found as the formats check finds it, its config being the export's
  (what ``specdraft export`` writes, or an export directory's) below the reader's scope.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from specdraft.doctor.formats.check import _reader_nodes, _Tables
from specdraft.doctor.formats.reads import ITEM, _lookup, _Reader, _split
from specdraft.doctor.refusals.judge import NOT_CONSTANT, constant
from specdraft.doctor.source.reader import Found, SourceTree, dotted_name, self_attr
from specdraft.engine.contract import Contract, Entry
from specdraft.engine.formats import ConfigReader, ExportFormat

__all__ = ["Scope", "field_defaults", "read_tables", "scopes"]

Path = tuple[str, ...]
_VALIDATORS = {"field_validator", "validator", "model_validator", "root_validator"}


@dataclass
class Scope:
    """One function that sees our values.

    Attributes:
        label: what we pass or write there, for the report (``vllm.LLM``, ``speculators export``).
        module: the module of ``fn``.
        fn: the function.
        roots: names in ``fn`` holding our values, and the path of the value each holds.
        attrs: attribute reads on a root are field reads (``self.method``, ``config.k``).
        passed: the paths we pass or write (a path below one of them is ours too).
        values: our value(s) at a path, when known: several for a key we set differently per mode.
        prefix: the path of the values below what the report names (an option's name, a reader's scope).
        judged: lines of ``if``s whose accepted values the formats check already judges (``not in TABLE``).
        tables: key tables visible in the module (dict literals, registries), for an export reader.
        exact: ``values`` are the values we pass or write, not a sample of them (an export directory's config,
            dispatch values, values given): a condition they provably pass is no risk.
        fixes: what to do when the release refuses our value at a path (from the config's root, ``prefix``
            included): ``ExportFormat.fixes``.
        defaults: the values of the fields we never set, where known (a config class's literal defaults that
            none of its methods reassigns): a check on a feature we leave off is decided by them.
        reader: the export reader (None: an entry point or option); its tables and judged lines are read
            only for a function with a refusal on our values (:func:`read_tables`): they cost a parse of
            every module the reader's module imports from.
        owner: the class whose method ``fn`` is, seen from the class our values become (its methods and
            properties are looked up on it).
        reached: whether the engine reaches ``fn`` with our values (a function called from another scope,
            :mod:`.follow`): True, False (the call sits under a test our values fail), None (one none of them
            decides, ``gate``).
        gate: the test on the way to a call that keeps ``reached`` unknown.
    """

    label: str
    module: str
    fn: ast.FunctionDef | ast.AsyncFunctionDef
    roots: dict[str, Path]
    attrs: bool
    passed: frozenset[Path]
    values: Mapping[Path, tuple[Any, ...]]
    prefix: Path = ()
    judged: frozenset[int] = frozenset()
    tables: dict[str, tuple[str, ...]] = field(default_factory=dict)
    reader: ConfigReader | None = None
    exact: bool = True
    fixes: Mapping[Path, str] = field(default_factory=dict)
    defaults: Mapping[Path, Any] = field(default_factory=dict)
    owner: Found | None = None
    reached: bool | None = True
    gate: str = ""

    def ours(self, path: Path) -> bool:
        """Whether ``path`` is (part of) something we pass."""
        return any(path[: len(p)] == p or p[: len(path)] == path for p in self.passed)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return names[1:] if method and names else names


def _decorator(fn: ast.AST) -> tuple[str, ast.Call | None]:
    """The pydantic validator decorator of ``fn`` (name and call), or ('', None)."""
    for d in getattr(fn, "decorator_list", []):
        call = d if isinstance(d, ast.Call) else None
        name = dotted_name(call.func if call else d).split(".")[-1]
        if name in _VALIDATORS:
            return name, call
    return "", None


def _class_functions(
    tree: SourceTree, cls: Found, names: tuple[str, ...], positional: int
) -> Iterator[tuple[ast.FunctionDef, dict[str, Path], bool, Found]]:
    """(function, roots, attrs) of a class that sees the arguments ``names`` (its first ``positional``
    parameters filled positionally): ``__init__``, ``__post_init__`` and the validators, through its bases."""
    for member in ("__init__", "__post_init__"):
        found = tree.member(cls, member)
        if found is None or found.kind != "function":
            continue
        params = _params(found.node, method=True)
        ours = set(names) | set(params[:positional] if member == "__init__" else ())
        roots = {p: (p,) for p in params if p in ours}
        yield found.node, {**roots, "self": ()}, True, cls
    for c in tree.mro(cls)[0]:
        for s in c.node.body:
            kind, call = _decorator(s)
            if not kind or not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = _params(s, method=True)
            mode = next((k.value.value for k in (call.keywords if call else []) if k.arg == "mode"
                         and isinstance(k.value, ast.Constant)), "")  # fmt: skip
            if kind in ("field_validator", "validator") and call is not None and params:
                fields = [a.value for a in call.args if isinstance(a, ast.Constant) and a.value in names]
                if fields:
                    yield s, {params[0]: (fields[0],)}, False, cls
            elif mode == "after":
                yield s, {params[0] if params else "self": ()}, True, cls
            elif params:  # before / wrap / a root validator: the raw values, a dict
                yield s, {params[0]: ()}, False, cls


def _entry_scopes(
    tree: SourceTree, e: Entry, values: Mapping[str, Any], options: Mapping[str, Mapping[Path, tuple]]
) -> Iterator[Scope]:
    found, _ = tree.resolve(e.symbol)
    if found is None or (not e.keywords and not e.positional):
        return
    known: dict[Path, tuple[Any, ...]] = {(k,): (v,) for k, v in values.items()}
    known |= {(opt, *p): v for opt, vals in options.items() if opt in e.keywords for p, v in vals.items()}
    funcs: list[tuple[str, ast.FunctionDef, dict[str, Path], bool, Found | None]] = []
    if found.kind == "function":
        params = _params(found.node, method=found.owner is not None)
        ours = set(e.keywords) | set(params[: e.positional])
        funcs.append((found.module, found.node, {p: (p,) for p in params if p in ours}, False, None))
    elif found.kind == "class":
        funcs += [(found.module, *f) for f in _class_functions(tree, found, e.keywords, e.positional)]
    target = tree.resolve(e.forwards_kwargs_to)[0] if e.forwards_kwargs_to else None
    if target is not None and target.kind == "class":
        funcs += [(target.module, *f) for f in _class_functions(tree, target, e.keywords, 0)]
    passed = frozenset({(k,) for k in e.keywords})
    for module, fn, roots, attrs, owner in funcs:
        yield Scope(e.name, module, fn, roots, attrs, passed, known, owner=owner)


def _option_values(
    contract: Contract, configs: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, dict[Path, tuple[Any, ...]]]:
    """``{option: {key path: (values...)}}``: every value of a dict option's keys we know, from each source
    that has one: the contract's dispatch values and the values the backends pass (:class:`OptionKeys`), and
    the exports' fields the engine passes on as option values (``ExportFormat.options``: the speculators
    k is ``speculative_config.num_speculative_tokens`` under ``vllm serve EXPORT``), from ``configs`` only
    (a sample's value is not a value we pass)."""
    out: dict[str, dict[Path, tuple[Any, ...]]] = {}

    def add(option: str, key: Path, v: Any) -> None:
        vals = out.setdefault(option, {})
        if v not in vals.get(key, ()):
            vals[key] = (*vals.get(key, ()), v)

    for o in contract.option_keys:
        for key, v in (*o.values, *o.passed):
            add(o.option, _split(key), v)
    for fmt in contract.formats:
        config = (configs or {}).get(fmt.name)
        for field_path, option_path in fmt.options if config is not None else ():
            flat = _flatten(config)
            option, *key = _split(option_path)
            for v in flat.get(_split(field_path), ()):
                if isinstance(v, (str, int, float, bool)):
                    add(option, tuple(key), v)
    return out


def _literal_default(value: ast.expr | None) -> Any:
    """The constant default of a field (``x: int = 3``, ``field(default=None)``, ``Field(default=1 << 12)``)."""
    if isinstance(value, ast.Call) and dotted_name(value.func).split(".")[-1] in ("field", "Field"):
        default = [k.value for k in value.keywords if k.arg == "default"]
        value = default[0] if default else value.args[0] if value.args else None
    return NOT_CONSTANT if value is None else constant(value, {})


def field_defaults(tree: SourceTree, cls: Found, passed: set[str]) -> dict[Path, Any]:
    """``{(field,): default}`` of the fields of config class ``cls`` that we do not set: their value is their
    literal default, unless a method of the class assigns them (``self.x = ...``): then it is not known."""
    chain = tree.mro(cls)[0]
    assigned: set[str] = set()
    for c in chain:
        for n in ast.walk(c.node):
            targets = [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
            targets = n.targets if isinstance(n, ast.Assign) else targets
            assigned |= {a for t in targets if (a := self_attr(t))}
            if isinstance(n, ast.Call) and dotted_name(n.func).endswith("__setattr__") and len(n.args) >= 2:
                assigned |= {
                    a.value for a in n.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)
                }
    out: dict[Path, Any] = {}
    for c in reversed(chain):
        for st in c.node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                name = st.target.id
                v = _literal_default(st.value)
                if name in passed or name in assigned or v is NOT_CONSTANT:
                    out.pop((name,), None)
                else:
                    out[(name,)] = v
    return out


def _option_scopes(
    tree: SourceTree, contract: Contract, configs: Mapping[str, Mapping[str, Any]] | None
) -> Iterator[Scope]:
    options = _option_values(contract, configs)
    for o in contract.option_keys:
        cls = tree.resolve(o.config_class)[0] if o.config_class else None
        if cls is None or cls.kind != "class":
            continue
        top = tuple(dict.fromkeys(k.split(".")[0] for k in o.keys))
        passed = frozenset(_split(k) for k in o.keys)
        defaults = field_defaults(tree, cls, set(top))
        for fn, roots, attrs, owner in _class_functions(tree, cls, top, 0):
            yield Scope(f"{o.option} option", cls.module, fn, roots, attrs, passed,
                        options.get(o.option, {}), prefix=(o.option,), defaults=defaults, owner=owner)  # fmt: skip


def _flatten(config: Any, prefix: Path = ()) -> dict[Path, tuple[Any, ...]]:
    """Every path of a nested config and its values (``[]``: each element of a list, in order, once each)."""
    out: dict[Path, tuple[Any, ...]] = {prefix: (config,)} if prefix else {}
    if isinstance(config, Mapping):
        for k, v in config.items():
            out.update(_flatten(v, (*prefix, str(k))))
    elif isinstance(config, list):
        for item in config:
            for path, vals in _flatten(item, (*prefix, ITEM)).items():
                seen = out.get(path, ())
                out[path] = (*seen, *(v for v in vals if v not in seen))
    return out


def _functions(node: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node
        return
    yield from (n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _judged_lines(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, r: ConfigReader, tables: dict
) -> frozenset[int]:
    """Lines of the ``if v not in TABLE: raise`` checks in ``fn`` whose accepted values the formats check
    reads (:func:`~specdraft.doctor.formats.reads.config_reads` merges reads by path, losing these lines)."""
    reader = _Reader(r.roots, tables, r.model)
    reader.aliases(fn.body)
    for s in fn.body:
        reader.visit(s, frozenset())
    return frozenset(k.line for k in reader.reads if k.allowed is not None)


def _reader_scopes(
    tree: SourceTree, fmt: ExportFormat, r: ConfigReader, config: Mapping[str, Any], exact: bool
) -> Iterator[Scope]:
    nodes, module, _ = _reader_nodes(tree, r, config)
    prefix = _split(fmt.model_scope if r.model else r.scope)
    below = _lookup(config, prefix) if prefix else config
    values = _flatten(below) if isinstance(below, Mapping) else {}
    for node in nodes:
        for fn in _functions(node):
            yield Scope(f"{fmt.name} export", module, fn, dict.fromkeys(r.roots, ()), r.model,
                        frozenset(values), values, prefix, reader=r, exact=exact,
                        fixes={_split(k): v for k, v in fmt.fixes.items()})  # fmt: skip


def read_tables(tree: SourceTree, scope: Scope, cache: dict[str, dict[str, tuple[str, ...]]]) -> None:
    """Fill an export reader scope's key tables and judged lines (``cache``: tables by module)."""
    if scope.reader is None:
        return
    if scope.module not in cache:
        cache[scope.module] = _Tables(tree, scope.module)
    scope.tables = cache[scope.module]
    scope.judged = _judged_lines(scope.fn, scope.reader, scope.tables)


def scopes(
    tree: SourceTree,
    contract: Contract,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    values: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Scope]:
    """Every scope of ``contract`` in ``tree``.

    Args:
        tree: the engine's source.
        contract: what we call and write.
        configs: ``{format name: config}`` of the exports, exact values (default: each format's sample, a
            sample of the values export writes; a format missing from a given mapping is skipped).
        values: ``{entry name: {argument: value}}``: values we pass, when known (the rest is unknown).
    """
    options = _option_values(contract, configs)
    out: list[Scope] = []
    for e in contract.entries:
        out += _entry_scopes(tree, e, (values or {}).get(e.name, {}), options)
    out += _option_scopes(tree, contract, configs)
    for fmt in contract.formats:
        if configs is not None and fmt.name not in configs:
            continue
        config = configs[fmt.name] if configs is not None else fmt.sample
        read_as = fmt.for_config(config)  # a DFlash export is read by its own algorithm's readers
        for r in read_as.readers:
            out += _reader_scopes(tree, read_as, r, config, exact=configs is not None)
    return out

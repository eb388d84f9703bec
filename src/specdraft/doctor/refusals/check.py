"""The refusals a release adds on values we pass or write, against a baseline release (the installed one).

For every scope (:mod:`.scopes`) of both releases, every refusal (:mod:`.collect`) whose condition reads a
value we pass or write is listed with its condition and message. A refusal of the named release that the
baseline has nowhere, or has with another message, is reported with ``file:line`` (relative to the
release's root), the condition, the message and the field or argument it reads: a BREAK when our value
provably meets the condition (:mod:`.judge`), a WARNING naming the field otherwise. A value check the
formats check already judges (``if v not in TABLE: raise``, reported there as a refused value) is listed
as info here, not counted twice.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from specdraft.doctor.check import Problem, shorten
from specdraft.doctor.formats.check import detect_format
from specdraft.doctor.formats.reads import _SAME_VALUE, ITEM, _Reader
from specdraft.doctor.refusals.collect import Refusal, fields_read, refusals_in
from specdraft.doctor.refusals.env import env_gate
from specdraft.doctor.refusals.follow import DEPTH, bind_loops, callees
from specdraft.doctor.refusals.judge import DESCEND, NOT_CONSTANT, Unknown, constant, truth
from specdraft.doctor.refusals.scopes import Scope, read_tables, scopes
from specdraft.doctor.source.reader import SourceTree, dotted_name
from specdraft.engine.contract import Contract

__all__ = ["Found", "new_refusals", "refusal_problems", "refusals"]

FieldPath = tuple[str, ...]
_MAX_CASES = 256  # combinations of our values tried per condition (more: never "passes")


@dataclass(frozen=True)
class Found:
    """A refusal on our values in one release: where, what it reads, and how our values fare."""

    label: str
    refusal: Refusal
    location: str
    fields: tuple[str, ...]
    refused: bool | None  # True: our value meets the condition; False: it does not; None: unknown
    case: str  # our values the verdict is about
    judged: bool  # the formats check judges this value check already
    exact: bool  # our values are the ones we pass or write, not a sample
    fix: str = ""  # what to do when the release refuses our value of this field (ExportFormat.fixes)
    gate: str = ""  # a test on the way that none of our values decides (:func:`_gate`): '' when none
    env: str = ""  # the environment variable turning the refusal on, off here (``VAR=value (not set here)``)

    @property
    def key(self) -> tuple[str, str]:
        return self.refusal.condition, self.refusal.message


def _mutated(module: ast.Module) -> set[str]:
    """Names the module changes after binding them: assigned twice, augmented, stored into, or mutated by
    a method call (``TABLE[k] = v``, ``ALLOWED.add(x)``): their literal value is not what the engine checks."""
    seen: Counter[str] = Counter()
    out: set[str] = set()
    for n in ast.walk(module):
        targets = n.targets if isinstance(n, ast.Assign) else []
        seen.update(t.id for t in targets if isinstance(t, ast.Name))
        out |= {t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        base, _, method = dotted_name(n.func).rpartition(".") if isinstance(n, ast.Call) else ("", "", "")
        if base.isidentifier() and method in _MUTATORS:
            out.add(base)
    return out | {k for k, v in seen.items() if v > 1}


_MUTATORS = ("add", "append", "extend", "update", "setdefault", "insert", "pop", "remove")


def _module_constants(tree: SourceTree, module: str) -> dict[str, Any]:
    """Module-level constants of ``module`` that it never changes, as Python evaluates them (``ALLOWED = ("a",
    "b")``, ``MAX = 1 << 12``, ``BOTH = ALLOWED + ("c",)``)."""
    parsed = tree.parse(module)
    changed = _mutated(parsed) if parsed is not None else set()
    out: dict[str, Any] = {}
    for s in parsed.body if parsed is not None else ():
        targets = (
            s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
        )
        name = targets[0].id if len(targets) == 1 and isinstance(targets[0], ast.Name) else ""
        ok = name and name not in changed and s.value is not None
        value = constant(s.value, out) if ok else NOT_CONSTANT
        if value is not NOT_CONSTANT:
            out[name] = value
    return out


def _shown(scope: Scope, path: FieldPath) -> str:
    """A path as the report names it: ``x[0]`` below a list of one element, ``x[*]`` below a longer one."""
    out = ".".join(scope.prefix)
    for i, k in enumerate(path):
        many = k == ITEM and len(scope.values.get(path[: i + 1], ())) > 1
        out += ("[*]" if many else "[0]") if k == ITEM else f".{k}" if out else k
    return out


def _imports(tree: SourceTree, module: str) -> dict[str, str]:
    """``{name: dotted name}`` of what ``module`` imports (``from huggingface_hub.utils import validate_repo_id``)."""
    parsed = tree.parse(module)
    out: dict[str, str] = {}
    for s in ast.walk(parsed) if parsed is not None else ():
        if isinstance(s, ast.ImportFrom) and s.module and not s.level:
            out.update({a.asname or a.name: f"{s.module}.{a.name}" for a in s.names})
        elif isinstance(s, ast.Import):
            out.update({a.asname: a.name for a in s.names if a.asname})
    return out


def _qualifier(imports: Mapping[str, str]):
    def qualify(name: str) -> str:
        head, dot, rest = name.partition(".")
        return imports[head] + dot + rest if head in imports else name

    return qualify


def _atoms(tests) -> list[ast.expr]:
    """The conjuncts of ``tests``, ``and`` split (``a and (b and c)`` -> a, b, c)."""
    out: list[ast.expr] = []
    for t in tests:
        if isinstance(t, ast.BoolOp) and isinstance(t.op, ast.And):
            out += _atoms(t.values)
        else:
            out.append(t)
    return out


def _gate(refusal: Refusal, scope: Scope, reader: _Reader, consts: Mapping[str, Any], qualify=str) -> str:
    """A test on the way to the refusal that none of our values decides and that selects a path of its own:
    it reads nothing we pass or write (engine state: a local flag such as vLLM 0.33's
    ``using_transformers_mtp``, the target's config), or it asks for a particular value (``x == 'mtp'``,
    ``'ParseAuxMTPModel' in x.architectures``) of a field the engine derives from what we pass (below a key
    we set, not one: ``draft_model_config.architectures``). '' when there is none."""
    for atom in _atoms(refusal.tests):
        if isinstance(atom, ast.Constant) or dotted_name(getattr(atom, "func", None)) == "raises":
            continue
        fields = fields_read([atom], reader)
        if _verdict(replace(refusal, tests=(atom,)), scope, reader, fields, consts, qualify)[0] is not None:
            continue  # decided (a constant, one of our values): not what keeps the verdict unknown
        ours = [p for p in fields if scope.ours(p)]
        if not ours:
            return ast.unparse(atom)
        if any(p in scope.values or p in scope.defaults or p in scope.passed for p in ours):
            continue  # a value of ours, known or not (``k == 7`` on a k we pass may be ours): on our path
        if isinstance(atom, ast.Compare) and len(atom.ops) == 1 and isinstance(atom.ops[0], (ast.Eq, ast.In)):
            sides = (atom.left, atom.comparators[0])
            if any(isinstance(x, ast.Constant) or (isinstance(x, (ast.Tuple, ast.List, ast.Set))
                   and all(isinstance(e, ast.Constant) for e in x.elts)) for x in sides):  # fmt: skip
                return ast.unparse(atom)
    return ""


def _inlined(fn: ast.AST, before: int) -> dict[str, ast.expr]:
    """``{name: value}`` of the locals of ``fn`` assigned once, before line ``before``, from an expression that
    does not read them (``n = len(ids or [])``): the condition reads the value Python computes there."""
    return {name: value for name, (value, line) in _assigned_once(fn).items() if line < before}


@functools.lru_cache(maxsize=4096)
def _assigned_once(fn: ast.AST) -> dict[str, tuple[ast.expr, int]]:
    """``{name: (value, line)}`` of :func:`_inlined`, read once per function."""
    nodes = list(ast.walk(fn))
    names = [n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)]
    stores = Counter([*names, *(n.arg for n in nodes if isinstance(n, ast.arg))])
    out: dict[str, tuple[ast.expr, int]] = {}
    for n in nodes:
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name) and stores[targets[0].id] == 1:
                if not any(isinstance(x, ast.Name) and x.id == targets[0].id for x in ast.walk(n.value)):
                    out[targets[0].id] = (n.value, n.lineno)
    return out


def _unwritten(scope: Scope, path: FieldPath) -> bool:
    """Whether ``path`` is a key of the export's config (or of a dict in it) that the export does not write."""
    if scope.reader is None or scope.attrs or not path or path in scope.values or not scope.values:
        return False
    above = scope.values.get(path[:-1], ()) if len(path) > 1 else ({k[0]: 0 for k in scope.values},)
    return bool(above) and all(isinstance(v, Mapping) and path[-1] not in v for v in above)


def _case_keys(fields: list[FieldPath], scope: Scope) -> list[FieldPath]:
    """The paths whose values the cases range over: each known field, or the list element holding several of
    them (``m["a"]`` and ``m["b"]`` of one element ``m``, never of two)."""
    out: list[FieldPath] = []
    for p in fields:
        element = p[: len(p) - p[::-1].index(ITEM)] if ITEM in p else p
        if element not in scope.values or sum(q[: len(element)] == element for q in fields) < 2:
            element = p
        if element in scope.values and element not in out:
            out.append(element)
    return out


def _below(value: Any, keys: FieldPath, node: ast.AST) -> Any:
    """The field ``keys`` below ``value`` (an element of our list): its value, the default of a ``.get`` of a key
    it lacks, else unknown."""
    for k in keys:
        if isinstance(value, Mapping) and k in value:
            value = value[k]
        else:
            default = _get_default(node) if isinstance(value, Mapping) else None
            return Unknown(k) if default is None else default
    return value


def _get_default(node: ast.AST) -> ast.expr | None:
    """The default of ``d.get(k, default)`` (``None`` when not given); None when ``node`` is no ``.get``."""
    if isinstance(node, ast.Call) and dotted_name(node.func).endswith(".get"):
        return node.args[1] if len(node.args) > 1 else ast.Constant(None)
    return None


def _verdict(refusal: Refusal, scope: Scope, reader: _Reader, fields: list[FieldPath],
             consts: Mapping[str, Any], qualify=str) -> tuple[bool | None, str]:  # fmt: skip
    """Whether our values meet the refusal's condition (any known case does: True), and that case."""
    known = _case_keys(fields, scope)
    cases = list(itertools.islice(itertools.product(*(scope.values[p] for p in known)), _MAX_CASES))
    inline = _inlined(scope.fn, refusal.line)

    def lookup_in(case: dict[FieldPath, Any]):
        budget = [32]  # inlined locals per condition (a cycle of them ends unknown)

        def lookup(node: ast.AST) -> Any:
            if isinstance(node, ast.Name) and node.id in inline and budget[0] > 0:
                budget[0] -= 1
                return inline[node.id]
            if isinstance(node, ast.Call) and dotted_name(node.func) in _SAME_VALUE:
                return DESCEND  # Path(v), str(v): Python applies them to our value
            if isinstance(node, ast.Subscript) and not isinstance(getattr(node.slice, "value", None), str):
                return DESCEND  # ids[0], ids[i]: Python indexes our list
            path = reader.path_of(node, False, frozenset())
            if path is not None:
                if path in case or path in scope.defaults:
                    return case[path] if path in case else scope.defaults[path]
                element = next((e for e in case if path[: len(e)] == e and e[-1] == ITEM), None)
                if element is not None:  # a field of the list element this case is about
                    return _below(case[element], path[len(element) :], node)
                if len(scope.values.get(path, ())) == 1:
                    return scope.values[path][0]
                default = _get_default(node) if _unwritten(scope, path) else None
                return Unknown(".".join(path)) if default is None else default
            name = dotted_name(node)
            if name in consts and not isinstance(consts[name], dict):
                return consts[name]
            if name in reader.tables:  # a local dict literal's keys, a registry's (filled by decorators)
                return reader.tables[name]
            return consts.get(name, DESCEND)

        return lookup

    verdicts = []
    for values in cases:
        case = dict(zip(known, values))
        shown = ", ".join([*(f"{_shown(scope, p)}={v!r}" for p, v in case.items()),
                           *(f"{_shown(scope, p)} not written" for p in fields if _unwritten(scope, p))])  # fmt: skip
        parts = [truth(t, lookup_in(case), qualify) for t in refusal.tests]
        v = False if False in parts else (None if None in parts else True)
        if v:
            return True, shown
        verdicts.append((v, shown))
    every = math.prod(len(scope.values[p]) for p in known) <= _MAX_CASES  # no case left untried
    if verdicts and every and all(v is False for v, _ in verdicts):
        return False, "; ".join(s for _, s in verdicts)
    return None, ""


def _judged(scope: Scope, r: Refusal, reader: _Reader, fields: list[FieldPath], consts: Mapping[str, Any],
            qualify) -> tuple[bool | None, str, str, str]:  # fmt: skip
    """Our values against refusal ``r`` of ``scope``: (refused, case, gate, environment variable as
    ``VAR=value``, '' when none) with the variable as it is here, and the call reaching ``scope``."""
    gate, env = "", ""
    refused, case = _verdict(r, scope, reader, fields, consts, qualify)
    g = (
        None
        if refused
        else env_gate(r, qualify, lambda x: _verdict(x, scope, reader, fields, consts, qualify))
    )
    if g is not None:
        refused, case = g.refused or (False if g.refused_on is False else None), g.case
        if refused is None:  # off here: what it refuses once turned on
            env = f"{g.var}={g.on}" + (f" (it is {g.here!r} here)" if g.here else " (not set here)")
            case = f"{g.var}={g.on}, {g.case}" if g.refused_on else ""
    if scope.reached is False:
        return False, "its call is not reached with our values", "", ""
    if refused and scope.reached is None:
        return None, "", scope.gate, env
    if refused is None and not case and not env:
        gate = scope.gate or _gate(r, scope, reader, consts, qualify)
    return refused, case, gate, env


def _scope_reader(scope: Scope) -> _Reader:
    reader = _Reader([], {}, scope.attrs)
    reader.env = dict(scope.roots)
    reader.aliases(scope.fn.body)
    bind_loops(scope.fn, reader)
    return reader


def refusals(tree: SourceTree, contract: Contract, configs: Mapping[str, Mapping[str, Any]] | None = None,
             values: Mapping[str, Mapping[str, Any]] | None = None) -> list[Found]:  # fmt: skip
    """Every refusal in ``tree`` whose condition reads a value ``contract`` passes or writes (see :func:`scopes`),
    in the scopes' own bodies and in what they call with our values (:mod:`.follow`)."""
    out: dict[tuple[str, str], Found] = {}
    tables: dict[str, dict[str, tuple[str, ...]]] = {}

    @functools.cache
    def module(name: str) -> tuple[dict[str, Any], Any]:  # its constants and how its names qualify
        return _module_constants(tree, name), _qualifier(_imports(tree, name))

    work = [(s, 0) for s in scopes(tree, contract, configs, values)]
    seen: set[tuple] = set()
    while work:
        scope, depth = work.pop(0)
        key = (scope.label, id(scope.fn), tuple(sorted(scope.roots.items())), scope.reached)
        if key in seen:
            continue
        seen.add(key)
        reader = _scope_reader(scope)
        if depth < DEPTH:
            reached = lambda site, s=scope, rd=reader: _verdict(  # noqa: E731
                site, s, rd, fields_read(site.tests, rd), *module(s.module))[0]  # fmt: skip
            work += [(c, depth + 1) for c in callees(tree, scope, reader, reached)]
        ours = [  # what we write, and keys of the export it leaves out (reported when their default is refused)
            (r, [p for p in fields_read(r.tests, reader) if scope.ours(p) or _unwritten(scope, p)])
            for r in refusals_in(scope.fn)
        ]
        ours = [(r, fields) for r, fields in ours if fields]
        if not ours:
            continue
        read_tables(tree, scope, tables)
        reader.tables = {**scope.tables, **reader.tables}  # the module's, then the function's own
        path = tree.module_path(scope.module)
        rel = path.relative_to(tree.root).as_posix() if path is not None else scope.module
        const, qualify = module(scope.module)
        for r, fields in ours:
            where = f"{rel}:{r.line}"
            if (scope.label, where) in out:
                continue
            refused, case, gate, env = _judged(scope, r, reader, fields, const, qualify)
            if not refused and not any(scope.ours(p) for p in fields):
                continue  # on keys we do not write, whose defaults pass or cannot be told: not ours
            keys = [(*scope.prefix, *p) for p in fields]
            fix = next((scope.fixes[k] for k in keys if k in scope.fixes), "")
            out[(scope.label, where)] = Found(scope.label, r, where, tuple(_shown(scope, p) for p in fields),
                                              refused, case, r.test_line in scope.judged, scope.exact, fix,
                                              gate, env)  # fmt: skip
    return list(out.values())


def _problem(found: list[Found], release: str, was: str | None) -> Problem:
    """The report of one new (or reworded) refusal, seen through the scopes in ``found`` (one location)."""
    f = found[0]
    r = f.refusal
    fields = ", ".join(f"`{x}`" for x in dict.fromkeys(y for x in found for y in x.fields))
    labels = ", ".join(dict.fromkeys(x.label for x in found))
    problem = partial(Problem, "refusal", labels, symbol=fields, installed=was or "", location=f.location)
    what = "a new refusal" if was is None else "a refusal worded differently from the installed release's"
    cond = f"`{shorten(r.condition, 300)}`" + ("" if r.kind == "raise" else " (an assert)")
    head = f"{release} has {what}: refused when {cond}, with {shorten(r.message, 300) or 'no message'}; it reads {fields}"
    refused = next((x for x in found if x.refused), None)
    if any(x.judged for x in found):
        return problem(f"{head}; the value check of the export format judges our value", "info")
    if refused is not None:
        fix = refused.fix or "pass or write a value it accepts, or pin a release without this check"
        return problem(
            f"{head}; our value meets the condition: {release} refuses it", passed=refused.case, fix=fix
        )
    passes = next((x for x in found if x.refused is False), None)
    if passes is not None and all(x.refused is False and x.exact for x in found):
        return problem(f"{head}; our value passes it", "info", passed=passes.case)
    env = next((x for x in found if x.env), None)
    if env is not None and passes is None:  # said at default verbosity: setting the variable breaks us
        var = env.env.split(" (")[0]
        then = (f"with it, our value meets the condition ({env.case})" if env.case
                else f"whether our value of {fields} passes then cannot be told statically")  # fmt: skip
        return problem(f"{head}; the environment variable {env.env} turns it on: off today, and {then}", "warning",
                       passed=env.case, fix=f"leave {var.split('=')[0]} unset where {release} runs the draft"
                       + (f", or {env.fix}" if env.fix else ""))  # fmt: skip
    tail = (f"the sample of our value passes it ({passes.case}); other values of {fields} may not" if passes
            else f"whether our value of {fields} passes cannot be told statically")  # fmt: skip
    gated = passes is None and all(x.gate for x in found)
    if gated:  # a path of the engine's own that nothing we pass is known to take: shown with --verbose
        tail += f"; it sits behind `{shorten(f.gate, 200)}`, which none of our values decides"
    return problem(f"{head}; {tail}", "warning", passed=passes.case if passes else "",
                   fix=f.fix or f"check that what you pass as {fields} satisfies it", quiet=gated)  # fmt: skip


def new_refusals(
    new: SourceTree,
    old: SourceTree,
    contract: Contract,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    values: Mapping[str, Mapping[str, Any]] | None = None,
    release: str = "this release",
) -> list[Problem]:
    """The refusals on our values that ``new`` has and ``old`` lacks or words differently, one problem each
    (an info saying so when there are none).

    Args:
        new: the named release's source.
        old: the baseline's source (the installed release).
        contract: what we call, pass and write.
        configs: ``{format name: config}`` of the exports (default: what ``specdraft export`` writes).
        values: ``{entry name: {argument: value}}``: values we pass, where known.
        release: how the report names ``new``.
    """
    before = refusals(old, contract, configs, values)
    old_keys = {f.key for f in before}
    old_messages = {f.refusal.condition: f.refusal.message for f in before}
    by_location: dict[str, list[Found]] = {}
    for f in refusals(new, contract, configs, values):
        if f.key not in old_keys:
            by_location.setdefault(f.location, []).append(f)
    problems = [_problem(fs, release, old_messages.get(fs[0].refusal.condition))
                for fs in by_location.values()]  # fmt: skip
    passed = [p for p in problems if p.severity == "info" and p.message.endswith("; our value passes it")]
    if len(passed) > 1:  # nothing to act on: one line naming them, not one section each
        problems = [p for p in problems if p not in passed]
        where = "; ".join(f"{p.location} ({p.symbol})" for p in passed)
        problems.append(Problem("refusal", contract.engine, f"{release} adds {len(passed)} refusal(s) that every "
                                f"value of ours provably passes: {where}", "info"))  # fmt: skip
    if not problems:
        problems.append(Problem("refusal", contract.engine, f"{release} adds no refusal on the values we pass or "
                                f"write ({len(before)} such refusal(s) in the installed release)", "info"))  # fmt: skip
    return problems


def _export_configs(export: str | None) -> dict[str, Mapping[str, Any]] | None:
    """``{format: config}`` of an export directory's ``config.json`` (None: no export, or unreadable)."""
    if not export:
        return None
    try:
        config = json.loads((Path(export).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the formats check reports an unreadable export
    return {detect_format(config): config} if isinstance(config, dict) else None


def refusal_problems(
    contract: Contract, root: Path, installed: Path | None, export: str | None = None, release: str = ""
) -> list[Problem]:
    """:func:`new_refusals` of the release under ``root`` against the installed one (``--against``).

    Args:
        contract: the contract checked.
        root: the named release's source root.
        installed: the installed release's root (None: not installed, nothing to compare with).
        export: an export directory whose ``config.json`` is checked instead of what export writes.
        release: how the report names the release.
    """
    if installed is None or not (installed / contract.engine).is_dir():
        return [Problem("refusal", contract.engine, f"{contract.engine} is not installed: the refusals "
                        "of the named release are not compared with anything", "info")]  # fmt: skip
    return new_refusals(SourceTree(root), SourceTree(installed), contract, _export_configs(export),
                        release=release or "this release")  # fmt: skip

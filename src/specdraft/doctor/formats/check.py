"""Check an export's ``config.json`` against the engine code that reads it, statically.

For each :class:`~specdraft.engine.formats.ExportFormat` and a config (the format's declared sample, i.e.
what ``specdraft export`` writes, or an export directory's ``config.json``), every declared reader is
found in the installed or ``--against`` source and read with :func:`~specdraft.doctor.formats.reads.config_reads`.
Findings:

* a key the version requires (``d["k"]``) that the config lacks: vLLM refuses the export (break);
* a value outside what the version accepts (``if v not in TABLE: raise``): refused (break);
* a field the export must not write (``absent``), or an architecture missing from the model registry (break);
* a relied-on field the version reads nowhere, or defaults to another value when the config lacks it:
  vLLM silently builds another draft than the one trained (break) -- unless the format declares the
  values the draft is then built with (``unread_ok``) and the config has them (info);
* a weight name the model class drops, aux layer ids it shifts, an architecture its registry (or the
  ``EntryClass`` lists of SGLang's model modules) lacks (:mod:`specdraft.doctor.formats.model`);
* fields the version reads with a default and the export does not write: listed (info);
* a relied-on field a published draft leaves out that the version fills in itself (the format's
  ``engine_defaults``): what it will use, found in its source and compared with what specdraft's readers
  assume (a warning when they agree, a break when the version's function is gone or returns another value).

Model readers (the drafter's class, reading a config object) count plain attribute reads too, and
their ``if config.k != 1: raise`` constraints apply to the model config's values.
"""

from __future__ import annotations

import ast
import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdraft.doctor.check import Problem, model_registry
from specdraft.doctor.formats.model import (
    cpu_kernel_notes,
    entry_classes,
    layer_id_problems,
    safetensors_names,
    weight_problems,
)
from specdraft.doctor.formats.reads import (
    _MISSING,
    ITEM,
    Follow,
    KeyRead,
    _lookup,
    _split,
    config_reads,
    config_writes,
    registered_function,
    registered_keys,
)
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.formats import UNCHECKED_LAYOUTS, ConfigReader, ExportFormat

__all__ = ["check_export_dir", "check_formats", "detect_format", "unchecked_layout"]


def _shown(path: Sequence[str]) -> str:
    return ".".join(path).replace(f".{ITEM}", "[0]")


class _Tables(Mapping):
    """Key tables visible in ``module`` (its own dict literals and registries, and those it imports), each read
    when first asked for: only the modules a reader's constraints name are parsed."""

    def __init__(self, tree: SourceTree, module: str):
        self.tree, self.found = tree, {}
        self.where: dict[str, list[tuple[str, str]]] = {}  # local name -> (home module, name there), in order
        for s in getattr(tree.parse(module), "body", []):
            if isinstance(s, ast.Assign):
                names = [(t.id, module, t.id) for t in s.targets if isinstance(t, ast.Name)]
            elif isinstance(s, ast.ImportFrom):
                home = tree.absolute(module, s.level, s.module)
                names = [(a.asname or a.name, home, a.name) for a in s.names]
            else:
                names = []
            for local, home, name in names:
                self.where.setdefault(local, []).append((home, name))

    def _keys(self, home: str, name: str) -> tuple[str, ...] | None:
        parsed = self.tree.parse(home)
        return registered_keys(parsed, name) if parsed is not None else None

    def __getitem__(self, local: str) -> tuple[str, ...]:
        if local not in self.found:  # the last binding with known keys wins, as the module's own order does
            keys = (self._keys(*w) for w in reversed(self.where.get(local, [])))
            self.found[local] = next((k for k in keys if k is not None), None)
        if self.found[local] is None:
            raise KeyError(local)
        return self.found[local]

    def __iter__(self) -> Iterator[str]:
        return (k for k in self.where if k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _reader_nodes(
    tree: SourceTree, r: ConfigReader, config: Mapping[str, Any]
) -> tuple[list[ast.AST], str, str]:
    """(syntax trees to read, module, why not found) for one declared reader (the first of ``a|b`` found)."""
    if "|" in r.symbol:
        found: tuple[list[ast.AST], str, str] = ([], "", "")
        for alt in r.symbol.split("|"):
            found = _reader_nodes(tree, replace(r, symbol=alt), config)
            if found[0]:
                return found
        return found
    module = r.symbol.split(":", 1)[0]
    if r.registered_by or ":" not in r.symbol:  # the function a key registers, or a whole module
        parsed = tree.parse(module)
        if parsed is None:
            return [], module, f"module {module} not found under {tree.root}"
        key = _lookup(config, _split(r.registered_by)) if r.registered_by else None
        fn = registered_function(parsed, str(key)) if r.registered_by else parsed
        why = f"{module} registers no reader for {r.registered_by}={key!r}" if fn is None else ""
        return ([fn] if fn is not None else []), module, why
    found, why = tree.resolve(r.symbol)
    if found is None or found.kind not in ("function", "class"):
        return [], module, why or f"{r.symbol} is not a function"
    return [found.node], found.module, ""


def _follower(tree: SourceTree) -> Follow:
    """Finds, for the static reader, the function a module calls by name (see :data:`reads.Follow`)."""
    return functools.cache(lambda module, name: _called_function(tree, module, name))


def _called_function(tree: SourceTree, module: str, name: str) -> tuple[ast.FunctionDef, str] | None:
    """The engine's function ``name`` called in ``module``: defined or imported there (at its top, or by a
    ``from X import name`` inside one of its functions); None for anything else (builtins, other packages)."""
    found = tree.lookup(module, name)
    parsed = tree.parse(module) if found is None else None
    for s in ast.walk(parsed) if parsed is not None else ():
        if not isinstance(s, ast.ImportFrom):
            continue
        alias = next((a for a in s.names if (a.asname or a.name) == name), None)
        if alias is not None:
            found = tree.lookup(tree.absolute(module, s.level, s.module), alias.name)
            break
    if found is None or not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return found.node, found.module


def _model_keys(fmt: ExportFormat, config: Mapping[str, Any], writes: set[str]) -> set[str]:
    """Keys of the drafter's model config: the model scope of our config plus what the updaters write."""
    scope = _lookup(config, _split(fmt.model_scope)) if fmt.model_scope else config
    return set(scope if isinstance(scope, Mapping) else ()) | writes


def check_formats(
    formats: Sequence[ExportFormat],
    tree: SourceTree,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    registry: str = "",
    where: str = "",
    weights: Sequence[str] | None = None,
    target_layers: int | None = None,
) -> list[Problem]:
    """Every reason the engine version under ``tree`` would refuse or misread each format's config.

    Args:
        formats: the declared formats.
        tree: the engine's source (installed or ``--against``).
        configs: ``{format name: config}`` to check (default: each format's sample, what export writes).
        registry: the engine's model registry module (for ``architecture`` fields; '' skips that check).
        where: what the config is, for the messages (an export directory).
        weights: the weight names to check (default: each format's declared ``weights``).
        target_layers: the target's decoder layers when known (an engine default's value is then given in ids).
    """
    problems: list[Problem] = []
    for fmt, config in _todo(formats, configs):
        names = fmt.weights if weights is None else weights
        sample = configs is None
        at = where or f"the {fmt.name} config `specdraft export` writes"
        problems += _check_one(fmt, tree, config, registry, at, names, target_layers, sample)
    return problems


def _todo(
    formats: Sequence[ExportFormat], configs: Mapping[str, Mapping[str, Any]] | None
) -> list[tuple[ExportFormat, Mapping[str, Any]]]:
    """(format, config) pairs to check: each given config as the format (or variant) it is, or every declared
    sample, variants' included (what export writes for every draft kind)."""
    if configs is not None:
        return [(f.for_config(configs[f.name]), configs[f.name]) for f in formats if f.name in configs]
    return [(f, f.sample) for fmt in formats for f in (fmt, *fmt.variants.values())]


def _check_one(
    fmt: ExportFormat,
    tree: SourceTree,
    config: Mapping[str, Any],
    registry: str,
    where: str,
    weights: Sequence[str] = (),
    target_layers: int | None = None,
    sample: bool = False,
) -> list[Problem]:
    """``sample``: ``config`` is the declared sample (an optional format's missing readers are then warnings)."""
    subject = f"{fmt.name} export"
    problems = [Problem("format", subject, f"{where} writes `{k}`: {fmt.engine} would not read it as a "
                        f"{fmt.name} export", fix=f"drop `{k}` from the export's config.json")
                for k in fmt.absent if k in config]  # fmt: skip
    reads: list[tuple[ConfigReader, KeyRead, tuple[str, ...], str]] = []
    writes: set[str] = set()
    follow = _follower(tree)
    for r in fmt.readers:
        nodes, module, why = _reader_nodes(tree, r, config)
        if not nodes and sample and fmt.optional and not r.optional:
            return [Problem("format", subject, f"this version has no reader of {fmt.name} exports (no "
                            f"{r.symbol}): {where} does not load in it", "warning", symbol=r.symbol,
                            fix=f"pin a version that reads {fmt.name} exports when you serve one")]  # fmt: skip
        if not nodes:
            problems.append(Problem("format", subject, f"reader {r.symbol} not found: {why}",
                                    "warning" if r.optional else "break", symbol=r.symbol,
                                    fix="find where this version reads the config and update "
                                    "specdraft/engine/formats.py"))  # fmt: skip
            continue
        writes |= {k for n in nodes if r.writes for k in config_writes(n, r.writes)}
        found = config_reads(nodes, r.roots, _Tables(tree, module), r.model, follow, module, r.follow)
        path = tree.module_path(module)
        reads += [(r, kr, (*_split(r.scope), *kr.path), f"{path}:{kr.line}") for kr in found]
    problems += _refusals(subject, where, config, reads, fmt.model_scope, fmt.writer)
    defaulted = _engine_defaults(fmt, tree, subject, where, config, target_layers)
    problems += defaulted
    problems += _misreads(fmt, subject, where, config, reads, _model_keys(fmt, config, writes), defaulted)
    if fmt.architecture and registry:
        problems += _architecture(fmt, subject, where, config, tree, registry)
    problems += weight_problems(fmt, tree, weights, subject, where)
    if fmt.layer_ids is not None:
        problems += layer_id_problems(fmt.layer_ids, tree, config, subject)
    if fmt.cpu_kernels is not None and not sample:
        problems += cpu_kernel_notes(fmt.cpu_kernels, tree, subject)
    if not any(p.severity == "break" for p in problems):
        n = len({full for _, _, full, _ in reads})
        problems.append(Problem("format", subject, f"{where}: {len(fmt.readers)} reader(s) of this version read "
                                f"{n} field path(s) of it; nothing refused or misread", "info"))  # fmt: skip
    return problems


def _refusals(
    subject: str,
    where: str,
    config: Mapping[str, Any],
    reads: list,
    model_scope: str = "",
    writer: str = "export.export_config",
) -> list[Problem]:
    """Required keys the config lacks (non-model readers) and values the engine does not accept."""
    out = []
    for r, kr, full, loc in reads:
        if r.model:
            full = (*_split(model_scope), *kr.path)
            if kr.allowed is None or _lookup(config, full) is _MISSING:
                continue  # a model config has defaults for what we leave out: the relied-on check covers it
        value = _lookup(config, full)
        if kr.kind == "required" and value is _MISSING:
            out.append(Problem("format", subject, f"{where} lacks `{_shown(full)}`, which this version "
                               "requires: loading the export fails", symbol=r.symbol, location=loc,
                               fix=f"write `{_shown(full)}` in {writer}"))  # fmt: skip
        elif kr.allowed is not None and value is not _MISSING and str(value) not in kr.allowed:
            out.append(Problem("format", subject, f"`{_shown(full)}` is {value!r}; this version accepts "
                               f"only {list(kr.allowed)}: loading the export fails", symbol=r.symbol,
                               location=loc, fix="export a value it accepts, or pin a version that "
                               "accepts this one"))  # fmt: skip
    return out


def _engine_defaults(
    fmt: ExportFormat,
    tree: SourceTree,
    subject: str,
    where: str,
    config: Mapping[str, Any],
    target_layers: int | None,
) -> list[Problem]:
    """For each relied-on field the config leaves out (with none of the fields the engine reads first) and the
    format declares an engine default for: what this version uses instead, read from its source (a warning:
    the draft records nothing, the engine and specdraft's readers assume the same), or a break when the
    function is gone or returns another value than specdraft's readers assume."""
    out = []
    for dotted, d in fmt.engine_defaults.items():
        first = [v for k in d.read_first if (v := _lookup(config, _split(k))) not in (_MISSING, None, [])]
        if _lookup(config, _split(dotted)) is not _MISSING or first:
            continue
        symbol, returns, loc, why = _default_returns(tree, d.symbol)
        if returns is None:
            detail = f"its default {d.symbol} is not found ({why})"
        elif returns != d.returns:
            detail = f"its default {symbol} returns {returns}"
        elif not _called(tree, d.called_from, symbol.rsplit(".", 1)[-1]):
            detail = f"nothing in {d.called_from} calls {symbol} any more"
        else:
            detail = ""
        if detail:
            out.append(Problem("format", subject, f"{where} lacks `{dotted}`, which eval and train --init-from "
                               f"fill with {d.meaning}; in this version {detail}: {fmt.engine} may build another "
                               "draft than the one they measure", symbol=d.symbol, location=loc,
                               fix=f"write `{dotted}` into the draft's config.json (the ids it was trained "
                               "with), or pin a version with that default"))  # fmt: skip
            continue
        ids = d.value(target_layers) if d.value and target_layers else None
        value = f"{ids} for the target's {target_layers} layers" if ids else ""
        value = value or "computed from the target's layers"
        out.append(Problem("format", subject, f"{where} lacks `{dotted}`: {fmt.engine} uses {d.meaning} "
                           f"({symbol} returns {returns}: {value}), as eval and train --init-from do; the "
                           "draft records nothing to confirm it was trained on those layers", "warning",
                           symbol=symbol, location=loc,
                           fix=f"nothing, when the draft was trained on those layers; else write `{dotted}` "
                           "(the ids it was trained with) into its config.json"))  # fmt: skip
    return out


def _default_returns(tree: SourceTree, symbols: str) -> tuple[str, str | None, str, str]:
    """(symbol, its return expression, where, why not found) for the first of ``a|b`` found with a return value."""
    why = ""
    for symbol in symbols.split("|"):
        found, why = tree.resolve(symbol)
        if found is None or found.kind != "function":
            continue
        rets = [n.value for n in ast.walk(found.node) if isinstance(n, ast.Return) and n.value is not None]
        if rets:
            return symbol, ast.unparse(rets[-1]), f"{tree.module_path(found.module)}:{rets[-1].lineno}", ""
        why = f"{symbol} returns nothing"
    return symbols, None, "", why or "no such function"


def _called(tree: SourceTree, modules: str, name: str) -> bool:
    """True when one of ``modules`` (``a|b``; '' is no requirement) calls a function or method ``name``."""
    for module in filter(None, modules.split("|")):
        parsed = tree.parse(module)
        calls = (n.func for n in ast.walk(parsed) if isinstance(n, ast.Call)) if parsed is not None else ()
        if any(getattr(f, "attr", getattr(f, "id", None)) == name for f in calls):
            return True
    return not modules


def _misreads(
    fmt: ExportFormat,
    subject: str,
    where: str,
    config: Mapping[str, Any],
    reads: list,
    model_keys: set[str],
    defaulted: Sequence[Problem] = (),
) -> list[Problem]:
    """Relied-on fields read nowhere or defaulted; fields read with a default that we do not write.
    ``defaulted``: the findings of :func:`_engine_defaults` (the fields they name are judged there)."""
    judged = {dotted for dotted in fmt.engine_defaults for p in defaulted if f"lacks `{dotted}`" in p.message}
    out = []
    for dotted in fmt.relies_on:
        if dotted in judged:
            continue
        path = _split(dotted)
        direct = [(r, kr, loc) for r, kr, full, loc in reads if not r.model and full == path]
        model = [(r, kr, loc) for r, kr, full, loc in reads if r.model and kr.path == path[-1:]]
        value = _lookup(config, path)
        if not direct and not (model and path[-1] in model_keys):
            fine = _unread_ok(fmt, config, dotted)
            if fine:
                out.append(Problem("format", subject, f"this version reads `{_shown(path)}` nowhere; it builds the "
                                   f"draft as with {fine}, which {where} has", "info"))  # fmt: skip
                continue
            seen = "; the drafter reads it, but nothing passes it there" if model else ""
            out.append(Problem("format", subject, f"this version reads `{_shown(path)}` nowhere{seen}: the "
                               f"export's value ({value!r}) is ignored and the draft is built differently from "
                               "how it was trained", location=(model or [(None, None, "")])[0][2],
                               fix="find the field's new name or place in this version and write it there "
                               f"({fmt.writer}), or pin a version that reads it"))  # fmt: skip
        elif value is _MISSING and not any(kr.kind == "required" for _, kr, _ in direct):  # else refused
            dflt, at = next(((kr.default, loc) for _, kr, loc in direct + model if kr.default is not None),
                            (None, ""))  # fmt: skip
            out.append(Problem("format", subject, f"{where} lacks `{_shown(path)}`: this version "
                               f"defaults it to {dflt}", location=at, fix="export again with this specdraft"))  # fmt: skip
    defaults = sorted({f"{_shown(full)}={kr.default}" for r, kr, full, _ in reads
                       if not r.model and kr.kind == "default" and kr.default is not None
                       and _lookup(config, full) is _MISSING and ".".join(full) not in judged})  # fmt: skip
    if defaults:
        out.append(Problem("format", subject, f"fields this version reads and {where} leaves out (their "
                           f"defaults apply): {', '.join(defaults)}", "info"))  # fmt: skip
    return out


def _unread_ok(fmt: ExportFormat, config: Mapping[str, Any], dotted: str) -> str:
    """The declared values a version reading ``dotted`` nowhere builds the draft with, when the config has them."""
    want = fmt.unread_ok.get(dotted)
    if not want or any(_lookup(config, _split(k)) != v for k, v in want.items()):
        return ""
    return ", ".join(f"{k}={v!r}" for k, v in want.items())


def _architecture(
    fmt: ExportFormat, subject: str, where: str, config: Mapping[str, Any], tree: SourceTree, registry: str
) -> list[Problem]:
    archs = _lookup(config, _split(fmt.architecture))
    arch = archs[0] if isinstance(archs, list) and archs else None
    table = model_registry(tree, registry) or entry_classes(tree, registry)
    if arch is None or (table and arch not in table):
        return [Problem("format", subject, f"{where} names architecture {arch!r}, which this version's model "
                        "registry does not have: it cannot load the draft", location=str(tree.module_path(registry)),
                        fix="export the speculators format for this version")]  # fmt: skip
    return []


def detect_format(config: Mapping[str, Any]) -> str:
    """The format of an export's config: ``speculators`` (it has ``speculators_config``; the format declares
    the variant of each algorithm), ``dflash-sglang`` (a DFlash draft in SGLang's layout) or ``eagle3``."""
    if "speculators_config" in config:
        return "speculators"
    archs = config.get("architectures")
    return "dflash-sglang" if isinstance(archs, list) and archs[:1] == ["DFlashDraftModel"] else "eagle3"


def unchecked_layout(name: str, where: str, engine: str) -> Problem:
    """A warning for an export in one of the ``UNCHECKED_LAYOUTS`` that ``engine`` declares no reader of:
    nothing of it is checked against ``engine``."""
    return Problem("format", f"{name} export", f"{where} is {UNCHECKED_LAYOUTS[name]}: doctor does not check "
                   f"it against {engine}'s readers", "warning", fix="export --format speculators to check (and serve) "
                   "the draft with vLLM; for SGLang, check it with doctor --against sglang==X --export "
                   f"{where}")  # fmt: skip


def _verifier_layers(config: Mapping[str, Any]) -> int | None:
    """The decoder layers of the target a draft's config names (speculators' verifier), when it is a local
    model directory; else None."""
    name = _lookup(config, ("speculators_config", "verifier", "name_or_path"))
    try:
        target = json.loads((Path(str(name)).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = target.get("num_hidden_layers") or (target.get("text_config") or {}).get("num_hidden_layers")
    return n if isinstance(n, int) and n > 0 else None


def check_export_dir(
    formats: Sequence[ExportFormat], tree: SourceTree, export_dir: Path | str, registry: str = ""
) -> list[Problem]:
    """:func:`check_formats` for an export directory's ``config.json``, plus its weights file (for a
    directory of exports, such as the quickstart's ``export/``, each export in it).

    Raises:
        FileNotFoundError: ``export_dir`` has no ``config.json`` (point ``--export`` at a `specdraft export` output).
    """
    d = Path(export_dir).expanduser()
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        subs = sorted(x for x in d.iterdir() if (x / "config.json").is_file()) if d.is_dir() else []
        if subs:  # a directory of exports (the quickstart's export/: speculators/ and eagle3/): each of them
            return [p for x in subs for p in check_export_dir(formats, tree, x, registry)]
        raise FileNotFoundError(f"{cfg_path} not found: point --export at the output of `specdraft export`")
    config = json.loads(cfg_path.read_text())
    name = detect_format(config)
    files = sorted(d.glob("*.safetensors"))
    names = safetensors_names(files) if files else None
    holder = next((f for f in formats if f.named(name) is not None), None)
    if name in UNCHECKED_LAYOUTS and holder is None:
        return [unchecked_layout(name, str(d), formats[0].engine if formats else "the engine")]
    # a layout declared as a format's variant (SGLang's DFlash layout, of its eagle3 format) is checked as that
    # format's config: the format's variant_by field picks the variant
    key = holder.name if holder is not None else name
    problems = check_formats(formats, tree, {key: config}, registry=registry, where=str(d), weights=names,
                             target_layers=_verifier_layers(config))  # fmt: skip
    if not files:
        problems.append(Problem("format", f"{name} export", f"{d} has no *.safetensors weights",
                                fix="export again: `specdraft export CHECKPOINT OUT`"))  # fmt: skip
    return problems

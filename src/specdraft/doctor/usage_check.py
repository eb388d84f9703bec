"""Check the names and option keys the backends rely on (:mod:`specdraft.engine.usage`) against engine source.

Statically, no import: each metric name and ``VLLM_*`` environment variable must appear as a string in the
engine modules declared for its kind; each top-level key of a dict-valued option (``speculative_config``,
``kv_transfer_config``) must be a field of the engine's config class; each dispatch value (a method, a
connector name, a role) must appear as a string in its declared modules. Call conventions are behaviour,
out of static reach: doctor lists them as checked at run time (the hooks fail loudly when they change).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from specdraft.doctor.check import Problem
from specdraft.doctor.source.reader import SourceTree, signature

__all__ = ["check_usage", "convention_lines"]


def _strings(tree: SourceTree, modules: Sequence[str]) -> tuple[set[str], list[str]]:
    """String constants of ``modules`` (all parsed), and the modules not found."""
    parsed = [(m, tree.parse(m)) for m in modules]
    nodes = [n for _, p in parsed if p is not None for n in ast.walk(p)]
    strings = {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return strings, [m for m, p in parsed if p is None]


def _names(contract, tree: SourceTree) -> list[Problem]:
    """Metric names and environment variables that the engine's declared modules do not define."""
    env_vars = [v for v in contract.env_vars if v.startswith("VLLM_")]
    declared = {"metric": contract.metrics, "env var": env_vars}
    problems = []
    for kind, modules in contract.name_sources:
        strings, missing = _strings(tree, modules)
        if missing and len(missing) == len(modules):
            problems.append(Problem("names", kind, f"none of {list(modules)} found: {kind}s not checked",
                                    "warning", fix="update name_sources in specdraft/engine/usage.py"))  # fmt: skip
            continue
        gone = [n for n in declared.get(kind, ()) if n not in strings]
        for n in [n for n in gone if n in contract.optional_env_vars]:
            gone.remove(n)
            problems.append(Problem("names", kind, f"{n} is not read by this release: "
                                    f"{contract.optional_env_vars[n]}", "warning"))  # fmt: skip
        if gone:
            problems.append(Problem("names", kind, f"{kind}(s) {gone} no longer defined in {list(modules)}",
                                    location=str(tree.module_path(modules[0]) or modules[0]),
                                    fix=f"find the new {kind} name and update specdraft/engine/usage.py "
                                    "with the code that uses it"))  # fmt: skip
    return problems


def _options(contract, tree: SourceTree) -> list[Problem]:
    """Option keys that are not fields of the engine's config class; dispatch values it no longer knows."""
    problems = []
    for o in contract.option_keys:
        if o.config_class:
            found, why = tree.resolve(o.config_class)
            sig = signature(tree, found) if found is not None else None
            if sig is None:
                problems.append(Problem("options", o.option, f"config class not readable: {why}", "warning",
                                        symbol=o.config_class))  # fmt: skip
            else:
                top = sorted({k.split(".")[0] for k in o.keys} - sig.names())
                if top:
                    problems.append(Problem("options", o.option, f"key(s) {top} are not fields of "
                                            f"{o.config_class.split(':')[-1]}: the engine refuses the option",
                                            symbol=o.config_class, installed=sig.text, location=sig.location,
                                            fix=f"adapt {o.used_by} and specdraft/engine/usage.py"))  # fmt: skip
        if o.value_modules:
            strings, _ = _strings(tree, o.value_modules)
            for required in (True, False):
                gone = [
                    f"{k}={v!r}" for k, v in o.values if v not in strings and (v in o.optional) != required
                ]
                if gone:
                    problems.append(Problem("options", o.option, f"value(s) {gone} appear nowhere in "
                                            f"{list(o.value_modules)}: renamed or removed?",
                                            "break" if required else "warning",
                                            fix=f"adapt {o.used_by} and specdraft/engine/usage.py"))  # fmt: skip
    return problems


def check_usage(contract, tree: SourceTree) -> list[Problem]:
    """Every declared name and option key of ``contract`` that the engine under ``tree`` lacks."""
    return _names(contract, tree) + _options(contract, tree)


def convention_lines(contract) -> list[str]:
    """The call conventions, for the report's "checked at run time" list."""
    return [f"{c.name}: {c.call}" for c in contract.conventions]

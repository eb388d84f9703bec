"""Everything the vLLM backends rely on is declared in the contract, and nothing declared goes unused.

The backends (capture/vllm.py, eval/*.py, engine/vllm_rpc.py) are read with ast: the hooks' reads of the
arguments and return values vLLM passes them (call conventions), the keys of speculative_config and
kv_transfer_config and the values vLLM dispatches on, metric names, environment variables, the keywords and
attributes of every contract entry, and the keys read from what an entry returns.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from specdraft.doctor.formats.reads import ITEM, config_reads
from specdraft.engine import contract as engines

SRC = Path(engines.__file__).parents[1]
_MACHINERY = {"contract.py", "usage.py", "formats.py"}
#: capture/vllm.py, eval/*.py, engine/vllm_rpc.py, and any other module that calls an engine through the contract
BACKENDS = sorted(
    {SRC / "capture" / "vllm.py", SRC / "engine" / "vllm_rpc.py", *(SRC / "eval").glob("*.py")}
    | {p for p in SRC.rglob("*.py") if "engines." in p.read_text() and not (
        p.parent.name == "engine" and p.name in _MACHINERY) and "doctor" not in p.relative_to(SRC).parts}
)  # fmt: skip
C = engines.VLLM_CONTRACT
_ENGINE_FNS = ("call", "call_method", "read", "get", "entry")
_NAME_ARG = {"call": 0, "call_method": 1, "read": 1, "get": 0, "entry": 0}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts)


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualname, node) of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _const(node):
    return node.value if isinstance(node, ast.Constant) else None


def _parsed():
    return {p: ast.parse(p.read_text()) for p in BACKENDS}


PARSED = _parsed()


# ---------------------------------------------------------------------------------------------
# call conventions
# ---------------------------------------------------------------------------------------------
def _args_index(node: ast.AST) -> int | None:
    """``i`` of the first ``args[i]`` under ``node``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "args":
            return _const(n.slice)
    return None


def _hook_reads(fn: ast.FunctionDef) -> tuple[set, set]:
    """((name or None, position or None) of argument reads, positions of return-value reads) of one hook."""
    args, returns = set(), set()
    tuples = {t.id: [_const(e) for e in n.value.elts] for n in ast.walk(fn) if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Tuple) for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get":
            if isinstance(n.func.value, ast.Name) and n.func.value.id == "kwargs" and n.args:
                name = _const(n.args[0])
                pos = _args_index(n.args[1]) if len(n.args) > 1 else None
                if name is not None:
                    args.add((name, pos))
                elif isinstance(n.args[0], ast.Name):  # for i, n in enumerate(NAMES): kwargs.get(n, args[i])
                    for names in tuples.values():
                        args |= {(nm, i) for i, nm in enumerate(names)}
        if (
            isinstance(n, ast.Subscript)
            and isinstance(n.value, ast.Name)
            and isinstance(_const(n.slice), int)
        ):
            if n.value.id == "args":
                args.add((None, _const(n.slice)))
            elif n.value.id == "out":
                returns.add(_const(n.slice))
    return args, returns


def _hooks() -> dict[str, tuple[set, set]]:
    """Every function of the backends that reads what vLLM passes a hooked module (``args``) or returns (``out``)."""
    out = {}
    for path, tree in PARSED.items():
        for qual, fn in _functions(tree):
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            if "args" in params or params == ["out"]:  # a hook, or a helper reading a module's output
                out[f"{_module(path)}:{qual}"] = _hook_reads(fn)
    return out


def test_hooks_read_only_declared_call_conventions():
    declared = {h: conv for conv in C.conventions for h in conv.hooks}
    hooks = _hooks()
    assert set(hooks) == set(declared), (
        f"undeclared hooks {sorted(set(hooks) - set(declared))}; declared but not found "
        f"{sorted(set(declared) - set(hooks))} (engine/usage.py VLLM_CONVENTIONS)"
    )
    used = defaultdict(set)
    for hook, (args, returns) in hooks.items():
        conv = declared[hook]
        by_name, by_pos = dict(conv.arguments), {p: n for n, p in conv.arguments}
        for name, pos in args:
            assert (name is None or by_name.get(name) == pos or (pos is None and name in by_name)) and (
                pos is None or pos in by_pos
            ), f"{hook} reads argument {name!r} at {pos} of {conv.name}, declared {conv.arguments}"
            used[conv.name].add(by_pos[pos] if pos is not None else name)
        assert returns <= {p for _, p in conv.returns}, (hook, returns, conv.returns)
        used[conv.name] |= {f"return {p}" for p in returns}
    for conv in C.conventions:
        wanted = {n for n, _ in conv.arguments} | {f"return {p}" for _, p in conv.returns}
        assert wanted <= used[conv.name], (
            f"{conv.name}: declared but read by no hook: {wanted - used[conv.name]}"
        )


# ---------------------------------------------------------------------------------------------
# option keys and dispatch values, metric names, environment variables
# ---------------------------------------------------------------------------------------------
def _paths(d: ast.Dict, prefix: str = "") -> tuple[set, set]:
    """Dotted key paths of a dict literal, and ``(path, value)`` of its string values."""
    keys, values = set(), set()
    for k, v in zip(d.keys, d.values):
        if _const(k) is None:
            continue
        path = f"{prefix}{k.value}"
        keys.add(path)
        if isinstance(_const(v), str):
            values.add((path, v.value))
        if isinstance(v, ast.Dict):
            sub_k, sub_v = _paths(v, f"{path}.")
            keys, values = keys | sub_k, values | sub_v
    return keys, values


def _option_dicts() -> dict[str, tuple[set, set]]:
    """``{option: (key paths, (key, value))}`` of every dict literal given to a dict-valued engine option."""
    options = {k for e in C.entries for k in e.keywords}
    found: dict[str, tuple[set, set]] = defaultdict(lambda: (set(), set()))
    for tree in PARSED.values():
        for n in ast.walk(tree):
            pairs = []
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict):
                pairs = [(_const(t.slice), n.value) for t in n.targets if isinstance(t, ast.Subscript)]
            elif isinstance(n, ast.Call):
                pairs = [(k.arg, k.value) for k in n.keywords if isinstance(k.value, ast.Dict)]
            for option, d in pairs:
                if option in options:
                    k, v = _paths(d)
                    found[option][0].update(k)
                    found[option][1].update(v)
    return found


def test_option_keys_and_dispatch_values_are_declared_and_used():
    found = _option_dicts()
    declared = {o.option: o for o in C.option_keys}
    assert set(found) == set(declared), (set(found), set(declared))
    for option, (keys, values) in found.items():
        o = declared[option]
        assert keys == set(o.keys), f"{option}: undeclared {keys - set(o.keys)}, unused {set(o.keys) - keys}"
        dispatch = {k for k, _ in o.values}
        seen = {(k, v) for k, v in values if k in dispatch}
        assert seen == set(o.values), f"{option}: values used {seen}, declared {o.values}"


def _strings(prefix: str) -> set[str]:
    return {n.value for t in PARSED.values() for n in ast.walk(t)
            if isinstance(_const(n), str) and n.value.startswith(prefix)}  # fmt: skip


def test_metric_names_are_declared_and_used():
    assert _strings("vllm:") == set(C.metrics)


def _tuples(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    """Module-level names bound to a tuple of strings (``TORCHRUN_ENV = ("RANK", ...)``)."""
    return {t.id: tuple(e.value for e in n.value.elts) for n in getattr(tree, "body", []) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Tuple) and all(isinstance(_const(e), str) for e in n.value.elts)
            for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip


def _env_vars() -> set[str]:
    """Names used with os.environ / os.getenv: constants, locals bound to constants, or a loop variable over a
    module-level tuple of strings (each of its names)."""
    out = set()
    for tree in PARSED.values():
        tuples = _tuples(tree)
        for _, fn in _functions(tree):
            consts = {t.id: n.value.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
                      and isinstance(_const(n.value), str) for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip
            loops = {g.target.id: tuples[g.iter.id] for g in ast.walk(fn) if isinstance(g, (ast.comprehension, ast.For))
                     and isinstance(g.target, ast.Name) and isinstance(g.iter, ast.Name) and g.iter.id in tuples}  # fmt: skip
            for n in ast.walk(fn):
                if isinstance(n, ast.Call) and ast.unparse(n.func) == "os.environ.pop" and n.args:
                    if getattr(n.args[0], "id", "") in loops:
                        out.update(loops[n.args[0].id])
                        continue
                arg = None
                if isinstance(n, ast.Subscript) and ast.unparse(n.value) == "os.environ":
                    arg = n.slice
                elif isinstance(n, ast.Call) and ast.unparse(n.func) in (
                    "os.environ.get", "os.environ.pop", "os.environ.setdefault", "os.getenv"
                ):  # fmt: skip
                    arg = n.args[0] if n.args else None
                if arg is not None:
                    out.add(_const(arg) if _const(arg) else consts.get(getattr(arg, "id", ""), "<dynamic>"))
    return out


def test_environment_variables_are_declared_and_used():
    """Every variable we read or set is the engine's and declared in the contract (doctor checks each against
    the release), except torchrun's, which `outside_torchrun` keeps away from an engine built in a rank."""
    from specdraft.engine.vllm_rpc import TORCHRUN_ENV

    assert _env_vars() == set(C.env_vars) | set(TORCHRUN_ENV)
    assert not set(C.env_vars) & set(TORCHRUN_ENV)


# ---------------------------------------------------------------------------------------------
# entries: keywords (through **kw dicts too), attributes, keys read from what they return
# ---------------------------------------------------------------------------------------------
def _kw_dicts(tree: ast.AST) -> dict[str, set[str]]:
    """Keys of every dict a module builds under one name (``kw = dict(a=...)``, ``kw["b"] = ...``)."""
    keys: dict[str, set[str]] = defaultdict(set)
    for n in ast.walk(tree):
        target, value = (n.targets[0], n.value) if isinstance(n, ast.Assign) else (None, None)
        if isinstance(n, ast.AnnAssign):
            target, value = n.target, n.value
        if isinstance(target, ast.Name) and isinstance(value, ast.Call) and ast.unparse(value.func) == "dict":
            keys[target.id] |= {k.arg for k in value.keywords if k.arg}
        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and _const(target.slice):
            keys[target.value.id].add(target.slice.value)
    return keys


def _entry_uses():
    """(entry name, function, keywords, attribute, node, enclosing function) of every engines.<fn> call."""
    for path in sorted(SRC.rglob("*.py")):
        if path.parent.name == "engine" and path.name == "contract.py":
            continue
        tree = ast.parse(path.read_text())
        kw_dicts = _kw_dicts(tree)
        for _, fn in _functions(tree):
            for n in ast.walk(fn):
                if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                    continue
                if not (isinstance(n.func.value, ast.Name) and n.func.value.id == "engines"):
                    continue
                what = n.func.attr
                if (
                    what not in _NAME_ARG
                    or len(n.args) <= _NAME_ARG[what]
                    or _const(n.args[_NAME_ARG[what]]) is None
                ):
                    continue
                kws = {k.arg for k in n.keywords if k.arg and k.arg != "user_kwargs"}
                for k in n.keywords:
                    if k.arg is None and isinstance(k.value, ast.Name):
                        kws |= kw_dicts.get(k.value.id, set())
                attr = _const(n.args[2]) if what == "read" and len(n.args) > 2 else None
                yield n.args[_NAME_ARG[what]].value, what, kws, attr, n, fn


def _returned_keys(node: ast.Call, fn: ast.AST, attr: str | None) -> set[str]:
    """Key paths read from what ``node`` returned, through the names it is bound to in ``fn``."""
    names = {ast.unparse(t) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
             if node in ast.walk(n.value)}  # fmt: skip
    if not names:
        return set()
    prefix = f"{attr}." if attr else ""
    reads = config_reads([fn], tuple(names))
    return {prefix + ".".join(p for p in r.path if p != ITEM) for r in reads if r.via == "item"}


def test_every_declared_entry_keyword_attribute_and_key_is_used():
    """The other direction of test_engines: what the contract declares, some code uses."""
    used_kw, used_attr, used_keys, used = defaultdict(set), defaultdict(set), defaultdict(set), set()
    for name, _what, kws, attr, node, fn in _entry_uses():
        used.add(name)
        used_kw[name] |= kws
        if attr:
            used_attr[name].add(attr)
        used_keys[name] |= _returned_keys(node, fn, attr)
    for c in engines.CONTRACTS.values():
        for e in c.entries:
            assert e.name in used, f"{e.name} is declared in engine/contract.py but never used: remove it"
            assert set(e.keywords) == used_kw[e.name], (
                f"{e.name}: keywords unused {set(e.keywords) - used_kw[e.name]}, "
                f"undeclared {used_kw[e.name] - set(e.keywords)}"
            )
            assert set(e.attributes) == used_attr[e.name], (e.name, e.attributes, used_attr[e.name])
            assert set(e.keys) == used_keys[e.name], (e.name, e.keys, used_keys[e.name])


@pytest.mark.parametrize("name", ["model forward", "decoder layer", "EAGLE-3 drafter forward"])
def test_conventions_name_their_calls(name):
    conv = next(c for c in C.conventions if c.name == name)
    assert conv.hooks and all(f"{n}" in conv.call or n in ("hidden", "normed", "prenorm")
                              for n, _ in conv.arguments + conv.returns)  # fmt: skip


_UNDECLARED = """
import os
def hook(module, args, kwargs):
    return kwargs.get("inputs_embeds", args[3] if len(args) > 3 else None)
def build(kw):
    kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return "vllm:spec_decode_num_emitted_tokens"
"""


@pytest.mark.parametrize(
    "check",
    [
        test_hooks_read_only_declared_call_conventions,
        test_option_keys_and_dispatch_values_are_declared_and_used,
        test_metric_names_are_declared_and_used,
        test_environment_variables_are_declared_and_used,
    ],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_an_undeclared_use_fails(check, monkeypatch):
    """A hook reading another argument, a new option key or method, metric or variable: each check fails."""
    monkeypatch.setitem(PARSED, SRC / "eval" / "undeclared.py", ast.parse(_UNDECLARED))
    with pytest.raises(AssertionError):
        check()

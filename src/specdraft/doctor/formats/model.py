"""What an engine's draft model class does with an export beyond its config keys, read with :mod:`ast`.

* :func:`entry_classes`: the model classes a package's modules list in ``EntryClass`` (SGLang's registry
  imports every module of ``sglang.srt.models`` and collects them).
* :func:`weight_problems`: every weight name the export writes must reach a module of the model class:
  ``load_weights`` handles it by name (``if "d2t" in name``), maps it (``{"midlayer": "layers.0"}``), or
  the class (or its ``self.model``) has a module of that name. A name none of them takes is skipped by
  the loader without a word: the draft runs with that module randomly initialised (break).
* :func:`layer_id_problems`: the function receiving our aux layer ids must not shift them
  (``[val + 1 for val in layer_ids]`` reads id k as the state entering layer k+1; ours enter layer k).
* :func:`cpu_kernel_notes`: on a CPU build of the engine, whether the Triton kernels an algorithm's drafting
  launches have the build's C++ stand-ins (without one, the export cannot draft there).
* :func:`safetensors_names`: the tensor names of an export's ``*.safetensors`` (header only, no torch).

Only the first component of a weight name is checked (``midlayer`` of ``midlayer.self_attn.q_proj``):
the fusing of q/k/v and gate/up inside a layer is the engine's own mapping and stays out of reach.
"""

from __future__ import annotations

import ast
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specdraft.doctor.check import Problem
from specdraft.doctor.formats.reads import _lookup, _split
from specdraft.doctor.source.reader import Found, SourceTree, attribute_class, self_stores
from specdraft.engine.formats import CpuKernels, ExportFormat, LayerIds

__all__ = ["cpu_kernel_notes", "entry_classes", "layer_id_problems", "safetensors_names", "weight_problems"]


def entry_classes(tree: SourceTree, package: str) -> dict[str, str]:
    """``{class name: module}`` of every ``EntryClass = X`` / ``EntryClass = [X, Y]`` in ``package``'s modules."""
    pkg = tree.module_path(package)
    if pkg is None or pkg.name != "__init__.py":
        return {}
    out: dict[str, str] = {}
    for f in sorted(pkg.parent.glob("*.py")):
        module = f"{package}.{f.stem}"
        parsed = tree.parse(module)
        for s in parsed.body if parsed is not None else []:
            if isinstance(s, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "EntryClass" for t in s.targets
            ):
                elts = s.value.elts if isinstance(s.value, (ast.List, ast.Tuple)) else [s.value]
                for e in elts:
                    if isinstance(e, ast.Name):
                        out.setdefault(e.id, module)
    return out


def _loader_names(fn: ast.AST) -> tuple[set[str], dict[str, str]]:
    """(names ``load_weights`` handles itself: ``"x" in name`` / ``name.startswith("x")``, its renaming maps)."""
    handled: set[str] = set()
    renames: dict[str, str] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.In) and isinstance(n.left, ast.Constant):
            if isinstance(n.left.value, str) and isinstance(n.comparators[0], ast.Name):
                handled.add(n.left.value)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "startswith":
            handled |= {a.value for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        elif isinstance(n, ast.Dict) and n.keys and all(isinstance(k, ast.Constant) for k in n.keys):
            pairs = zip(n.keys, n.values)
            renames |= {
                k.value: v.value for k, v in pairs if isinstance(v, ast.Constant) and isinstance(v.value, str)
            }
    return handled, renames


def _modules_of(tree: SourceTree, cls: Found) -> set[str]:
    """Names the loader finds a parameter under: the class's own ``self.*`` and its ``self.model``'s."""
    names = self_stores(cls.node)
    inner = attribute_class(tree, cls, "model")
    if inner is not None and isinstance(inner.node, ast.ClassDef):
        names |= self_stores(inner.node)
    return names


def weight_problems(
    fmt: ExportFormat, tree: SourceTree, names: Iterable[str], subject: str, where: str
) -> list[Problem]:
    """Every weight name in ``names`` the version's ``fmt.weight_loader`` drops (see the module docstring)."""
    if not fmt.weight_loader:
        return []
    found, why = tree.resolve(fmt.weight_loader)
    if found is None or found.kind != "class":
        return [Problem("format", subject, f"model class {fmt.weight_loader} not found: {why}",
                        symbol=fmt.weight_loader, fix="find the class this version loads the draft with "
                        "and update specdraft/engine/formats.py")]  # fmt: skip
    loader = next(
        (s for s in found.node.body if isinstance(s, ast.FunctionDef) and s.name == "load_weights"), None
    )
    handled, renames = _loader_names(loader) if loader is not None else (set(), {})
    modules = _modules_of(tree, found)
    dropped: dict[str, list[str]] = {}
    for name in names:
        head = name.split(".", 1)[0]
        if any(h == head or h in name for h in handled):
            continue
        head = next((v for k, v in renames.items() if k in name), head).split(".", 1)[0]
        if head not in modules:
            dropped.setdefault(name.split(".", 1)[0], []).append(name)
    loc = f"{found.path}:{getattr(loader or found.node, 'lineno', 1)}"
    return [Problem("format", subject, f"{len(v)} weight(s) of {where} under `{k}.` ({v[0]}, ...) that "
                    f"{fmt.weight_loader.split(':')[-1]}.load_weights of this version neither handles nor has a "
                    f"module `{k}` for: it skips them silently and the draft runs with that part untrained",
                    symbol=fmt.weight_loader, location=loc, fix="write them under this version's module names "
                    "(export.export_state), or pin a version that loads these")  # fmt: skip
            for k, v in dropped.items()]  # fmt: skip


def _shift(fn: ast.AST, param: str) -> tuple[int, int]:
    """(offset, line) of a ``[v + K for v in param]`` in ``fn``; (0, 0) when the ids are taken as they are."""
    for n in ast.walk(fn):
        if not isinstance(n, (ast.ListComp, ast.GeneratorExp, ast.SetComp)) or len(n.generators) != 1:
            continue
        gen = n.generators[0]
        if not (isinstance(gen.iter, ast.Name) and gen.iter.id == param and isinstance(gen.target, ast.Name)):
            continue
        e = n.elt
        if (
            isinstance(e, ast.BinOp)
            and isinstance(e.op, (ast.Add, ast.Sub))
            and isinstance(e.right, ast.Constant)
        ):
            if isinstance(e.left, ast.Name) and e.left.id == gen.target.id and isinstance(e.right.value, int):
                return (e.right.value if isinstance(e.op, ast.Add) else -e.right.value), n.lineno
    return 0, 0


def layer_id_problems(
    spec: LayerIds, tree: SourceTree, config: Mapping[str, Any], subject: str
) -> list[Problem]:
    """A break when the layers the version captures for ``config``'s ids are not those the draft was trained on."""
    ids = _lookup(config, _split(spec.field))
    if not isinstance(ids, list) or not ids:
        return []  # absent: the engine's default layers apply (the relied-on check reports that)
    trained = _lookup(config, _split(spec.trained)) if spec.trained else None
    trained = trained if isinstance(trained, list) and trained else [i - spec.written for i in ids]
    found, why = tree.resolve(spec.symbol)
    if found is None or found.kind != "function":
        return [Problem("format", subject, f"{spec.symbol} not found ({why}): where this version turns "
                        f"`{spec.field}` into capture points is unknown", "warning", symbol=spec.symbol,
                        fix="find it and update LayerIds in specdraft/engine/formats.py")]  # fmt: skip
    shift, line = _shift(found.node, spec.param)
    seen = [i + shift for i in ids]
    if seen == list(trained):
        return []
    return [Problem("format", subject, f"this version captures, for `{spec.field}` = {ids}, the hidden states "
                    f"entering layers {seen} (id k -> layer k{shift:+d}); the draft was trained on those entering "
                    f"layers {list(trained)}: it is fed other layers than it learnt from",
                    symbol=spec.symbol, location=f"{found.path}:{line or getattr(found.node, 'lineno', 1)}",
                    fix=f"write `{spec.field}` = {[k - shift for k in trained]} for this engine (export.export_config: "
                    f"[k{-shift:+d} for k in ids])")]  # fmt: skip


def cpu_kernel_notes(spec: CpuKernels, tree: SourceTree, subject: str) -> list[Problem]:
    """Info, on a CPU build (its ``*.dist-info`` under ``tree``), on whether ``spec``'s kernels can run there:
    each ``@triton.jit`` kernel found must be named in the build's stand-in registry ``spec.overrides``."""
    dist = spec.dist.replace("-", "_")
    if not any(tree.root.glob(f"{dist}-*.dist-info")):
        return []  # not a CPU build: its Triton kernels run as they are
    path = tree.module_path(spec.overrides)
    text = path.read_text(errors="replace") if path is not None else ""
    found = [
        (k, f) for k in spec.kernels for f in [tree.resolve(k)[0]] if f is not None and f.kind == "function"
    ]
    missing = [(k, f) for k, f in found if k.replace(":", ".") not in text]
    if not found:
        return []  # the kernels moved: nothing known
    if missing:
        names = ", ".join(k.split(":")[-1] for k, _ in missing)
        return [Problem("format", subject, f"{spec.dist} cannot run {spec.what}: its input kernel(s) {names} "
                        f"are Triton-only in this build ({spec.overrides} registers no C++ stand-in for them)",
                        "info",
                        location=missing[0][1].location,
                        fix="serve the export with a CUDA build of the engine")]  # fmt: skip
    names = ", ".join(k.split(":")[-1] for k, _ in found)
    return [Problem("format", subject, f"{spec.dist} has C++ stand-ins ({spec.overrides}) for the Triton "
                    f"input kernel(s) {names} of {spec.what}: not Triton-only in this build", "info",
                    location=str(path))]  # fmt: skip


def safetensors_names(files: Sequence[Path]) -> list[str] | None:
    """The tensor names in the headers of ``files`` (``__metadata__`` excepted); None when none is readable."""
    names: list[str] = []
    read = False
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            continue  # not a safetensors file: loading it fails in the engine as here
        read = True
        names += [k for k in header if k != "__metadata__"]
    return names if read else None

"""The package layout: imports point one way (a stage uses lower layers), no import cycles, docs per folder.

Every import is read from the source with `ast`, function-local ones included (a local import hides a
cycle from Python, not from this test).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specdraft"

#: layer of each top-level unit of the package: a unit may import only units of a strictly lower layer
#: (and itself); units of one layer stay independent of each other
LAYERS = {
    "__init__": 0,
    "fileio": 0,
    "targets": 1,
    "runtime": 1,
    "engine": 2,
    "doctor": 3,
    "data": 3,
    "model": 3,
    "capture": 4,
    "train": 5,
    "decode": 5,
    "export": 6,
    "eval": 7,
    "quickstart": 8,
    "cli": 9,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every specdraft module `path` imports, at top level or inside functions."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("specdraft")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not name.startswith("specdraft"):
                continue
            for a in node.names:  # `from specdraft.x import y` may name a module y
                sub = f"{name}.{a.name}"
                out.add(sub if _module_file(sub) else name)
    return out - {mod}


def _module_file(name: str) -> Path | None:
    base = SRC.parent.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in SRC.rglob("*.py")}


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _graph()}
    assert units <= set(LAYERS), (
        f"add {sorted(units - set(LAYERS))} to LAYERS (and to the README's ARCHITECTURE)"
    )


def test_imports_point_down():
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            a, b = _unit(mod), _unit(dep)
            if a != b and LAYERS[b] >= LAYERS[a]:
                bad.append(f"{mod} (layer {LAYERS[a]}) imports {dep} (layer {LAYERS[b]})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


FOLDERS = sorted(p.parent.relative_to(SRC).as_posix() for p in SRC.rglob("*/__init__.py"))


@pytest.mark.parametrize("pkg", FOLDERS)
def test_folder_says_what_it_owns(pkg):
    doc = ast.get_docstring(ast.parse((SRC / pkg / "__init__.py").read_text()))
    assert doc and "May import" in doc, (
        f"specdraft/{pkg}/__init__.py needs a docstring: what it owns, what it may import"
    )


@pytest.mark.parametrize("pkg", FOLDERS)
def test_folder_is_small_and_its_names_drop_its_prefix(pkg):
    """At most 10 modules a folder (a bigger one wants sub-folders); `scan/walk.py`, not `scan/scan_walk.py`."""
    mods = [p for p in (SRC / pkg).glob("*.py") if p.name != "__init__.py"]
    assert len(mods) <= 10, f"specdraft/{pkg} holds {len(mods)} modules: split it into sub-folders"
    stem = Path(pkg).name
    prefixed = [p.name for p in mods if p.stem.startswith((stem + "_", stem.rstrip("s") + "_"))]
    assert not prefixed, f"specdraft/{pkg}: drop the folder's prefix from {prefixed}"


def test_doctor_sub_folders_point_down():
    """Inside doctor/: `source/` reads engine source alone; no sub-folder reaches back to the command."""
    bad = []
    for mod, deps in _graph().items():
        parts = mod.split(".")
        if parts[1:2] != ["doctor"] or len(parts) < 4:
            continue
        for dep in deps:
            if dep == "specdraft.doctor.command" or (
                parts[2] == "source" and dep.split(".")[2:3] != ["source"]
            ):
                bad.append(f"{mod} imports {dep}")
    assert not bad, "doctor sub-folders import upward:\n" + "\n".join(sorted(bad))


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    """Mutation: an import from a lower layer to a higher one must be reported."""
    fake = tmp_path / "specdraft"
    (fake / "data").mkdir(parents=True)
    (fake / "train").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "data" / "__init__.py").write_text("")
    (fake / "train" / "__init__.py").write_text("")
    (fake / "train" / "loop.py").write_text("from specdraft.data import prepare\n")
    (fake / "data" / "prepare.py").write_text("def f():\n    from specdraft.train.loop import x\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    with pytest.raises(AssertionError, match="specdraft.data.prepare .layer 3. imports specdraft.train.loop"):
        test_imports_point_down()
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()

"""``doctor --against sglang==X``: an engine that loads our exports but that specdraft never calls.

Such an engine (:data:`~specdraft.engine.formats.FORMAT_ENGINES`) has no contract: ``--against`` reads
the release as for vLLM (:func:`~specdraft.doctor.release.wheel.locate`: download, unpack keyed by package,
pins) and checks only the export formats it reads -- what ``specdraft export`` writes, or the export
in ``--export DIR`` -- with :mod:`specdraft.doctor.formats.check`.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.doctor.check import Problem
from specdraft.doctor.formats.check import check_export_dir, check_formats, detect_format, unchecked_layout
from specdraft.doctor.release.wheel import Downloader, canon, locate, requirement_problems
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.formats import FORMAT_ENGINES, UNCHECKED_LAYOUTS, FormatEngine

__all__ = ["check_format_engine", "format_engine_for"]


def format_engine_for(against: str) -> FormatEngine | None:
    """The contract-less engine ``against`` names (``sglang==X``, its wheel, or a tree holding ``sglang/``)."""
    path = Path(against).expanduser()
    if "==" in against and not path.exists():
        return FORMAT_ENGINES.get(canon(against.split("==", 1)[0].strip()))
    if path.is_file() and path.suffix == ".whl":
        return FORMAT_ENGINES.get(canon(path.name.split("-", 1)[0]))
    for fe in FORMAT_ENGINES.values():
        if any((root / fe.engine / "__init__.py").is_file() for root in (path, path / "src", path.parent)):
            return fe
    return None


def _export_problems(fe: FormatEngine, tree: SourceTree, export: str) -> list[Problem]:
    """The export in ``export`` against ``fe``'s readers; a break when it is a format ``fe`` does not read."""
    cfg = Path(export).expanduser() / "config.json"
    try:
        name = detect_format(json.loads(cfg.read_text()))
    except (OSError, ValueError) as exc:
        return [Problem("format", export, f"cannot read {cfg}: {exc}",
                fix="point --export at a `specdraft export` output")]  # fmt: skip
    read = [v.name for f in fe.formats for v in (f, *f.variants.values())]
    if name in UNCHECKED_LAYOUTS and name not in read:
        return [unchecked_layout(name, export, fe.engine)]
    if name not in read:
        return [Problem("format", f"{name} export", f"{export} is a {name} export; {fe.engine} reads only {read}",
                        fix=f"export with --format {read[0]} for {fe.engine}")]  # fmt: skip
    return check_export_dir(fe.formats, tree, export, registry=fe.registry)


def check_format_engine(
    fe: FormatEngine, against: str, export: str | None = None, download: Downloader | None = None
) -> tuple[str, list[Problem]]:
    """(what was read, every problem) for ``--against`` naming the contract-less engine ``fe``.

    Args:
        fe: the engine and the formats it reads.
        against: ``sglang==X``, a wheel, an unpacked wheel or a source tree.
        export: an export directory to check instead of what ``specdraft export`` writes.
        download: fetches a wheel (tests pass one that never touches the network).
    """
    try:
        rel = locate(against, fe.engine, download)
    except (FileNotFoundError, RuntimeError) as exc:
        return "", [Problem("against", against, str(exc), fix="check the version or path")]
    problems = [Problem("against", against, rel.note, "warning")] if rel.note else []
    problems += requirement_problems(rel)
    tree = SourceTree(rel.root)
    if export:
        problems += _export_problems(fe, tree, export)
    else:
        problems += check_formats(fe.formats, tree, registry=fe.registry)
    return f"{against} -> {rel.describe()}; export formats only ({fe.engine} has no contract)", problems

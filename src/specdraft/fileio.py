"""Files every stage writes the same way: atomic replacement, content hashes, the tensor dtype names.

The lowest layer of the package: it imports nothing from specdraft. A write goes to a temporary name
unique to the writing process (``.NAME.specdraft-<pid>.tmp``) and is renamed over the target only when
complete, so a reader never sees half a file and two writers never share a temporary; the prefix and pid
let a later writer prove a leftover is a dead specdraft process's, and remove only those.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

#: store / compute dtype names accepted on the command line
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: a temporary of specdraft's: ``.NAME.specdraft-<pid>.tmp`` (group 1: the writer's pid)
TMP_PATTERN = re.compile(r"^\..+\.specdraft-(\d+)\.tmp$")


def tmp_path(path: Path) -> Path:
    """A temporary sibling of ``path`` private to this process (hidden, removed by the rename)."""
    return path.with_name(f".{path.name}.specdraft-{os.getpid()}.tmp")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead_writers_leftovers(directory: Path) -> list[Path]:
    """The temporaries in ``directory`` that specdraft processes no longer alive left (:data:`TMP_PATTERN`
    with a dead pid): provably ours and abandoned. Anything else, a user's ``.cache.tmp/`` included, is not."""
    found = []
    for p in directory.iterdir():
        m = TMP_PATTERN.match(p.name)
        if m and int(m[1]) != os.getpid() and not _alive(int(m[1])):
            found.append(p)
    return sorted(found)


def file_in_the_way(directory: str | Path, what: str) -> ValueError | None:
    """The one-line error for an output directory that is, or lies under, a file (naming the user's path and
    the file in the way); None when there is none."""
    d = Path(directory)
    blocker = next((p for p in (d, *d.parents) if p.exists() and not p.is_dir()), None)
    if blocker is None:
        return None
    under = "" if blocker == d else f"{d}: "
    return ValueError(
        f"{under}{blocker} is a file, not a directory: choose a directory path for this {what}'s output"
    )


def output_dir(directory: str | Path, what: str) -> Path:
    """Create ``directory`` (and its parents) for a command's output, refused in one line under a file
    (:func:`file_in_the_way`)."""
    d = Path(directory)
    problem = file_in_the_way(d, what)
    if problem is not None:
        raise problem
    d.mkdir(parents=True, exist_ok=True)
    return d


def size_text(n: float) -> str:
    """A byte count in the largest binary unit (KiB to TiB) that keeps it at least 1, 2 decimals: 0.4 MiB is
    "409.60 KiB", not "0.00 GiB"."""
    units = ["KiB", "MiB", "GiB", "TiB"]
    i = 0
    while i + 1 < len(units) and abs(n) >= 2 ** (10 * (i + 2)):
        i += 1
    return f"{n / 2 ** (10 * (i + 1)):.2f} {units[i]}"


def read_state(path: Path, fix: str, keys: Collection[str] = ()) -> dict:
    """A JSON state file (a manifest, a settings record) holding an object with ``keys``; one that cannot be
    read, is not such an object or lacks a key is a one-line ValueError naming it, with ``fix``."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"{path} cannot be read (not JSON: {e}): {fix}") from None
    missing = [k for k in keys if k not in data] if isinstance(data, dict) else list(keys)
    if not isinstance(data, dict) or missing:
        what = f"lacks {', '.join(map(repr, missing))}" if isinstance(data, dict) else "is not a JSON object"
        raise ValueError(f"{path} cannot be read (it {what}): {fix}")
    return data


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a private temporary, fsynced, then renamed over ``path``."""
    tmp = tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode())


def _fsync_tree(directory: Path) -> None:
    """fsync every file of ``directory`` and the directory itself (what a rename then publishes is on disk)."""
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_dir(path: Path) -> None:
    """Remove a directory of ours without a window where half of it is visible under its name: renamed to a
    private temporary first (:func:`tmp_path`, so a kill -9 mid-removal leaves a dead writer's leftover that
    the next writer removes), then deleted."""
    gone = path.with_name(f".{path.name}.old.specdraft-{os.getpid()}.tmp")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def remove_dead_leftovers(directory: Path) -> None:
    """Remove the temporaries dead specdraft writers left in ``directory`` (:func:`dead_writers_leftovers`)."""
    if not directory.is_dir():
        return
    for leftover in dead_writers_leftovers(directory):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: Path, at: Callable[[str, Path], None] | None = None) -> Iterator[Path]:
    """Write a directory whole: yields a private temporary (:func:`tmp_path`) to fill; when the block ends
    without an error its files are fsynced and it replaces ``path`` (an old ``path`` is removed only after
    the new one is complete, through :func:`remove_dir`); on any error, an interrupt or SIGTERM included, the
    temporary is removed and ``path`` is left as it was. A kill -9 leaves only the temporary: a dead writer's
    leftover. ``at(window, temporary)`` is called at each step (tests: the state a kill -9 there leaves)."""
    at = at or (lambda window, tmp: None)
    tmp = tmp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    at("created", tmp)
    try:
        yield tmp
        at("filled", tmp)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        old = path.with_name(f".{path.name}.old.specdraft-{os.getpid()}.tmp")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        at("moved-aside", tmp)
        os.replace(tmp, path)
        at("renamed", path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
        at("renamed", path)


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file's content, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_hash(path: Path) -> str:
    """A short content hash of a file, for manifests."""
    return sha256_file(path)[:16]


LOCK_FILE = ".specdraft.lock"


class DirectoryInUse(RuntimeError):
    """Another live process holds the output directory's lock."""


class DirLock:
    """An exclusive lock on an output directory, held for the life of one writer process.

    ``fcntl.flock`` on ``DIR/.specdraft.lock``: the kernel drops the lock when its process dies, however
    it dies, so a lock left by a killed run is stale by construction and the next run takes it over. The
    file records the holder (pid, command) for the message a second process gets. On taking the lock, the
    temporaries that dead specdraft writers left (:func:`dead_writers_leftovers`: our prefix, a pid no longer
    alive) are removed; nothing else in the directory is ever touched.
    """

    def __init__(self, directory: str | Path, what: str):
        self.dir = Path(directory)
        self.what = what
        self._fd: int | None = None

    def __enter__(self) -> DirLock:
        import fcntl
        import sys

        output_dir(self.dir, self.what)
        path = self.dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise DirectoryInUse(
                f"{self.dir} is in use by another specdraft process ({holder}); wait for it to finish, "
                f"or give this {self.what} another output directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv[:3])} {self.what}".encode(), 0)
        self._fd = fd
        remove_dead_leftovers(self.dir)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


#: weight files a fingerprint covers
WEIGHT_EXTENSIONS = ("safetensors", "bin", "pt", "gguf")
#: the cache of weight-file digests, under :func:`cache_root`
FINGERPRINT_CACHE = "weight-digests.json"
_FINGERPRINT_KIND = "sha256"
_CACHE_LOCK = threading.Lock()
_RECENT_NS = 2 * 10**9  # a file modified this recently may change again within one filesystem clock tick
_LOUD_BYTES = 8 << 30  # hashing more than this says so first


def cache_root() -> Path:
    """Root of specdraft's cache (converted targets, weight digests): $SPECDRAFT_CACHE or ~/.cache/specdraft."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a model directory (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``), sorted;
    a one-line FileNotFoundError when there are none."""
    d = Path(directory)
    files = sorted(p for ext in WEIGHT_EXTENSIONS for p in d.glob(f"*.{ext}"))
    if not files:
        raise FileNotFoundError(f"{d} holds no weight files (*.safetensors, *.bin, *.pt, *.gguf)")
    return files


def weights_fingerprint(directory: str | Path, threads: int = 0) -> str:
    """The content fingerprint of a model directory's weights: ``sha256:`` and 16 hex digits.

    It hashes every byte of every weight file (the sha256 of each file, as ``sha256sum`` prints it, then of
    the names, sizes and digests), so a change to any tensor is seen. Each file's digest is cached by
    (resolved path, size, mtime, ctime, inode) in ``$SPECDRAFT_CACHE/weight-digests.json``: a file is read
    once per version, later calls only stat it. The files still to hash are read in ``threads`` threads
    (0: one per CPU; hashlib releases the GIL), so a sharded checkpoint hashes at the disk's speed.
    """
    files = weight_files(directory)
    digests = _cached_digests(files)
    todo = [p for p in files if p not in digests]
    if todo:
        digests.update(_hash_files(todo, threads))
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}:{p.stat().st_size}:{digests[p]}\n".encode())
    return f"{_FINGERPRINT_KIND}:{h.hexdigest()[:16]}"


def fingerprint_matches(recorded: str, directory: str | Path) -> bool:
    """Whether ``directory``'s weights are those a recorded fingerprint was taken of, comparing by the
    recorded kind: ``sha256:...`` (:func:`weights_fingerprint`) or 16 bare hex digits (the sampled kind of
    specdraft before the full hash, :func:`sampled_fingerprint`, so older runs and drafts still resume)."""
    if ":" not in recorded:
        return sampled_fingerprint(directory) == recorded
    return weights_fingerprint(directory) == recorded


def sampled_fingerprint(directory: str | Path, samples: int = 16, block: int = 1 << 16) -> str:
    """The fingerprint specdraft recorded before the full hash (16 hex digits): each weight file's name,
    size, first block and ``samples`` blocks spread over it. Not a checksum: bytes between the samples are
    unseen; kept only to recognise what older manifests and drafts recorded (:func:`fingerprint_matches`)."""
    h = hashlib.sha256()
    for p in weight_files(directory):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            for i in range(samples + 1):
                f.seek(0 if i == 0 else (size - block) * i // samples if size > block else 0)
                h.update(f.read(block))
    return h.hexdigest()[:16]


def _stat_key(st: os.stat_result) -> list[int]:
    """What identifies one version of a file without reading it: size, mtime, ctime, inode."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read_cache() -> dict[str, dict]:
    """The digest cache (resolved path -> {"stat": key, "sha256": hex}); {} when missing or corrupt."""
    try:
        data = json.loads((cache_root() / FINGERPRINT_CACHE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _cached_digests(files: list[Path]) -> dict[Path, str]:
    """The digests of ``files`` the cache holds for their current stat (a changed file is absent)."""
    cache = _read_cache()
    out = {}
    for p in files:
        entry = cache.get(str(p.resolve()))
        if isinstance(entry, dict) and entry.get("stat") == _stat_key(p.stat()):
            digest = entry.get("sha256")
            if isinstance(digest, str) and len(digest) == 64:
                out[p] = digest
    return out


def _hash_files(files: list[Path], threads: int) -> dict[Path, str]:
    """sha256 of each file, ``threads`` at a time; the digests of files that stayed still while read and
    were not modified in the last seconds are added to the cache."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    total = sum(p.stat().st_size for p in files)
    if total > _LOUD_BYTES:
        print(f"specdraft: hashing {len(files)} weight files ({total / 1e9:.0f} GB) once, to tell these "
              f"weights from others; later runs read the digests from {cache_root()}", flush=True)  # fmt: skip
    workers = max(1, min(len(files), threads or os.cpu_count() or 1))
    start = time.time_ns()
    from tqdm import tqdm

    # a large target's hash takes minutes: a bar over its bytes, advanced as each file is done
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="hashing weights", disable=total <= _LOUD_BYTES)
    with ThreadPoolExecutor(workers) as pool, bar:
        sizes = {pool.submit(_hash_file, p): p.stat().st_size for p in files}  # in the order of files
        for fut in as_completed(sizes):
            bar.update(sizes[fut])
        results = [fut.result() for fut in sizes]
    digests = {p: digest for p, (digest, _) in zip(files, results)}
    keep = {str(p.resolve()): {"stat": key, "sha256": digest} for p, (digest, key) in zip(files, results)
            if key is not None and key[1] < start - _RECENT_NS}  # fmt: skip
    if keep:
        _update_cache(keep)
    return digests


def _hash_file(path: Path) -> tuple[str, list[int] | None]:
    """(sha256 hex digest of the file, its stat key) read in 8 MiB chunks; the key is None when the file
    changed while it was read (then the digest is not cached)."""
    before = _stat_key(path.stat())
    h = hashlib.sha256()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest(), before if _stat_key(path.stat()) == before else None


def _update_cache(entries: dict[str, dict]) -> None:
    """Merge ``entries`` into the digest cache, dropping entries of files that no longer exist; written
    atomically, and skipped silently when the cache directory cannot be written (only speed is lost)."""
    with _CACHE_LOCK:  # the temporary is per process: threads of one process take turns
        cache = {k: v for k, v in _read_cache().items() if os.path.exists(k)}
        cache.update(entries)
        try:
            cache_root().mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache_root() / FINGERPRINT_CACHE, json.dumps(cache, indent=0))
        except OSError:
            pass


def changed_settings(
    recorded: Mapping[str, Any],
    now: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    skip: Collection[str] = (),
) -> list[tuple[str, Any, Any]]:
    """``(key, recorded value, value now)`` for each key of ``now`` (but ``skip``) whose recorded value
    differs: the one check behind every "rerun with other settings" refusal. A key missing from
    ``recorded`` (a setting newer than the record) reads as its value in ``defaults``, else None."""
    defaults = defaults or {}
    return [(k, recorded.get(k, defaults.get(k)), v) for k, v in now.items()
            if k not in skip and recorded.get(k, defaults.get(k)) != v]  # fmt: skip

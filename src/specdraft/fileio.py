"""Files every stage writes the same way: atomic replacement, content hashes, the tensor dtype names.

The lowest layer of the package: it imports nothing from specdraft. A write goes to a temporary name
unique to the writing process (``.NAME.<pid>.tmp``) and is renamed over the target only when complete,
so a reader never sees half a file and two writers never share a temporary.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

#: store / compute dtype names accepted on the command line
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tmp_path(path: Path) -> Path:
    """A temporary sibling of ``path`` private to this process (hidden, removed by the rename)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


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
    file records the holder (pid, command) for the message a second process gets. On taking the lock,
    temporaries that killed writers left in the directory (``.*.tmp``, files or directories) are removed:
    no live writer can own them while we hold the lock.
    """

    def __init__(self, directory: str | Path, what: str):
        self.dir = Path(directory)
        self.what = what
        self._fd: int | None = None

    def __enter__(self) -> DirLock:
        import fcntl
        import shutil
        import sys

        self.dir.mkdir(parents=True, exist_ok=True)
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
        for leftover in self.dir.glob(".*.tmp"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def weights_fingerprint(directory: str | Path, samples: int = 16, block: int = 1 << 16) -> str:
    """A cheap content fingerprint of a model directory's weight files, in milliseconds even at 1T params.

    Covers every ``*.safetensors``/``*.bin``/``*.pt``/``*.gguf`` file: its name, its size, its first
    block (the safetensors header: names, dtypes, shapes, offsets) and ``samples`` blocks spread evenly
    over it. Two checkpoints of one architecture with other trained weights differ in the sampled bytes.
    It is not a checksum: a change confined to bytes between the samples goes unseen.
    """
    d = Path(directory)
    files = sorted(p for ext in ("safetensors", "bin", "pt", "gguf") for p in d.glob(f"*.{ext}"))
    if not files:
        raise FileNotFoundError(f"{d} holds no weight files (*.safetensors, *.bin, *.pt, *.gguf)")
    h = hashlib.sha256()
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            for i in range(samples + 1):
                f.seek(0 if i == 0 else (size - block) * i // samples if size > block else 0)
                h.update(f.read(block))
    return h.hexdigest()[:16]


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

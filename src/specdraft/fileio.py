"""Files every stage writes the same way: atomic replacement, content hashes, the tensor dtype names.

The lowest layer of the package: it imports nothing from specdraft. A write goes to a temporary name
unique to the writing process (``.NAME.<pid>.tmp``) and is renamed over the target only when complete,
so a reader never sees half a file and two writers never share a temporary.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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

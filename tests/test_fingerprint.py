"""The target's weights fingerprint: every byte of every weight file counts, computed once per file version.

`fileio.weights_fingerprint` hashes whole weight files (sha256), caches each file's digest by (path, size,
mtime, ctime, inode) under $SPECDRAFT_CACHE, and hashes the files of a sharded checkpoint in parallel.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdraft import fileio
from specdraft.fileio import FINGERPRINT_CACHE, fingerprint_matches, weights_fingerprint

HOUR_NS = 3600 * 10**9


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private specdraft cache directory for the test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("SPECDRAFT_CACHE", str(d))
    return d


@pytest.fixture
def opens(monkeypatch) -> list[str]:
    """The weight files fileio opens from now on (names, in order)."""
    seen: list[str] = []
    real = open

    def counting_open(file, *args, **kwargs):
        if str(file).endswith(".safetensors"):
            seen.append(Path(file).name)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(fileio, "open", counting_open, raising=False)
    return seen


def tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (first byte, end byte) of its data in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()}


def flip(path: Path, span: tuple[int, int]) -> None:
    """Invert every byte of `span` in place (same size, same inode); a second flip restores them."""
    with open(path, "r+b") as f:
        f.seek(span[0])
        data = f.read(span[1] - span[0])
        f.seek(span[0])
        f.write(bytes(b ^ 0xFF for b in data))


def age(path: Path, ns: int = HOUR_NS) -> None:
    """Set the file's mtime `ns` into the past (a file written just now is hashed, not trusted to a cache)."""
    t = time.time_ns() - ns
    os.utime(path, ns=(t, t))


def test_a_change_to_any_one_tensor_is_seen(tmp_path, tiny_llama_dir, cache):
    """Each tensor of a real tiny model inverted alone (same size, same file) changes the fingerprint; the
    old 17 sampled blocks of 64 KiB missed the tensors between them."""
    d = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, d)
    weights = d / "model.safetensors"
    assert weights.stat().st_size > 17 * (1 << 16)  # larger than the old samples: some bytes lie between
    base = weights_fingerprint(d)
    assert base.startswith("sha256:") and base == weights_fingerprint(tiny_llama_dir)
    unseen = []
    for name, span in tensor_spans(weights).items():
        flip(weights, span)
        if weights_fingerprint(d) == base:
            unseen.append(name)
        flip(weights, span)
    assert not unseen, f"changes unseen in {len(unseen)} tensors, e.g. {unseen[:3]}"
    assert weights_fingerprint(d) == base  # content, not timestamps: the restored bytes fingerprint alike


def test_a_cached_file_is_not_read_again_and_a_touched_one_is(tmp_path, tiny_llama_dir, cache, opens):
    d = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, d)
    weights = d / "model.safetensors"
    age(weights)
    first = weights_fingerprint(d)
    assert opens == ["model.safetensors"] and (cache / FINGERPRINT_CACHE).is_file()
    assert weights_fingerprint(d) == first and len(opens) == 1  # a hit reads nothing
    age(weights, 2 * HOUR_NS)  # same bytes, another mtime: hashed again
    assert weights_fingerprint(d) == first and len(opens) == 2
    assert weights_fingerprint(d) == first and len(opens) == 2
    (cache / FINGERPRINT_CACHE).write_text("{not json")  # a corrupt cache is a miss, then rewritten
    assert weights_fingerprint(d) == first and len(opens) == 3
    assert weights_fingerprint(d) == first and len(opens) == 3


def test_a_file_written_just_now_is_not_trusted_to_the_cache(tmp_path, tiny_llama_dir, cache, opens):
    """A file whose mtime is this instant could change again within the filesystem's clock tick without
    its stat changing: it is hashed on every call until it is older."""
    d = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, d)
    os.utime(d / "model.safetensors")  # written now (copytree kept the original's mtime)
    weights_fingerprint(d)
    weights_fingerprint(d)
    assert len(opens) == 2
    age(d / "model.safetensors")
    weights_fingerprint(d)
    weights_fingerprint(d)
    assert len(opens) == 3


def test_a_sharded_checkpoint_is_hashed_file_by_file_in_parallel(tmp_path, cache, opens):
    d = tmp_path / "sharded"
    d.mkdir()
    torch.manual_seed(0)
    for i in range(4):
        save_file({f"layers.{i}.weight": torch.randn(64, 64)}, str(d / f"model-0000{i}-of-00004.safetensors"))
        age(d / f"model-0000{i}-of-00004.safetensors")
    one = weights_fingerprint(d, threads=1)
    assert weights_fingerprint(d, threads=4) == one and len(opens) == 4  # the second call hit the cache
    shard = d / "model-00002-of-00004.safetensors"
    flip(shard, tensor_spans(shard)["layers.2.weight"])
    age(shard, 2 * HOUR_NS)
    assert weights_fingerprint(d, threads=4) != one and opens[4:] == [shard.name]  # only the changed one


def test_an_unwritable_cache_only_costs_the_cache(tmp_path, tiny_llama_dir, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(blocker / "cache"))  # cannot be created
    assert weights_fingerprint(tiny_llama_dir).startswith("sha256:")


def test_a_fingerprint_of_the_old_sampled_kind_is_still_recognised(tmp_path, tiny_llama_dir, cache):
    """Manifests and drafts written before the full hash record 16 hex digits: compared by that kind."""
    old = fileio.sampled_fingerprint(tiny_llama_dir)
    assert len(old) == 16 and ":" not in old
    assert fingerprint_matches(old, tiny_llama_dir)
    assert fingerprint_matches(weights_fingerprint(tiny_llama_dir), tiny_llama_dir)
    d = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, d)
    weights = d / "model.safetensors"
    flip(weights, (8, 9))  # a byte of the header length: seen by both kinds
    assert not fingerprint_matches(old, d) and not fingerprint_matches(weights_fingerprint(tiny_llama_dir), d)

"""Sharded hidden-state store: writer with atomic shards and exact resume, reader, and verify.

Layout of an extraction directory (one or many processes may write into it):
    manifest-{i:05d}-of-{N:05d}.json   one per extraction process i of N (--shard-index/--num-shards)
    shard-{i:05d}-{k:05d}.safetensors  samples of process i, shard k: per sample id s the tensors
                                       `{s}.input_ids` int32 (T,), `{s}.loss_mask` uint8 (T,),
                                       `{s}.hidden` (T, n_layers, H) in the manifest's dtype
    shard-{i:05d}-{k:05d}.json         its sidecar: sample ids, lengths, sha256 and size of the shard file

The plan (which samples go to which shard of which process) is a pure function of the dataset and the
plan settings, so a restarted run recomputes it and skips shards already complete. A shard counts as
complete only when its sidecar exists; both files are written to a temp name and renamed, the sidecar
last, so a run killed at any point leaves no partial shard visible and loses no complete one.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdraft.data.prepare import COUNTS_FILE
from specdraft.fileio import DTYPES, atomic_write_bytes, sha256_file, tmp_path


def manifest_name(shard_index: int, num_shards: int) -> str:
    return f"manifest-{shard_index:05d}-of-{num_shards:05d}.json"


def shard_stem(shard_index: int, k: int) -> str:
    return f"shard-{shard_index:05d}-{k:05d}"


def partition(num_samples: int, num_shards: int, shard_index: int) -> list[int]:
    """The sample ids process `shard_index` of `num_shards` extracts: every num_shards-th one."""
    return list(range(shard_index, num_samples, num_shards))


def plan_shards(lengths: dict[int, int], samples_per_shard: int) -> list[list[int]]:
    """Deterministic shard plan: samples sorted by length (longest first, then id), cut into shards."""
    order = sorted(lengths, key=lambda s: (-lengths[s], s))
    return [order[i : i + samples_per_shard] for i in range(0, len(order), samples_per_shard)]


def write_shard(out: Path, stem: str, samples: dict[int, dict[str, torch.Tensor]]) -> dict:
    """Write one shard and then its sidecar, both atomically; returns the sidecar."""
    tensors = {}
    for sid, s in samples.items():
        tensors[f"{sid}.input_ids"] = s["input_ids"].to(torch.int32).contiguous()
        tensors[f"{sid}.loss_mask"] = s["loss_mask"].to(torch.uint8).contiguous()
        tensors[f"{sid}.hidden"] = s["hidden"].contiguous()
    path = out / f"{stem}.safetensors"
    tmp = tmp_path(path)
    save_file(tensors, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sidecar = {
        "samples": list(samples),
        "lengths": [int(s["input_ids"].shape[0]) for s in samples.values()],
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
    }
    atomic_write_bytes(out / f"{stem}.json", json.dumps(sidecar).encode())
    return sidecar


def write_manifest(out: Path, manifest: dict) -> None:
    name = manifest_name(manifest["shard_index"], manifest["num_shards"])
    atomic_write_bytes(out / name, json.dumps(manifest, indent=1).encode())


def bytes_per_token(n_layers: int, hidden: int, dtype: str) -> int:
    return n_layers * hidden * torch.finfo(DTYPES[dtype]).bits // 8 + 5


# ---------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Loc:
    path: Path
    length: int


class ShardSet:
    """All shards of one extraction, possibly written by many processes into one or many directories."""

    def __init__(self, manifests: list[dict], locs: dict[int, _Loc], duplicates: dict[int, list[str]]):
        self.manifests = manifests
        self.manifest = manifests[0]
        self._locs = locs
        self.duplicates = duplicates

    @classmethod
    def open(cls, paths: str | Path | list) -> ShardSet:
        """Open one or more extraction directories as one dataset; refuses mixed extractions."""
        dirs = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        manifests = []
        for d in dirs:
            found = sorted(d.glob("manifest-*-of-*.json"))
            if not found:
                raise FileNotFoundError(f"{d} holds no extraction manifest: run `specdraft extract` first")
            for m in found:
                man = json.loads(m.read_text())
                man["_dir"] = str(d)
                manifests.append(man)
        keys = ("target", "layer_ids", "dtype", "dataset_hash", "num_shards")
        ref = manifests[0]
        for man in manifests[1:]:
            diff = [k for k in keys if man.get(k) != ref.get(k)]
            if diff:
                raise ValueError(
                    f"{man['_dir']} was extracted with other settings ({', '.join(diff)}) than {ref['_dir']}: "
                    "open only outputs of one extraction together"
                )
        locs: dict[int, _Loc] = {}
        dup: dict[int, list[str]] = {}
        seen_sidecars = set()
        for man in manifests:
            d = Path(man["_dir"])
            for sc in sorted(d.glob(f"shard-{man['shard_index']:05d}-*.json")):
                if sc.resolve() in seen_sidecars:
                    continue
                seen_sidecars.add(sc.resolve())
                side = json.loads(sc.read_text())
                path = sc.with_suffix(".safetensors")
                for sid, n in zip(side["samples"], side["lengths"]):
                    if sid in locs:
                        dup.setdefault(sid, [str(locs[sid].path)]).append(str(path))
                    locs[sid] = _Loc(path, n)
        return cls(manifests, locs, dup)

    def sample_ids(self) -> list[int]:
        return sorted(self._locs)

    def length(self, sid: int) -> int:
        return self._locs[sid].length

    def load(self, sid: int) -> dict[str, torch.Tensor]:
        """One sample: input_ids (T,) long, loss_mask (T,) uint8, hidden (T, n_layers, H)."""
        with safe_open(str(self._locs[sid].path), framework="pt") as f:
            return {
                "input_ids": f.get_tensor(f"{sid}.input_ids").long(),
                "loss_mask": f.get_tensor(f"{sid}.loss_mask"),
                "hidden": f.get_tensor(f"{sid}.hidden"),
            }

    def token_counts(self) -> np.ndarray:
        """Token frequencies over loss-masked tokens, from the dataset the shards were extracted from."""
        path = Path(self.manifest["dataset"]) / COUNTS_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"{path} missing: the prepared dataset of this extraction was moved or deleted"
            )
        return np.load(path)


def verify(paths: list[str] | str, deep: bool = True) -> list[str]:
    """Check shards against their manifests and sidecars; returns every problem found (empty: all good).

    Checks: every sample of the dataset present exactly once across all processes' outputs; each shard's
    sha256 and size; per sample the tensor names, shapes (T matches, n_layers and H match the manifest),
    dtypes, and finite values (deep=True reads every tensor).
    """
    problems: list[str] = []
    try:
        ss = ShardSet.open(paths)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    man = ss.manifest
    n_layers, hidden = len(man["layer_ids"]), man["target"]["hidden_size"]
    dtype = DTYPES[man["dtype"]]
    expected = set(range(man["num_samples"]))
    have = set(ss.sample_ids())
    missing = sorted(expected - have)
    extra = sorted(have - expected)
    indices = {m["shard_index"] for m in ss.manifests}
    absent = sorted(set(range(man["num_shards"])) - indices)
    if absent:
        problems.append(f"no output from extraction processes {absent} of {man['num_shards']}")
    if missing:
        problems.append(
            f"{len(missing)} samples missing: {missing[:20]}{' ...' if len(missing) > 20 else ''}"
        )
    if extra:
        problems.append(f"{len(extra)} samples not in the dataset: {extra[:20]}")
    for sid, where in sorted(ss.duplicates.items()):
        problems.append(f"sample {sid} stored more than once: {where}")
    by_path: dict[Path, list[int]] = {}
    for sid in ss.sample_ids():
        by_path.setdefault(ss._locs[sid].path, []).append(sid)
    for path, sids in sorted(by_path.items()):
        side = json.loads(path.with_suffix(".json").read_text())
        if not path.exists():
            problems.append(f"{path.name}: shard file missing (its sidecar lists {len(sids)} samples)")
            continue
        if path.stat().st_size != side["bytes"]:
            problems.append(f"{path.name}: size {path.stat().st_size} != {side['bytes']} recorded")
            continue
        if sha256_file(path) != side["sha256"]:
            problems.append(f"{path.name}: checksum mismatch (file corrupted or modified)")
            continue
        if not deep:
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                for sid in sids:
                    T = ss.length(sid)
                    want = {
                        f"{sid}.input_ids": ((T,), torch.int32),
                        f"{sid}.loss_mask": ((T,), torch.uint8),
                        f"{sid}.hidden": ((T, n_layers, hidden), dtype),
                    }
                    for name, (shape, dt) in want.items():
                        if name not in names:
                            problems.append(f"{path.name}: tensor {name} missing")
                            continue
                        t = f.get_tensor(name)
                        if tuple(t.shape) != shape or t.dtype != dt:
                            problems.append(
                                f"{path.name}: {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dt}"
                            )
                        elif t.is_floating_point() and not torch.isfinite(t).all():
                            problems.append(
                                f"{path.name}: {name} has {int((~torch.isfinite(t)).sum())} non-finite values"
                            )
        except Exception as e:  # a corrupted header or truncated file
            problems.append(f"{path.name}: unreadable ({type(e).__name__}: {e})")
    return problems


def verify_dirs(paths: list[str], quick: bool = False) -> int:
    """Check extraction outputs against their manifests; report every problem found.

    Args:
        paths: one or more extraction directories (outputs of all --shard-index processes of one run).
        quick: check counts, sizes and checksums only, without reading every tensor.
    """
    problems = verify(paths, deep=not quick)
    for p in problems:
        print(f"PROBLEM {p}")
    print(f"verify: {'OK' if not problems else f'{len(problems)} problem(s)'} ({', '.join(paths)})")
    return 1 if problems else 0


def estimate_bytes(num_tokens: int, n_layers: int, hidden: int, dtype: str) -> int:
    """Bytes an extraction of `num_tokens` tokens writes (tensors plus a little header overhead)."""
    return math.ceil(num_tokens * bytes_per_token(n_layers, hidden, dtype) * 1.01) + 4096

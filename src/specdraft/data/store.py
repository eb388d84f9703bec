"""Sharded hidden-state store: writer with atomic shards and exact resume, checked reader, and verify.

Layout of an extraction directory (one or many processes may write into it):
    manifest-{i:05d}-of-{N:05d}.json   one per extraction process i of N (--shard-index/--num-shards),
                                       with the run's `identity` (what a resume must match) and its
                                       hash `extraction_id`
    shard-{i:05d}-{k:05d}.safetensors  samples of process i, shard k: per sample id s the tensors
                                       `{s}.input_ids` int32 (T,), `{s}.loss_mask` uint8 (T,),
                                       `{s}.hidden` (T, n_layers, H) in the manifest's dtype; with dtype
                                       fp8 `{s}.hidden` is float8_e4m3fn and `{s}.hidden_scale` float32
                                       (T, n_layers) holds its scales (see `specdraft.data.fp8`)
    shard-{i:05d}-{k:05d}.json         its sidecar: sample ids, lengths, sha256 and size of the shard file,
                                       its own name and the `extraction_id` it belongs to
    .specdraft.lock                    the writer's lock (`specdraft.fileio.DirLock`); readers ignore it

The plan (which samples go to which shard of which process) is a pure function of the dataset and the
plan settings, so a restarted run recomputes it and skips shards already complete. A shard counts as
complete only when its sidecar exists and its file has the sidecar's size; both files are written to a
temp name and renamed, the sidecar last, so a run killed at any point leaves no partial shard visible
and loses no complete one.

Readers check what they read (`ShardSet`): at open, every shard of a complete extraction must be there
with its recorded size; on first use of a shard in a process its sha256; per loaded sample the tensor
names, shapes, dtypes and finite values. A failed check raises `ShardError` naming the file and the fix.

Every artefact is bound to its run: a sidecar whose `extraction_id` or name is not its manifest's and its
own (a shard copied in from another extraction, or renamed) is refused like a corrupted one, and the
prepared dataset the extraction came from must still have the content hash the identity records
(`dataset_problem`; train reads its token counts). `missing_samples` says what an extraction lacks
(samples of absent processes, of shards not written yet): verify reports it, train refuses it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specdraft.data import fp8
from specdraft.data.prepare import COUNTS_FILE, DATASET_FILE, MANIFEST_FILE, dataset_hash
from specdraft.fileio import DTYPES, atomic_write_bytes, read_state, sha256_file, tmp_path

#: names accepted for the stored hidden states: the torch dtypes and fp8 (e4m3 + a scale per row)
STORE_DTYPES = (*sorted(DTYPES), "fp8")

#: the fix for a shard that is missing, truncated or partly written: extract's resume redoes it
REDO = "rerun `specdraft extract` with the same command to redo it"

#: the fix for a shard lost with its sidecar: redo it, or train without its samples (--allow-partial alone does
#: not leave out a shard the manifest lists; --skip-bad does, then its samples are missing: --allow-partial)
LOST = f"{REDO}, or train with --skip-bad --allow-partial to train without its samples"

#: the fix for an extraction written before shards were bound to it (no `extraction_id`)
REEXTRACT = "extract again into a new directory (this version binds every shard to its extraction)"


class ShardError(ValueError):
    """A shard (or its sidecar / manifest) is missing, truncated, corrupted or holds bad values."""

    def __init__(self, path: Path, problem: str, fix: str = REDO):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}: {fix}")


def manifest_name(shard_index: int, num_shards: int) -> str:
    return f"manifest-{shard_index:05d}-of-{num_shards:05d}.json"


def shard_stem(shard_index: int, k: int) -> str:
    return f"shard-{shard_index:05d}-{k:05d}"


def extraction_id(identity: dict) -> str:
    """The short hash of an extraction process's identity (dataset, target, layers, dtype, sharding):
    its manifest and every sidecar it writes record it."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def binding_problem(side: dict, stem: str, ext_id: str) -> str:
    """Why sidecar `side` is not shard `stem` of extraction `ext_id` ("" when it is)."""
    if side.get("extraction") != ext_id:
        return (f"copied in from another extraction (its sidecar records extraction "
                f"{side.get('extraction') or 'none'}, this one is {ext_id})")  # fmt: skip
    if side.get("shard") != stem:
        return f"holds shard {side.get('shard')} of this extraction under another name"
    return ""


def foreign_fix(path: Path) -> str:
    """The fix for a shard that does not belong where it is: remove it, let extract redo it."""
    return f"delete {path.with_suffix('.safetensors')} and {path.with_suffix('.json')}, then {REDO}"


def partition(num_samples: int, num_shards: int, shard_index: int) -> list[int]:
    """The sample ids process `shard_index` of `num_shards` extracts: every num_shards-th one."""
    return list(range(shard_index, num_samples, num_shards))


def plan_shards(lengths: dict[int, int], samples_per_shard: int) -> list[list[int]]:
    """Deterministic shard plan: samples sorted by length (longest first, then id), cut into shards."""
    order = sorted(lengths, key=lambda s: (-lengths[s], s))
    return [order[i : i + samples_per_shard] for i in range(0, len(order), samples_per_shard)]


def shard_is_complete(out: Path, stem: str) -> bool:
    """Whether shard `stem` is done: its sidecar readable and its file of the sidecar's size.

    A shard file truncated or replaced after its sidecar was written counts as not done, so a resumed
    extraction redoes it.
    """
    try:
        side = json.loads((out / f"{stem}.json").read_text())
        return not sidecar_problem(side) and (out / f"{stem}.safetensors").stat().st_size == side["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_shard(
    out: Path,
    stem: str,
    samples: dict[int, dict[str, torch.Tensor]],
    store_dtype: str = "",
    extraction: str = "",
) -> dict:
    """Write one shard and then its sidecar, both atomically; returns the sidecar.

    `store_dtype` casts the hidden states (a name of `STORE_DTYPES`; "fp8" encodes them with a scale per
    token and layer); empty: stored as given. `extraction`: the `extraction_id` the sidecar binds it to.
    """
    tensors = {}
    for sid, s in samples.items():
        tensors[f"{sid}.input_ids"] = s["input_ids"].to(torch.int32).contiguous()
        tensors[f"{sid}.loss_mask"] = s["loss_mask"].to(torch.uint8).contiguous()
        if store_dtype == "fp8":
            q, scale = fp8.encode(s["hidden"])  # (T, n, H) e4m3, (T, n) float32
            tensors[f"{sid}.hidden"], tensors[f"{sid}.hidden_scale"] = q.contiguous(), scale.contiguous()
        else:
            h = s["hidden"].to(DTYPES[store_dtype]) if store_dtype else s["hidden"]
            tensors[f"{sid}.hidden"] = h.contiguous()
    path = out / f"{stem}.safetensors"
    tmp = tmp_path(path)
    try:
        save_file(tensors, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a full disk must not stay full of our partial shard
        code = re.search(r"os error (\d+)", str(e)) if isinstance(e, SafetensorError) else None
        if code:  # safetensors' own I/O errors (ENOSPC, EIO, ...) as the OSError they are
            raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e
        raise
    sidecar = {
        "extraction": extraction,
        "shard": stem,
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
    """Stored bytes per token: hidden states (+ fp8 scales), int32 id and uint8 mask."""
    if dtype == "fp8":
        return n_layers * hidden + n_layers * 4 + 5
    return n_layers * hidden * torch.finfo(DTYPES[dtype]).bits // 8 + 5


def estimate_bytes(num_tokens: int, n_layers: int, hidden: int, dtype: str) -> int:
    """Bytes an extraction of `num_tokens` tokens writes (tensors plus a little header overhead)."""
    return math.ceil(num_tokens * bytes_per_token(n_layers, hidden, dtype) * 1.01) + 4096


def sidecar_problem(side: object) -> str:
    """Why a sidecar's content is not one (its keys and their types; "" when it is): each reader may then
    index it without a KeyError."""
    if not isinstance(side, dict):
        return "is not a JSON object"
    want = {"extraction": str, "shard": str, "samples": list, "lengths": list, "sha256": str, "bytes": int}
    missing = [k for k in want if k not in side]
    if missing:
        return f"lacks {', '.join(map(repr, missing))}"
    wrong = [k for k, t in want.items() if not isinstance(side[k], t) or isinstance(side[k], bool)]
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in [*side["samples"], *side["lengths"]])
    if wrong or not ints or len(side["samples"]) != len(side["lengths"]):
        return f"holds values of the wrong type ({', '.join(wrong) or 'samples, lengths'})"
    return ""


def _read_json(path: Path) -> dict:
    """A manifest or sidecar; a missing or unreadable one is a ShardError naming it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(path, "missing") from None
    except (OSError, ValueError) as e:
        raise ShardError(path, f"unreadable ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Loc:
    path: Path
    length: int


class ShardSet:
    """All shards of one extraction, possibly written by many processes into one or many directories.

    `open` checks that the shards are all there with their recorded sizes; `load` checks each shard's
    sha256 the first time this process reads from it and every sample's tensors (names, shapes, dtypes,
    finite values). fp8 shards load decoded to float32.
    """

    def __init__(self, manifests: list[dict], locs: dict[int, _Loc], duplicates: dict[int, list[str]],
                 sidecars: dict[Path, dict]):  # fmt: skip
        self.manifests = manifests
        self.manifest = manifests[0]
        self._locs = locs
        self._listed = frozenset(locs)  # every sample a sidecar lists, bad shards' too (see missing_samples)
        self.duplicates = duplicates
        self._sidecars = sidecars  # shard path -> its sidecar
        self._hashed: set[Path] = set()  # shards whose sha256 this process has checked
        self.skipped: dict[str, str] = {}  # shard file -> why it was left out (open(skip_bad=True))

    @classmethod
    def open(cls, paths: str | Path | list, skip_bad: bool = False) -> ShardSet:
        """Open one or more extraction directories as one dataset; refuses mixed extractions.

        Raises ShardError for the first missing or truncated shard or sidecar. With `skip_bad`, every
        shard is checked in full now (size, sha256, every sample's tensors: one read of all data) and the
        bad ones are left out of `sample_ids()`, with a warning line naming them (also in `.skipped`).
        """
        ss, problems = cls._scan(paths)
        if not skip_bad:
            if problems:
                e = problems[0][1]
                if len(problems) > 1:
                    e.args = (
                        f"{e} ({len(problems) - 1} more bad shards: `specdraft verify` lists them all)",
                    )
                raise e
            return ss
        known = {p for p, _ in problems}
        for path in sorted(set(ss._sidecars) - known):
            problems += [(path, e) for e in ss._check_shard(path, deep=True)]
        ss._leave_out(problems)
        return ss

    @classmethod
    def _scan(cls, paths) -> tuple[ShardSet, list[tuple[Path, ShardError]]]:
        """The set and the (shard path, problem) of each missing or truncated shard or sidecar."""
        manifests = _read_manifests(paths)
        locs: dict[int, _Loc] = {}
        dup: dict[int, list[str]] = {}
        sidecars: dict[Path, dict] = {}
        problems: list[tuple[Path, ShardError]] = []
        seen: set[Path] = set()
        for man in manifests:
            for sc, path in _manifest_sidecars(man, problems):
                if sc.resolve() in seen:
                    continue  # one directory opened twice
                seen.add(sc.resolve())
                try:
                    side = _read_json(sc)
                except ShardError as e:
                    problems.append((path, e))
                    continue
                bad = sidecar_problem(side)
                if bad:
                    problems.append((path, ShardError(sc, f"sidecar unreadable (it {bad})", foreign_fix(sc))))
                    continue
                sidecars[path] = side
                problems += [(path, e) for e in _size_problems(path, side)]
                foreign = binding_problem(side, path.stem, man["extraction_id"])
                if foreign:
                    problems.append((path, ShardError(path, foreign, foreign_fix(path))))
                for sid, n in zip(side["samples"], side["lengths"]):
                    if sid in locs:
                        dup.setdefault(sid, [str(locs[sid].path)]).append(str(path))
                    locs[sid] = _Loc(path, n)
        return cls(manifests, locs, dup, sidecars), problems

    def _leave_out(self, problems: list[tuple[Path, ShardError]]) -> None:
        """Drop the samples of the shards in `problems` and say so in one warning line."""
        bad = {p: e.problem for p, e in problems}
        if not bad:
            return
        self._locs = {s: loc for s, loc in self._locs.items() if loc.path not in bad}
        self.skipped = {str(p): why for p, why in sorted(bad.items())}
        # what each bad shard holds by its own sidecar (another shard may list the same ids); none: unknown
        held = {p: len(self._sidecars[p]["samples"]) for p in bad if p in self._sidecars}
        names = ", ".join(f"{p.name} ({why})" for p, why in sorted(bad.items()))
        lost = self.missing_samples() if len(held) < len(bad) else []  # a shard without its sidecar: unlisted
        more = f" ({len(lost)} of them listed by no sidecar)" if lost else ""
        print(f"specdraft: warning: skipping {len(bad)} bad shard(s), {sum(held.values()) + len(lost)} samples"
              f"{more}: {names}", flush=True)  # fmt: skip

    def sample_ids(self) -> list[int]:
        return sorted(self._locs)

    def missing_samples(self) -> list[int]:
        """Samples of the extraction that no sidecar lists: those of absent processes (`--num-shards`), of
        shards not written yet or lost. Samples of bad shards (left out with skip_bad) are not counted."""
        return sorted(set(range(self.manifest["num_samples"])) - self._listed)

    def absent_processes(self) -> list[int]:
        """The `--shard-index` values of the extraction whose output was not opened."""
        return sorted(set(range(self.manifest["num_shards"])) - {m["shard_index"] for m in self.manifests})

    def dataset_problem(self) -> Exception | None:
        """Why the prepared dataset these shards came from cannot be used with them (None when it can):
        moved or deleted, or changed since (its content hash is not the one the extraction recorded)."""
        d = Path(self.manifest["dataset"])
        gone = [d / f for f in (MANIFEST_FILE, DATASET_FILE, COUNTS_FILE) if not (d / f).exists()]
        if gone:
            return FileNotFoundError(f"{gone[0]} missing: the prepared dataset of this extraction was moved or "
                                     "deleted (train reads its token counts): restore it there")  # fmt: skip
        now, then = dataset_hash(d), self.manifest["dataset_hash"]
        if now != then:
            return ValueError(f"{d / DATASET_FILE} changed since these shards were extracted from it (content hash "
                              f"{now}, {then} then; was `specdraft prepare` rerun into {d}?): restore that dataset, "
                              "or extract the new one into a new directory")  # fmt: skip
        return None

    def length(self, sid: int) -> int:
        return self._locs[sid].length

    def load(self, sid: int) -> dict[str, torch.Tensor]:
        """One sample: input_ids (T,) long, loss_mask (T,) uint8, hidden (T, n_layers, H) in the stored
        dtype (float32 for fp8 shards). Raises ShardError naming the file for anything wrong with it."""
        loc = self._locs[sid]
        if loc.path not in self._hashed:
            bad = self._check_shard(loc.path, deep=False)  # size and sha256, once per process
            if bad:
                raise bad[0]
        return self._read(loc.path, [sid])[sid]

    def _check_shard(self, path: Path, deep: bool) -> list[ShardError]:
        """Size and sha256 of one shard against its sidecar; with `deep` every sample's tensors too."""
        side = self._sidecars[path]
        bad = _size_problems(path, side)
        if bad:
            return bad
        if sha256_file(path) != side["sha256"]:
            sc = path.with_suffix(".json")
            fix = f"delete {sc} and {REDO}, or train with --skip-bad to leave its samples out"
            return [ShardError(path, "checksum mismatch (file corrupted or modified)", fix)]
        self._hashed.add(path)
        if deep:
            try:
                self._read(path, side["samples"], keep=False)
            except ShardError as e:
                return [e]
        return []

    def _read(self, path: Path, sids: list[int], keep: bool = True) -> dict[int, dict[str, torch.Tensor]]:
        """Samples `sids` of one shard, each checked against the manifest and sidecar (names, shapes,
        dtypes, finite values); `keep=False` checks them without keeping them."""
        man = self.manifest
        n_layers, hidden, dtype = len(man["layer_ids"]), man["target"]["hidden_size"], man["dtype"]
        side = self._sidecars[path]
        lengths = dict(zip(side["samples"], side["lengths"]))
        out = {}
        try:
            with safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                for sid in sids:
                    s = _checked_sample(
                        path, f, names, sid, _expected(sid, lengths[sid], n_layers, hidden, dtype)
                    )
                    if keep:
                        out[sid] = s
        except ShardError:
            raise
        except Exception as e:  # a corrupted header or truncated file
            raise ShardError(path, f"unreadable ({type(e).__name__}: {e})") from None
        return out

    def token_counts(self) -> np.ndarray:
        """Token frequencies over loss-masked tokens, from the dataset the shards were extracted from
        (refused when that dataset is gone or changed since)."""
        problem = self.dataset_problem()
        if problem is not None:
            raise problem
        return np.load(Path(self.manifest["dataset"]) / COUNTS_FILE)


def _read_manifests(paths) -> list[dict]:
    """The manifests of all directories, refusing outputs of different extractions."""
    dirs = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    manifests = []
    for d in dirs:
        found = sorted(d.glob("manifest-*-of-*.json"))
        if not found:
            raise FileNotFoundError(f"{d} holds no extraction manifest: run `specdraft extract` first")
        for m in found:
            fix = (
                f"delete it and rerun `specdraft extract` with the same command (the shards in {d} are kept)"
            )
            man = read_manifest(m, fix)
            if "extraction_id" not in man:
                raise ValueError(f"{m}: an extraction by specdraft {man.get('specdraft_version', '?')}, from before "
                                 f"shards were bound to their extraction: {REEXTRACT}")  # fmt: skip
            man["_dir"] = str(d)
            manifests.append(man)
    _check_one_extraction(manifests)
    return manifests


def read_manifest(path: Path, fix: str) -> dict:
    """An extraction manifest (`read_state`); one that records none of its kind, the specdraft that wrote it and its
    extraction (`{}`, or not extract's) is refused as unreadable, naming it and what it lacks, not dated as an old
    one."""
    man = read_state(path, fix)
    if not {"kind", "specdraft_version", "extraction_id"} & man.keys():
        read_state(path, fix, ("kind", "extraction_id"))
    return man


def manifest_problems(paths) -> list[str]:
    """Why the extraction directories' manifests cannot be read (none there, unreadable, another extraction's),
    each with its fix: a command reads them before it writes anything."""
    try:
        _read_manifests(paths)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    return []


def numbers_identity(man: dict) -> dict:
    """What makes an extraction process's numbers (the same for every process of one extraction): the
    target's config and weight fingerprint, layers, compute and store dtypes, backend, dataset, process split.
    Manifests from before the identity held the compute dtype and backend give them from their top level."""
    ident = {
        k: v for k, v in man.get("identity", {}).items() if k not in ("shard_index", "samples_per_shard")
    }
    ident.setdefault("compute_dtype", man.get("compute_dtype"))
    ident.setdefault("backend", (man.get("engine") or {}).get("backend"))
    ident.setdefault("target_config_hash", (man.get("target") or {}).get("config_hash"))
    for k in ("layer_ids", "dtype", "dataset_hash", "num_shards", "num_samples"):
        ident.setdefault(k, man.get(k))
    return ident


def _check_one_extraction(manifests: list[dict]) -> None:
    """Refuse manifests of different extractions, in any order: the processes whose identity is not the one
    most of them share (the first listed on a tie) are named with each field that differs."""
    idents = [numbers_identity(m) for m in manifests]
    ref = max(idents, key=idents.count)
    ref_dir = manifests[idents.index(ref)]["_dir"]
    for man, ident in zip(manifests, idents):
        diff = [f"{k} {ident.get(k)} there, {ref.get(k)} in {ref_dir}" for k in sorted(set(ident) | set(ref))
                if ident.get(k) != ref.get(k)]  # fmt: skip
        if diff:
            raise ValueError(
                f"{man['_dir']} (process {man.get('shard_index')}) was extracted with other settings than "
                f"{ref_dir}: {'; '.join(diff)}: these are not one extraction; extract that process again into a "
                "new directory with the target, --layers, --dtype, --backend and --num-shards of the others"
            )


def _manifest_sidecars(man: dict, problems: list) -> list[tuple[Path, Path]]:
    """(sidecar, shard path) of one manifest's shards; a complete extraction's missing ones are problems."""
    d = Path(man["_dir"])
    found = {sc.name: sc for sc in d.glob(f"shard-{man['shard_index']:05d}-*.json")}
    if man.get("complete") and "num_planned_shards" in man:
        for k in range(man["num_planned_shards"]):
            stem = shard_stem(man["shard_index"], k)
            if f"{stem}.json" not in found:
                problems.append((d / f"{stem}.safetensors", ShardError(d / f"{stem}.json", "sidecar missing "
                                 f"(the manifest lists {man['num_planned_shards']} shards)", LOST)))  # fmt: skip
    return [(sc, sc.with_suffix(".safetensors")) for _, sc in sorted(found.items())]


def _size_problems(path: Path, side: dict) -> list[ShardError]:
    """A missing shard file or one whose size is not the sidecar's."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [ShardError(path, f"shard file missing (its sidecar lists {len(side['samples'])} samples)",
                           f"{REDO}, or train with --skip-bad to leave its samples out")]  # fmt: skip
    if size != side["bytes"]:
        return [ShardError(path, f"size {size} != {side['bytes']} recorded (truncated or partly written)")]
    return []


def _expected(sid: int, T: int, n_layers: int, hidden: int, dtype: str) -> dict:
    """Tensor name -> (shape, dtype) of one stored sample."""
    want = {
        f"{sid}.input_ids": ((T,), torch.int32),
        f"{sid}.loss_mask": ((T,), torch.uint8),
        f"{sid}.hidden": ((T, n_layers, hidden), fp8.FP8 if dtype == "fp8" else DTYPES[dtype]),
    }
    if dtype == "fp8":
        want[f"{sid}.hidden_scale"] = ((T, n_layers), torch.float32)
    return want


def _checked_sample(path: Path, f, names: set, sid: int, want: dict) -> dict[str, torch.Tensor]:
    """Read one sample's tensors from an open shard, refusing wrong names, shapes, dtypes or values."""
    got = {}
    for name, (shape, dt) in want.items():
        if name not in names:
            raise ShardError(path, f"tensor {name} missing")
        t = f.get_tensor(name)
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ShardError(path, f"{name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dt}")
        got[name.split(".", 1)[1]] = t
    hidden = got["hidden"]
    if "hidden_scale" in got:
        hidden = fp8.decode(hidden, got["hidden_scale"])  # (T, n, H) float32
    if not torch.isfinite(hidden).all():
        raise ShardError(
            path, f"{sid}.hidden has {int((~torch.isfinite(hidden)).sum())} non-finite values",
            "its checksum matches, so the target produced them: extract again into a new --out with a wider "
            "--dtype (bfloat16 or float32, not float16), or train with --skip-bad to leave this shard out",
        )  # fmt: skip
    return {"input_ids": got["input_ids"].long(), "loss_mask": got["loss_mask"], "hidden": hidden}


def verify(paths: list[str] | str, deep: bool = True) -> list[str]:
    """Check shards against their manifests and sidecars; returns every problem found (empty: all good).

    Checks: every sample of the dataset present exactly once across all processes' outputs; every shard
    of a complete extraction present and bound to it (no shard of another extraction, none renamed); the
    prepared dataset unchanged since; each shard's size and sha256; per sample the tensor names, shapes
    (T matches, n_layers and H match the manifest), dtypes, and finite values (deep=True reads every
    tensor; the first problem of a shard is reported).
    """
    try:
        ss, scanned = ShardSet._scan(paths)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    problems = [f"{e.path.name}: {e.problem}" for _, e in scanned]
    dataset = ss.dataset_problem()
    if dataset is not None:
        problems.append(str(dataset))
    man = ss.manifest
    missing = ss.missing_samples()
    extra = sorted(set(ss.sample_ids()) - set(range(man["num_samples"])))
    absent = ss.absent_processes()
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
    known = {p for p, _ in scanned}
    for path in sorted(set(ss._sidecars) - known):
        problems += [f"{e.path.name}: {e.problem}" for e in ss._check_shard(path, deep)]
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

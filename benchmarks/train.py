"""Training throughput of the EAGLE-3 draft: tokens/s and the share of step time spent loading data.

    python benchmarks/train.py SHARDS [--steps 12] [--configs default,quick] [--no-prefetch-too]

SHARDS is an extraction directory (`specdraft extract`, e.g. of the embedded default on ShareGPT). Each
configuration trains `--steps` optimizer steps from scratch in a temp dir and reports, from the
trainer's own metrics (first step dropped as warm-up): median tokens/s, the share of step time spent
waiting for data (goal: < 5%), and the achieved GFLOP/s against the draft's estimated training FLOPs.

Configurations:
  default : the library defaults (draft vocabulary 32000, 7 TTT steps), as on GPU
  quick   : draft vocabulary 8192, 3 TTT steps (what a short CPU run can afford)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from specdraft.model.checkpoint import load_draft_config
from specdraft.model.draft import flops_per_token as draft_flops
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

CONFIGS = {
    "default": {"draft_vocab_size": 32000, "ttt_steps": 7},
    "quick": {"draft_vocab_size": 8192, "ttt_steps": 3},
}


def bench(shards: str, name: str, steps: int, max_tokens: int, prefetch: bool) -> dict:
    """Train `steps` steps with configuration `name`; summarise the trainer's metrics."""
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
    fpt = draft_flops(dcfg, cfg.ttt_steps)
    return {"config": name, "prefetch": prefetch, "steps": steps, "tokens_per_s": round(tps, 1),
            "data_share": round(share, 4), "gflop_per_token": round(fpt / 1e9, 3),
            "achieved_gflops": round(tps * fpt / 1e9, 1), "wall_s": round(wall, 1)}  # fmt: skip


def main() -> None:
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
    for name in args.configs.split(","):
        for prefetch in (True, False) if args.no_prefetch_too else (True,):
            rows.append(bench(args.shards, name, args.steps, args.max_tokens, prefetch))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'config':8} {'prefetch':8} {'tok/s':>8} {'data %':>7} {'GFLOP/tok':>9} {'GFLOP/s':>8}")
    for r in rows:
        print(f"{r['config']:8} {r['prefetch']!s:8} {r['tokens_per_s']:8.1f} {100 * r['data_share']:6.2f}% "
              f"{r['gflop_per_token']:9.3f} {r['achieved_gflops']:8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Online training through vLLM against offline training from shards, side by side, on the embedded default.

    python benchmarks/online.py [--samples 64] [--max-length 512] [--steps 0] [--depths 1,2] [--out DIR]

The same prepared ShareGPT conversations train the same draft (seed 0, the small-run recipe: draft vocabulary
8192, 3 TTT steps, 512 tokens a step) four ways in one run:

- offline: `extract` through vLLM (float32 shards) then `train` from the shards: both times, and the train's
  tokens/s alone;
- online through vLLM with the capture queued `--prefetch-depth` batches ahead (each of `--depths`), and with
  no background thread (`--no-prefetch`): the capture and the step strictly alternate.

Each row: wall seconds (engine start included online), training tokens/s over the run, the share of the run
the trainer waited on the data (the target, online), and the share the loader (the target) waited on the
trainer, from the trainer's own metrics. Prints a table and writes it as JSON beside the runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ablate import conversations  # benchmarks/ablate.py, beside this script

from specdraft.capture.extract import extract
from specdraft.data.prepare import prepare
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

BASE = dict(draft_vocab_size=8192, ttt_steps=3, max_tokens=512, lr=1e-3, schedule="constant", val_fraction=0.0,
            checkpoint_every=10**6, progress=False, tensorboard=False, seed=0)  # fmt: skip


def summary(run: Path, wall: float, name: str) -> dict:
    """Tokens/s and the wait shares of a finished run, from its metrics (time-weighted over its records)."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    tr = [r for r in recs if r["split"] == "train"]
    secs = [r["tokens"] / max(r["tokens_per_s"], 1e-9) for r in tr]  # each record's seconds (log_every 1)
    total = sum(secs)
    return {"run": name, "steps": tr[-1]["step"], "tokens": sum(r["tokens"] for r in tr), "wall_s": round(wall, 1),
            "train_tok_s": round(sum(r["tokens"] for r in tr) / max(total, 1e-9), 1),
            "trainer_wait": round(sum(r["data_share"] * s for r, s in zip(tr, secs)) / max(total, 1e-9), 3),
            "loader_idle": round(sum(r.get("loader_idle_share", 0) * s for r, s in zip(tr, secs)) / max(total, 1e-9), 3)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--steps", type=int, default=0, help="stop each run after N steps (0: one epoch)")
    p.add_argument("--depths", default="1,2", help="--prefetch-depth values of the online runs")
    p.add_argument("--out", default="")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        convs = conversations(root / "conversations.jsonl", a.samples, 2)
        ds = prepare(str(convs), str(root / "dataset"), max_length=a.max_length, overwrite=True)
        base = TrainConfig(**BASE, max_length=a.max_length, max_steps=a.steps)
        rows = []
        t0 = time.time()
        hs = extract(str(ds), str(root / "shards"), backend="vllm", store_dtype="float32", skip_doctor=True)
        t_ext = time.time() - t0
        t0 = time.time()
        train(str(hs), str(root / "offline"), base)
        rows.append(
            {**summary(root / "offline", time.time() - t0, "offline (shards)"), "extract_s": round(t_ext, 1)}
        )
        online = TrainConfig(**{**base.__dict__, "online": True, "backend": "vllm"})
        arms = [(f"online vllm, depth {d}", {"prefetch_depth": int(d)}) for d in a.depths.split(",")]
        for name, change in [*arms, ("online vllm, no prefetch", {"prefetch": False})]:
            out = root / name.replace(" ", "_").replace(",", "")
            t0 = time.time()
            train(str(ds), str(out), TrainConfig(**{**online.__dict__, **change}))
            rows.append(summary(out, time.time() - t0, name))
            print(json.dumps(rows[-1]), flush=True)
        (root / "online_vs_offline.json").write_text(json.dumps(rows, indent=1))
    off = rows[0]
    print(f"\nembedded default, {a.samples} ShareGPT conversations (<= {a.max_length} tokens), one epoch each; "
          f"offline extraction through vLLM: {off['extract_s']} s")  # fmt: skip
    print(f"{'run':<28}{'steps':>6}{'wall s':>8}{'train tok/s':>12}{'x offline':>10}{'trainer waits':>14}"
          f"{'target waits':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['run']:<28}{r['steps']:>6}{r['wall_s']:>8}{r['train_tok_s']:>12}"
              f"{r['train_tok_s'] / off['train_tok_s']:>10.2f}{r['trainer_wait']:>14.0%}{r['loader_idle']:>13.0%}")  # fmt: skip
    print(f"offline end to end (extract + train): {off['extract_s'] + off['wall_s']:.1f} s")


if __name__ == "__main__":
    main()

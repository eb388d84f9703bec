"""The lossless check over every MT-bench first turn, with a briefly trained draft on the embedded default.

    python benchmarks/lossless.py [--prompts 80] [--samples 48] [--new-tokens 32] [--k 3] [--out DIR]

Trains a draft as the test does (48 ShareGPT conversations, two epochs at lr 3e-3), then decodes each prompt with
the reference decoder, greedy, with and without the draft: prints the divergences (0 is lossless), tau, the
acceptance per position and the histogram of accepted drafts per round. ~12 min for the 80 first turns on 2 cores;
CI runs the same check on one first turn per category
(tests/test_evaluate.py::test_lossless_on_mtbench_first_turns_with_acceptance_and_rejection).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from specdraft.capture.extract import extract
from specdraft.data.prepare import prepare
from specdraft.eval.reference import evaluate_report
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=80, help="MT-bench first turns (80: all)")
    ap.add_argument("--samples", type=int, default=48, help="ShareGPT conversations the draft trains on")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--out", default="", help="working directory (default: a temporary one)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="lossless-"))
    t0 = time.perf_counter()
    ds = prepare("sharegpt", str(out / "ds"), max_length=256, max_samples=args.samples)
    shards = extract(str(ds), str(out / "x"), samples_per_shard=16, skip_doctor=True)
    cfg = TrainConfig(draft_vocab_size=4096, ttt_steps=3, epochs=2, lr=3e-3, max_tokens=2048, val_fraction=0.0,
                      progress=False, tensorboard=False, recipe="off")  # fmt: skip
    final = train(str(shards), str(out / "run"), cfg)
    t1 = time.perf_counter()
    rep = evaluate_report([str(final)], max_prompts=args.prompts, max_new_tokens=args.new_tokens, k=args.k,
                          out=str(out / "eval"), progress=True)  # fmt: skip
    d = rep["drafts"][str(final)]
    print(json.dumps({
        "prompts": rep["settings"]["prompts"],
        "divergences": len(d["lossless"]["divergences"]),
        "lossless": d["lossless"]["ok"],
        "tau": d["tau"],
        "acceptance_rate_per_position": d["acceptance_rate_per_position"],
        "accepted_histogram": d["accepted_histogram"],
        "train_s": round(t1 - t0, 1),
        "eval_s": round(time.perf_counter() - t1, 1),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

"""DFlash against EAGLE-3 on the same data and target, in the reference decoder: tau, acceptance per position,
the cost of a round.

    python benchmarks/dflash.py [--samples 48] [--max-length 256] [--epochs 1] [--block-size 8]
                                [--draft-layers 1] [--prompts 4] [--max-new-tokens 48] [--out DIR]

One prepared ShareGPT set for the embedded default target (smollm2-135m, 30 layers), extracted twice: with
EAGLE-3's default aux layers (2, 15, 27) and with DFlash's (`--dflash-layers`, default 5 spread over the
depth). Both drafts train one run each with the same optimizer settings (lr 1e-3, 2048 tokens a step,
cosine, draft vocabulary 4096, seed 0); EAGLE-3 with 3 TTT steps. Both decode the same MT-bench first turns
greedily with target-only decoding as the baseline; the EAGLE-3 chain drafts k = block_size - 1 tokens a
round, as many as the DFlash block. Per draft: tau, P(accepted >= j) per draft position j, the draft's and
the target's seconds per round, tokens/s against the baseline, and whether every output equals the
baseline's. An `--out` kept from an earlier run reuses its data and drafts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specdraft.capture.extract import extract
from specdraft.data.prepare import prepare
from specdraft.decode.block import BlockSpeculator
from specdraft.decode.speculate import SpecConfig, Speculator
from specdraft.eval.prompts import load_prompts, render_prompt
from specdraft.eval.reference import load_eval_draft
from specdraft.model.dflash_files import load_dflash
from specdraft.targets import load_target, stop_ids
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

TARGET = "smollm2-135m"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--dflash-layers", default="1,8,15,22,28")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="runs/bench-dflash")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.time()
    ds = out / "ds"
    if not (ds / "manifest.json").exists():
        prepare("sharegpt", str(ds), target=TARGET, max_length=args.max_length, max_samples=args.samples)
    layers = {"eagle3": None, "dflash": [int(x) for x in args.dflash_layers.split(",")]}
    shards = {}
    for name, ids in layers.items():
        shards[name] = out / f"shards-{name}"
        if not list(shards[name].glob("manifest-*.json")):
            extract(str(ds), str(shards[name]), target=TARGET, layers=ids, samples_per_shard=16,
                    max_tokens_per_batch=2048, skip_doctor=True)  # fmt: skip
    common = dict(draft_vocab_size=4096, lr=1e-3, max_tokens=2048, schedule="cosine", epochs=args.epochs,
                  max_length=args.max_length, val_fraction=0.05, checkpoint_every=10**6, recipe="off",
                  progress=False, tensorboard=False, seed=0)  # fmt: skip
    runs = {
        "eagle3": TrainConfig(**common, ttt_steps=3),
        "dflash": TrainConfig(
            **common, draft="dflash", block_size=args.block_size, draft_layers=args.draft_layers, anchors=64
        ),  # fmt: skip
    }
    train_s = {}
    for name, cfg in runs.items():
        d = out / f"train-{name}"
        if not (d / "final" / "config.json").exists():
            t = time.time()
            train(str(shards[name]), str(d), cfg)
            train_s[name] = time.time() - t
    print(f"data and training: {time.time() - t0:.0f}s {train_s}", flush=True)

    tgt = load_target(TARGET)
    stops = stop_ids(tgt.tokenizer, getattr(tgt.model, "generation_config", None))
    prompts = [render_prompt(tgt.tokenizer, [p.turns[0]], []) for p in load_prompts("mtbench", args.prompts)]
    k = args.block_size - 1
    specs = {
        "eagle3": Speculator(tgt, load_eval_draft(str(out / "train-eagle3"), tgt)),
        "dflash": BlockSpeculator(tgt, load_dflash(out / "train-dflash" / "final")),
    }
    cfg = SpecConfig(k=k, max_new_tokens=args.max_new_tokens, stop_ids=stops)
    for sp in specs.values():  # warm-up
        sp.generate(prompts[0], SpecConfig(k=k, max_new_tokens=4))
    stats = {
        n: {"tok": 0, "sec": 0.0, "acc": [], "draft": 0.0, "verify": 0.0, "ok": True}
        for n in ["target", *specs]
    }
    for ids in prompts:
        base = specs["eagle3"].baseline(ids, cfg)
        stats["target"]["tok"] += len(base.tokens)
        stats["target"]["sec"] += base.seconds
        for name, sp in specs.items():
            r = sp.generate(ids, cfg)
            s = stats[name]
            s["tok"] += len(r.tokens)
            s["sec"] += r.seconds
            s["acc"] += r.accepted
            s["draft"] += r.draft_seconds
            s["verify"] += r.verify_seconds
            s["ok"] &= r.tokens == base.tokens
    for sp in specs.values():
        sp.close()
    base_tps = stats["target"]["tok"] / stats["target"]["sec"]
    print(f"\n{TARGET}, {args.samples} ShareGPT conversations <= {args.max_length} tokens, {args.epochs} epoch(s); "
          f"{len(prompts)} MT-bench first turns, {args.max_new_tokens} new tokens, greedy, {k} draft tokens a round, "
          f"{torch.get_num_threads()} threads\n")  # fmt: skip
    pos = " ".join(f"j={j}" for j in range(1, k + 1))
    print(
        f"| draft | tau | P(accepted >= j), {pos} | draft ms/round | verify ms/round | tok/s vs target | lossless |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in specs:
        s = stats[name]
        n = max(len(s["acc"]), 1)
        tau = sum(s["acc"]) / n + 1
        per = " ".join(f"{sum(a >= j for a in s['acc']) / n:.2f}" for j in range(1, k + 1))
        tps = s["tok"] / s["sec"]
        print(f"| {name} | {tau:.2f} | {per} | {1e3 * s['draft'] / n:.1f} | {1e3 * s['verify'] / n:.1f} | "
              f"{tps / base_tps:.2f}x | {'yes' if s['ok'] else 'NO'} |")  # fmt: skip
    print(f"\ntotal {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

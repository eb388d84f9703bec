"""DFlash against EAGLE-3 on the same data and target, in the reference decoder: tau, acceptance per position,
the cost of a round.

    python benchmarks/dflash.py [--samples 48] [--max-length 256] [--epochs 1] [--max-tokens 2048]
                                [--lr 1e-3] [--schedule cosine] [--anchors 64] [--block-size 8]
                                [--draft-layers 1] [--sweep 4x1,8x1,4x2,8x2] [--dflash-epochs N]
                                [--dflash-layers 1,8,15,22,28] [--prompts 4] [--max-new-tokens 48]
                                [--threads N] [--train-samples N] [--draft-vocab-size 4096]
                                [--eagle-recipe] [--dflash-losses ce,kl] [--position-weights exp,dpace]
                                [--seed 0] [--out DIR]

One prepared ShareGPT set for the embedded default target (smollm2-135m, 30 layers), extracted with EAGLE-3's
default aux layers (2, 15, 27) and with DFlash's (`--dflash-layers`, default 5 spread over the depth;
`--dflash-layers 2,15,27` reads EAGLE-3's and the one extraction serves both). Both drafts train with the same
optimizer settings (`--lr`, `--max-tokens` a step, `--schedule`, `--epochs`, draft vocabulary 4096, `--seed`;
the library's settings, `--recipe off`); EAGLE-3 with 3 TTT steps, DFlash with `--anchors` blocks a sequence a
step. `--dflash-epochs N` trains DFlash for N epochs instead (its rows and directories say eN), the other
optimizer settings kept. `--train-samples N` trains on the first N prepared samples only (a point of the data
curve from one extraction: prepare and extract the largest point once, `--samples`); `--eagle-recipe` trains
EAGLE-3 with the small-run recipe on top (the settings the quickstart and `train` use at this size), DFlash with
`--lr`/`--max-tokens`/`--schedule` (pass the recipe's 1e-3, 512, constant for the same optimizer). `--sweep BxL,...` trains one DFlash draft per block size B and draft layer count L
(instead of `--block-size`/`--draft-layers`); `--dflash-losses` and `--position-weights` (comma-separated) train
each of those once per loss (`ce`, DFlash's own, or a soft loss against the target's distribution: `kl`, `lk`,
`0.5*ce+0.5*kl`, ...) and slot weighting (`exp`, DFlash's own, or `dpace`). All decode the same MT-bench first turns greedily, target-only
decoding once per prompt as the baseline; a DFlash draft of block B drafts B - 1 tokens a round, and EAGLE-3's
chain is run at each such k, as many as the block. Per draft: its validation accuracy per step/slot, training
time, tau, P(accepted >= j) per draft position j, the draft's and the target's milliseconds per round,
tokens/s against the baseline, and whether every output equals the baseline's; the machine's load (`uptime`)
is printed with the table, since times are not comparable across loads. An `--out` kept from an earlier run
reuses its data and drafts (a draft's directory names its block, layers and anchors; the data and optimizer
settings are the `--out`'s: use another `--out` for others). `--threads 1` keeps torch from spinning on cores
other processes hold (on a loaded 2-core machine 2 threads ran the target ~4x slower than 1). Nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
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
from specdraft.train.config import SMALL_RUN, TrainConfig
from specdraft.train.loop import train

TARGET = "smollm2-135m"


def _load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _val(train_dir: Path) -> str:
    """Validation accuracy per TTT step (EAGLE-3) or block slot (DFlash, with its block tau) of a run's final."""
    cfg = json.loads((train_dir / "final" / "config.json").read_text())
    val = (cfg.get("train") or {}).get("val") or {}
    acc = " ".join("-" if a is None else f"{a:.2f}" for a in val.get("acc", []))
    return f"{acc} (tau {val['tau']:.2f})" if "tau" in val else acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=2048, help="tokens a step, both drafts")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--schedule", default="cosine")
    ap.add_argument("--anchors", type=int, default=64, help="DFlash blocks sampled per sequence per step")
    ap.add_argument("--dflash-epochs", type=int, default=0, help="DFlash's epochs, when not --epochs (0)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument(
        "--sweep", default="", help="DFlash drafts BxL,... (block x layers), e.g. 4x1,8x1,4x2,8x2"
    )
    ap.add_argument("--dflash-layers", default="1,8,15,22,28")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--train-samples", type=int, default=0, help="train on the first N samples (0: all)")
    ap.add_argument(
        "--seed", type=int, default=0, help="every draft's seed (init, data order, anchors, held-out)"
    )
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument(
        "--eagle-recipe",
        action="store_true",
        help="EAGLE-3 with the small-run recipe on top (the quickstart's settings), DFlash without",
    )
    ap.add_argument("--dflash-losses", default="ce", help="DFlash losses, comma-separated (ce, kl, lk, ...)")
    ap.add_argument(
        "--position-weights", default="exp", help="DFlash slot weights, comma-separated (exp, dpace)"
    )
    ap.add_argument("--out", default="runs/bench-dflash")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = (
        [tuple(int(x) for x in v.split("x")) for v in args.sweep.split(",") if v]
        if args.sweep
        else [(args.block_size, args.draft_layers)]
    )
    out = Path(args.out)
    t0 = time.time()
    print(f"start: {_load()}", flush=True)
    ds = out / "ds"
    if not (ds / "manifest.json").exists():
        prepare("sharegpt", str(ds), target=TARGET, max_length=args.max_length, max_samples=args.samples)
    shards = {"eagle3": out / "shards-eagle3"}
    dflash_ids = [int(x) for x in args.dflash_layers.split(",")]
    for name, ids in (("eagle3", None), ("dflash", dflash_ids)):
        if name == "dflash":  # EAGLE-3's own aux layers: the same shards serve both (one extraction)
            man = json.loads(next(shards["eagle3"].glob("manifest-*.json")).read_text())
            if list(man["layer_ids"])[:-1] == ids:
                shards["dflash"] = shards["eagle3"]
                continue
        shards[name] = out / f"shards-{name}"
        if not list(shards[name].glob("manifest-*.json")):
            t = time.time()
            extract(str(ds), str(shards[name]), target=TARGET, layers=ids, samples_per_shard=16,
                    max_tokens_per_batch=2048, skip_doctor=True)  # fmt: skip
            print(f"extract {name}: {time.time() - t:.0f}s ({_load()})", flush=True)
    # a point of the data curve, another vocabulary or recipe: their own directories (same --out, same extraction)
    sfx = (f"-n{args.train_samples}" if args.train_samples else "") + (
        f"-v{args.draft_vocab_size}" if args.draft_vocab_size != 4096 else "")  # fmt: skip
    sfx += f"-s{args.seed}" if args.seed else ""  # another seed: its own drafts
    common = dict(draft_vocab_size=args.draft_vocab_size, max_samples=args.train_samples, lr=args.lr, max_tokens=args.max_tokens, schedule=args.schedule,
                  epochs=args.epochs, max_length=args.max_length, val_fraction=0.05, checkpoint_every=10**6,
                  recipe="off", progress=False, tensorboard=False, seed=args.seed)  # fmt: skip
    recipe = SMALL_RUN if args.eagle_recipe else {}
    eagle_cfg = TrainConfig(**{**common, **recipe}, ttt_steps=3)
    runs = {"eagle3": (out / f"train-eagle3{sfx}{'-recipe' if recipe else ''}", shards["eagle3"], eagle_cfg)}
    ep = args.dflash_epochs or args.epochs
    tag = f" e{ep}" if ep != args.epochs else ""  # DFlash trained for other epochs than EAGLE-3
    dflash_rows = []  # (row name, block size)
    for (b, n), loss, pw in itertools.product(
        variants, args.dflash_losses.split(","), args.position_weights.split(",")
    ):
        cfg = TrainConfig(**{**common, "epochs": ep}, draft="dflash", block_size=b, draft_layers=n,
                          anchors=args.anchors, loss=loss, position_weights=pw)  # fmt: skip
        obj = ("" if loss == "ce" else f"-{loss}") + (
            "" if pw == "exp" else f"-{pw}"
        )  # DFlash's own: no suffix
        d = out / f"train-dflash-b{b}-l{n}-a{args.anchors}{tag.replace(' ', '-')}{sfx}{obj}"
        name = (
            f"dflash b{b} l{n}{tag}"
            + (f" {loss}" if loss != "ce" else "")
            + (f" {pw}" if pw != "exp" else "")
        )
        runs[name] = (d, shards["dflash"], cfg)
        dflash_rows.append((name, b))
    train_s = {}
    for name, (d, sh, cfg) in runs.items():
        meta = d / "bench-train.json"
        if not (d / "final" / "config.json").exists():
            t = time.time()
            train(str(sh), str(d), cfg)
            meta.write_text(json.dumps({"seconds": time.time() - t, "load": _load()}))
            print(f"train {name}: {time.time() - t:.0f}s ({_load()})", flush=True)
        train_s[name] = json.loads(meta.read_text())["seconds"] if meta.exists() else float("nan")
    print(f"data and training: {time.time() - t0:.0f}s", flush=True)

    tgt = load_target(TARGET)
    stops = stop_ids(tgt.tokenizer, getattr(tgt.model, "generation_config", None))
    prompts = [render_prompt(tgt.tokenizer, [p.turns[0]], []) for p in load_prompts("mtbench", args.prompts)]
    eagle = Speculator(tgt, load_eval_draft(str(runs["eagle3"][0]), tgt))
    # (row name, speculator, k, training run)
    rows = [(f"eagle3 k={k}", eagle, k, "eagle3") for k in sorted({b - 1 for b, _ in variants})]
    for name, b in dflash_rows:
        rows.append((name, BlockSpeculator(tgt, load_dflash(runs[name][0] / "final")), b - 1, name))
    for _, sp, k, _ in rows:  # warm-up
        sp.generate(prompts[0], SpecConfig(k=k, max_new_tokens=4))
    stats = {r[0]: {"tok": 0, "sec": 0.0, "acc": [], "draft": 0.0, "verify": 0.0, "ok": True} for r in rows}
    base_tok, base_sec = 0, 0.0
    load_before = _load()
    for ids in prompts:
        base = eagle.baseline(ids, SpecConfig(k=1, max_new_tokens=args.max_new_tokens, stop_ids=stops))
        base_tok += len(base.tokens)
        base_sec += base.seconds
        for name, sp, k, _ in rows:
            r = sp.generate(ids, SpecConfig(k=k, max_new_tokens=args.max_new_tokens, stop_ids=stops))
            s = stats[name]
            s["tok"] += len(r.tokens)
            s["sec"] += r.seconds
            s["acc"] += r.accepted
            s["draft"] += r.draft_seconds
            s["verify"] += r.verify_seconds
            s["ok"] &= r.tokens == base.tokens
    for sp in {id(r[1]): r[1] for r in rows}.values():
        sp.close()
    base_tps = base_tok / base_sec
    kmax = max(r[2] for r in rows)
    used = f"the first {args.train_samples} of " if args.train_samples else ""
    opt = f"lr {args.lr:g}, {args.max_tokens} tokens a step, {args.schedule}, vocabulary {args.draft_vocab_size}"
    eag = f"EAGLE-3: {args.epochs} epoch(s), the small-run recipe (the quickstart's settings)" if recipe else (
        f"EAGLE-3: {args.epochs} epoch(s), {opt}")  # fmt: skip
    print(f"\n{TARGET}, {used}{args.samples} ShareGPT conversations <= {args.max_length} tokens; {eag}; DFlash: "
          f"{ep} epoch(s), {opt}, {args.anchors} anchors a sequence, layers {args.dflash_layers}; {len(prompts)} "
          f"MT-bench first turns, {args.max_new_tokens} new tokens, greedy; target alone "
          f"{1e3 * base_sec / max(base_tok, 1):.1f} ms/token; {torch.get_num_threads()} threads")  # fmt: skip
    print(f"load before decoding: {load_before}\nload after decoding:  {_load()}\n")
    print(f"| draft | val acc per step/slot | train s | tau | P(accepted >= j), j = 1..{kmax} | draft ms/round | "
          "verify ms/round | tok/s vs target | lossless |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, _, k, run in rows:
        s = stats[name]
        n = max(len(s["acc"]), 1)
        tau = sum(s["acc"]) / n + 1
        per = " ".join(f"{sum(a >= j for a in s['acc']) / n:.2f}" for j in range(1, k + 1))
        tps = s["tok"] / s["sec"]
        print(f"| {name} | {_val(runs[run][0])} | {train_s[run]:.0f} | {tau:.2f} | {per} | "
              f"{1e3 * s['draft'] / n:.1f} | {1e3 * s['verify'] / n:.1f} | {tps / base_tps:.2f}x | "
              f"{'yes' if s['ok'] else 'NO'} |")  # fmt: skip
    print(f"\ntotal {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

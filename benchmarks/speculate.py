"""Speculative decoding on the embedded default: tau and tokens/s per drafting setting, in one run.

    python benchmarks/speculate.py [--draft runs/quickstart/train] [--prompts 4] [--max-new-tokens 48]
                                   [--threads 2]

Settings: chain k = 1..7 and a few dynamic trees (topk/depth/budget), each on the same MT-bench first turns
(greedy), with target-only decoding as the baseline (measured interleaved, prompt by prompt, so machine
noise hits all settings alike; only the ratios are meaningful on a shared machine). Prints tau, tokens/s,
speedup vs the baseline and whether every output equals the baseline's token for token.

Without --draft an untrained draft is used: its tau is ~1, so every setting is slower than the baseline
(the numbers then show the cost of drafting + verifying, the overhead a trained draft must beat).
"""

from __future__ import annotations

import argparse
import time

import torch

from specdraft.decode.speculate import SpecConfig, Speculator
from specdraft.eval.prompts import load_prompts, render_prompt
from specdraft.eval.reference import UNTRAINED, load_eval_draft
from specdraft.eval.stats import tau_of
from specdraft.targets import load_target, stop_ids

TREES = [(4, 4, 12), (8, 5, 24), (10, 6, 48)]  # (topk, depth, budget)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default=UNTRAINED, help="train output / saved draft dir, or `untrained`")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4, help="MT-bench first turns")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--draft-vocab-size", type=int, default=32000, help="untrained draft only")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--max-k", type=int, default=7)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.time()
    tgt = load_target(args.target)
    draft = load_eval_draft(args.draft, tgt, draft_vocab_size=args.draft_vocab_size)
    sp = Speculator(tgt, draft)
    stops = stop_ids(tgt.tokenizer, getattr(tgt.model, "generation_config", None))
    prompts = [render_prompt(tgt.tokenizer, [p.turns[0]], []) for p in load_prompts("mtbench", args.prompts)]
    settings = {f"chain k={k}": SpecConfig(k=k, max_new_tokens=args.max_new_tokens, stop_ids=stops)
                for k in range(1, args.max_k + 1)}  # fmt: skip
    for tk, d, b in TREES:
        settings[f"tree topk={tk} depth={d} budget={b}"] = SpecConfig(
            tree=True, topk=tk, depth=d, budget=b, max_new_tokens=args.max_new_tokens, stop_ids=stops
        )
    base_cfg = SpecConfig(max_new_tokens=args.max_new_tokens, stop_ids=stops)
    warm = SpecConfig(k=2, max_new_tokens=4)
    sp.baseline(prompts[0], warm)
    sp.generate(prompts[0], warm)

    stats = {name: {"tok": 0, "sec": 0.0, "acc": [], "ok": True} for name in ["target only", *settings]}
    for i, ids in enumerate(prompts):
        base = sp.baseline(ids, base_cfg)
        s = stats["target only"]
        s["tok"] += len(base.tokens)
        s["sec"] += base.seconds
        for name, cfg in settings.items():
            r = sp.generate(ids, cfg)
            s = stats[name]
            s["tok"] += len(r.tokens)
            s["sec"] += r.seconds
            s["acc"] += r.accepted
            s["ok"] &= r.tokens == base.tokens
        print(f"prompt {i + 1}/{len(prompts)} done ({time.time() - t0:.0f}s)", flush=True)
    sp.close()

    base_tps = stats["target only"]["tok"] / stats["target only"]["sec"]
    print(f"\ntarget {args.target}, draft {args.draft} (vocab {draft.cfg.draft_vocab_size}), {len(prompts)} MT-bench "
          f"first turns, {args.max_new_tokens} new tokens, greedy, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'setting':36s} {'tau':>6s} {'tok/s':>8s} {'vs target':>9s} {'lossless':>8s}")
    for name, s in stats.items():
        tps = s["tok"] / s["sec"]
        tau = tau_of(s["acc"])
        print(f"{name:36s} {tau:6.3f} {tps:8.2f} {tps / base_tps:8.3f}x {'yes' if s['ok'] else 'NO':>8s}")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

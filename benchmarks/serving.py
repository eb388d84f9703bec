"""Which k serves best here: one exported draft in vLLM at several k, batch 1 and batched, in one run.

    python benchmarks/serving.py EXPORT [--target smollm2-135m] [--ks 1,2,3,5] [--prompts 16]
                                 [--batch1-prompts 8] [--batch1-rounds 3] [--max-new-tokens 64]

For each k the target is served alone and with the draft (`specdraft.eval.serving.evaluate_vllm`, greedy,
lossless-checked) over the first MT-bench first turns: all of them batched, the first `--batch1-prompts` one
at a time. Prints per k: tau, the speed-up batched and at batch 1, and what a round costs in target-only
decoding steps (k draft steps + a (k+1)-token verify); then the k with the best batch-1 speed-up. A speed-up
is about tau / round cost, so a small k wins when the draft's later positions are rarely accepted.

With two or more k, the round costs are fitted as cost(k) = verify + k * draft_step (least squares, in
target steps), which separates what one draft step costs from what the verify costs (the verify's growth
with its k+1 tokens is small at batch 1 and lands in the draft step's share).
"""

from __future__ import annotations

import argparse
import json

from specdraft.eval.serving import evaluate_vllm


def split_round_cost(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (verify, draft_step) of cost(k) = verify + k * draft_step, or None under two distinct k."""
    if len({k for k, _ in points}) < 2:
        return None
    n = len(points)
    mk, mc = sum(k for k, _ in points) / n, sum(c for _, c in points) / n
    step = sum((k - mk) * (c - mc) for k, c in points) / sum((k - mk) ** 2 for k, _ in points)
    return mc - step * mk, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", help="a `specdraft export` directory (speculators or eagle3)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--ks", default="1,2,3,5")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batch1-prompts", type=int, default=8)
    p.add_argument(
        "--batch1-rounds", type=int, default=3, help="batch-1 rounds interleaved with the target alone"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    rows = []
    for k in (int(x) for x in a.ks.split(",")):
        rep = evaluate_vllm([a.export], target=a.target, prompts="mtbench", k=k, max_new_tokens=a.max_new_tokens,
                            max_prompts=a.prompts, batch1_prompts=a.batch1_prompts, batch1_rounds=a.batch1_rounds,
                            progress=False)  # fmt: skip
        d = rep["drafts"][a.export]
        b1 = d["batch1"]
        rows.append({"k": k, "tau": round(d["tau"], 3), "speedup_batched": d["speedup"],
                     "speedup_batch1": b1["speedup"], "round_cost": b1["round_cost_in_target_steps"],
                     "tau_batch1": round(b1["tau"], 3), "lossless": d["lossless"]["ok"],
                     "batch1_tokens_per_s": b1["tokens_per_s"], "batch1_alone_tokens_per_s": b1.get("baseline_tokens_per_s"),
                     "speedup_batch1_per_round": b1.get("speedup_per_round")})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'k':>3}{'tau':>8}{'batched':>9}{'batch 1':>9}{'round cost':>12}  lossless")
    for r in rows:
        print(f"{r['k']:>3}{r['tau']:>8.3f}{r['speedup_batched']:>8.2f}x{r['speedup_batch1']:>8.2f}x"
              f"{r['round_cost']:>12.2f}  {r['lossless']}")  # fmt: skip
    fit = split_round_cost([(r["k"], r["round_cost"]) for r in rows if r["round_cost"] is not None])
    if fit:
        print(f"a round costs {fit[0]:.2f} + {fit[1]:.3f} k target steps: the verify ~{fit[0]:.2f}, "
              f"one draft step ~{fit[1]:.3f} (least squares over k = {a.ks})")  # fmt: skip
    best = max(rows, key=lambda r: r["speedup_batch1"])
    verdict = "faster than" if best["speedup_batch1"] > 1 else "still slower than"
    print(
        f"best at batch 1 on this machine: k={best['k']} (x{best['speedup_batch1']:.2f}, {verdict} the target alone)"
    )


if __name__ == "__main__":
    main()

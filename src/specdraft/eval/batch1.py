"""Batch 1 in vLLM: the first prompts served one at a time, with each draft and alone, and what a round costs.

One batch-1 measurement is the first ``n`` first turns, each alone in the engine (``LLM.generate`` per prompt),
timed. A speed-up divides two such measurements taken minutes apart, in different engines, and on a shared
machine the target alone has run at 11-24 tokens/s from one run to the next (docs/experiments.md): a
measurement taken once per engine reads the machine as much as the draft. So the measurement can be
**interleaved** (``rounds`` > 1): the target alone (A) and every draft (D) are measured in turn, each in a fresh
engine, and the target alone once more at the end,

    A D1 D2 | A D1 D2 | ... | A

so every draft's round r sits between the target's rounds r and r + 1. Its speed-up in round r is its tokens/s
over the mean of those two; the speed-up reported is the median over the rounds, with every round's figure
beside it. The first round is the one each engine's main run already measured.

A round of speculative decoding (k draft steps, or DFlash's one block forward, then one verify of k + 1 tokens)
costs ``round_cost_in_target_steps`` target-only decoding steps, measured the same paired way; the draft pays at
batch 1 when tau, the tokens a round yields, is above it (``break_even_tau``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from specdraft.eval.stats import counter_stats
from specdraft.eval.vllm_engine import VLLMEngine


def measure(eng: VLLMEngine, first_ids: list[list[int]], n: int, max_new_tokens: int, gen_args: dict[str, Any],
            reference: list[list[int]]) -> dict[str, Any]:  # fmt: skip
    """The first ``n`` prompts served one at a time by ``eng``: tokens/s, counters, equal to ``reference``."""
    n = min(n, len(first_ids))
    g = eng.generate(first_ids[:n], max_new_tokens, **{**gen_args, "sequential": True})
    new = sum(len(t) for t in g.tokens)
    out = {"prompts": n, "new_tokens": new, "seconds": round(g.seconds, 3),
           "tokens_per_s": round(new / g.seconds, 3) if g.seconds else 0.0,
           "same_tokens_as_batched": g.tokens == reference[:n]}  # fmt: skip
    if g.counters:
        out["counters"] = g.counters
    return out


def interleave(
    rounds: int, alone: Callable[[], dict[str, Any]], drafts: dict[str, Callable[[], dict[str, Any]]],
    base: list[dict[str, Any]], measured: dict[str, list[dict[str, Any]]], log: Callable[[str], None],
) -> None:  # fmt: skip
    """Rounds 2..``rounds`` after the first (``base`` and ``measured`` hold it), then the target alone once more.

    Args:
        rounds: interleaved rounds in all (1: nothing to add).
        alone: builds the target alone, measures once, drops the engine.
        drafts: the same with each draft, by name.
        base: the target alone's measurements, appended to.
        measured: each draft's measurements, appended to.
        log: a line per round.
    """
    if rounds <= 1:
        return
    for r in range(1, rounds):
        base.append(alone())
        for name, run in drafts.items():
            measured[name].append(run())
        log(f"batch 1, round {r + 1}/{rounds}: alone {base[-1]['tokens_per_s']:.1f} tok/s, "
            + ", ".join(f"{n} {m[-1]['tokens_per_s']:.1f}" for n, m in measured.items()))  # fmt: skip
    base.append(alone())  # the bracket after the last round


def baseline(base: list[dict[str, Any]]) -> dict[str, Any]:
    """The target alone's batch-1 entry: its first measurement's figures, tokens/s the median of all, and all."""
    out = {**base[0], "tokens_per_s": round(statistics.median(b["tokens_per_s"] for b in base), 3)}
    out["same_tokens_as_batched"] = all(b["same_tokens_as_batched"] for b in base)
    if len(base) > 1:
        out["measurements"] = [{k: b[k] for k in ("new_tokens", "seconds", "tokens_per_s")} for b in base]
    return out


def costs(measured: list[dict[str, Any]], base: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """A draft's batch-1 entry from its measurements and the target alone's (one more when interleaved).

    Round r of the draft is compared with the mean of the target alone's measurements r and r + 1 (only r when
    the target has no later one): tokens/s for the speed-up, seconds per new token for one target step.
    """
    assert len(base) in (len(measured), len(measured) + 1), (len(base), len(measured))
    speedups, round_costs, alone_tps = [], [], []
    for r, m in enumerate(measured):
        pair = base[r : r + 2]  # the target alone just before and (interleaved) just after
        a_tps = statistics.fmean(b["tokens_per_s"] for b in pair)
        a_step = statistics.fmean(b["seconds"] / max(b["new_tokens"], 1) for b in pair)  # one target step (s)
        drafted = counter_stats(m.get("counters", {}), k)["rounds"]
        per_round = m["seconds"] / max(drafted, 1)  # a round: the drafting and a (k+1)-token verify (s)
        alone_tps.append(a_tps)
        speedups.append(m["tokens_per_s"] / a_tps if a_tps else 0.0)
        round_costs.append(per_round / a_step if a_step else 0.0)
    st = counter_stats(_summed([m.get("counters", {}) for m in measured]), k)
    cost = statistics.median(round_costs)
    out = {"prompts": measured[0]["prompts"], "new_tokens": sum(m["new_tokens"] for m in measured),
           "seconds": round(sum(m["seconds"] for m in measured), 3),
           "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in measured), 3),
           "baseline_tokens_per_s": round(statistics.median(alone_tps), 3),
           "same_tokens_as_batched": all(m["same_tokens_as_batched"] for m in measured),
           "tau": st["tau"], "rounds": st["rounds"], "speedup": round(statistics.median(speedups), 4),
           "round_cost_in_target_steps": round(cost, 3), "break_even_tau": round(cost, 3)}  # fmt: skip
    if len(measured) > 1:
        out["interleaved_rounds"] = len(measured)
        out["speedup_per_round"] = [round(s, 4) for s in speedups]
        out["round_cost_per_round"] = [round(c, 3) for c in round_costs]
    return out


def _summed(counters: list[dict[str, Any]]) -> dict[str, Any]:
    """Counter snapshots' differences added up (vectors element-wise, the shorter padded with zeros)."""
    total: dict[str, Any] = {}
    for c in counters:
        for name, v in c.items():
            if isinstance(v, list):
                old = total.get(name, [])
                width = max(len(old), len(v))
                total[name] = [
                    a + b for a, b in zip(old + [0] * (width - len(old)), v + [0] * (width - len(v)))
                ]
            else:
                total[name] = total.get(name, 0) + v
    return total

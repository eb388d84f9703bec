"""The figures both evaluations report, defined once: tau, acceptance per position, divergences.

A decoding round drafts up to k tokens and the target accepts a prefix of them; the prefill is not a
round. From the rounds' accepted counts (the reference decoder keeps each one) or from vLLM's spec-decode
counters (totals, plus per position the number of rounds that accepted it) the same figures follow:

  tau                           1 + accepted / rounds: tokens per target forward of a round;
  acceptance_rate_per_position  P(position i accepted | positions 1..i-1 accepted) = reach[i] / reach[i-1],
                                with reach[0] = rounds and reach[i] = rounds accepting at least i tokens
                                (None where reach[i-1] = 0);
  reached_per_position          reach[i] / rounds (what vLLM's log calls "per-position acceptance").

At T > 0, the second half: does speculative sampling keep the target's distribution? A two-sample test, the
same for both engines.

At T = 0 "lossless" is token identity (every eval checks it). At T > 0 an output is a sample, and what the
acceptance rule promises is equality of *distributions*: the law of what is emitted with the draft is the law of
the target sampling alone. So `eval --dist-samples N` draws N continuations of the first ``tokens`` new tokens of
each of a few prompts with the draft, and N from the target alone (independent seeds), and compares them:

  for every prompt and every j in 1..tokens, the law of the first j new tokens (the prefix, one category; a
  sample that stopped earlier is its own shorter prefix) by Pearson's chi-square test of homogeneity on the
  2 x K table of counts. Categories whose pooled count is under ``min_count`` are merged into one "rest" column
  (merged into the smallest kept column when it is itself under ``min_count``), so the chi-square approximation
  holds; a table left with one column says nothing and is not counted.

The family of tests is judged at a family-wise false-alarm rate ``alpha`` (1% by default) with Bonferroni's
bound: the check fails when any p-value is below alpha / (number of tests). A correct decoder fails it with
probability at most ``alpha`` (the bound is conservative: the tests of one prompt are correlated); a decoder that
moves the law of any prefix by a few percent, on prompts whose next tokens are not all rare, fails it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

#: vLLM's spec-decode counters (``LLM.get_metrics()``; collected only with ``disable_log_stats=False``)
COUNTER_NAMES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def tau_of(accepted: Sequence[int]) -> float:
    """Tokens per round: 1 + the mean accepted count (1.0 without rounds)."""
    return 1 + sum(accepted) / len(accepted) if len(accepted) else 1.0


def position_stats(rounds: int, accepted: int, reach: Sequence[int]) -> dict[str, Any]:
    """tau, acceptance and reach per position from totals (the module doc's definitions).

    Args:
        rounds: decoding rounds.
        accepted: draft tokens accepted over all rounds.
        reach: per draft position i = 1..depth, the rounds that accepted at least i tokens.
    """
    r = [rounds, *reach]
    return {
        "rounds": rounds,
        "tau": 1 + accepted / rounds if rounds else 1.0,
        "acceptance_rate_per_position": [r[i] / r[i - 1] if r[i - 1] else None for i in range(1, len(r))],
        "reached_per_position": [n / rounds if rounds else 0.0 for n in reach],
    }


def acceptance_stats(accepted: list[int], max_depth: int) -> dict[str, Any]:
    """The figures from per-round accepted counts (pooled over prompts), with the histogram of counts."""
    a = np.asarray(accepted, dtype=np.int64)
    rounds = int(a.size)
    s = position_stats(rounds, int(a.sum()), [int((a >= i).sum()) for i in range(1, max_depth + 1)])
    s["accepted_histogram"] = np.bincount(a, minlength=max_depth + 1).tolist() if rounds else []
    return s


def counter_stats(counters: dict[str, Any], k: int) -> dict[str, Any]:
    """The figures from vLLM's spec-decode counters (:data:`COUNTER_NAMES`), with the raw totals."""
    drafts = int(counters.get("vllm:spec_decode_num_drafts", 0))
    draft_tokens = int(counters.get("vllm:spec_decode_num_draft_tokens", 0))
    accepted = int(counters.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = list(counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", []))[:k]
    per_pos += [0] * (k - len(per_pos))
    s = position_stats(drafts, accepted, per_pos)
    return {
        "rounds": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "accepted_per_position": per_pos,
        "tau": s["tau"],
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "acceptance_rate_per_position": s["acceptance_rate_per_position"],
        "reached_per_position": s["reached_per_position"],
    }


def first_divergence(spec: Sequence[int], base: Sequence[int]) -> int | None:
    """Index of the first differing item (a length difference counts), or None."""
    for i, (s, b) in enumerate(zip(spec, base)):
        if s != b:
            return i
    return None if len(spec) == len(base) else min(len(spec), len(base))


def divergence(spec: list[int], base: list[int], **where: Any) -> dict[str, Any] | None:
    """Where a speculative output first leaves the target-only one: ``where``, the position and the next
    5 tokens of both; None when they are equal."""
    div = first_divergence(spec, base)
    if div is None:
        return None
    return {**where, "position": div, "speculative": spec[div : div + 5], "baseline": base[div : div + 5]}


# --- T > 0: does the output keep the target's distribution? (module doc) ---

ALPHA = 0.01  # the family-wise false-alarm rate of the check
MIN_COUNT = 10  # pooled count under which a category joins the "rest" column
DIST_PROMPTS = 4  # the check's prompts: the shortest first turns of the evaluation (cheap prefills)
DIST_TOKENS = 6  # the new tokens of each sample it compares


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, stat/2)."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))  # fmt: skip


def homogeneity(a: Counter, b: Counter, min_count: int = MIN_COUNT) -> tuple[float, int, float]:
    """Pearson's chi-square test that two samples of categories come from one law: (statistic, df, p-value).

    Categories pooled under ``min_count`` are merged (module doc); df = kept columns - 1 (0: nothing to test)."""
    keys = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    cols = [(a[c], b[c]) for c in keys if a[c] + b[c] >= min_count]
    rest = (
        sum(a[c] for c in keys if a[c] + b[c] < min_count),
        sum(b[c] for c in keys if a[c] + b[c] < min_count),
    )
    if sum(rest) >= min_count or (sum(rest) and not cols):
        cols.append(rest)
    elif sum(rest):  # too few to stand alone: into the smallest kept column
        x, y = cols[-1]
        cols[-1] = (x + rest[0], y + rest[1])
    if len(cols) < 2:
        return 0.0, 0, 1.0
    na, nb = sum(c[0] for c in cols), sum(c[1] for c in cols)
    n = na + nb
    stat = 0.0
    for x, y in cols:  # expected counts under one law: row total x column total / n
        for obs, row in ((x, na), (y, nb)):
            exp = row * (x + y) / n
            stat += (obs - exp) ** 2 / exp
    df = len(cols) - 1
    return stat, df, chi2_sf(stat, df)


def compare_distributions(
    with_draft: Sequence[Sequence[Sequence[int]]],
    alone: Sequence[Sequence[Sequence[int]]],
    tokens: int,
    alpha: float = ALPHA,
) -> dict:
    """The check over prompts: ``with_draft[i]`` and ``alone[i]`` are the samples (token lists) of prompt i.

    Returns the verdict (``ok``), the number of tests, the threshold and the smallest p-value with where it was."""
    assert len(with_draft) == len(alone), "one sample list per prompt on each side"
    tests, worst = [], None
    for i, (sd, sa) in enumerate(zip(with_draft, alone)):
        for j in range(1, tokens + 1):
            a = Counter(tuple(s[:j]) for s in sd)
            b = Counter(tuple(s[:j]) for s in sa)
            stat, df, p = homogeneity(a, b)
            if df == 0:
                continue
            tests.append(p)
            if worst is None or p < worst["p_value"]:
                worst = {"prompt": i, "prefix_tokens": j, "p_value": p, "chi2": round(stat, 2), "df": df}
    threshold = alpha / max(1, len(tests))
    return {
        "ok": all(p >= threshold for p in tests),
        "alpha": alpha,
        "tests": len(tests),
        "threshold": threshold,
        "worst": worst,
        "samples_per_side": [len(s) for s in with_draft],
        "tokens": tokens,
        "method": "chi-square homogeneity of each prompt's first-j-token prefixes, j = 1..tokens; Bonferroni "
        f"over the tests: a family-wise false-alarm rate <= {alpha:g}",
    }


def shortest_prompts(prompt_ids: Sequence[Sequence[int]], n: int) -> list[int]:
    """The indices of the ``n`` shortest prompts (cheap prefills; ties by order)."""
    return sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))[:n]


def draw_samples(sample: Callable[[list[int], int], list[int]], prompt_ids: Sequence[Sequence[int]], samples: int,
         seed: int) -> list[list[list[int]]]:  # fmt: skip
    """``samples`` samples of each prompt, one ``sample(prompt, seed)`` call each, every call its own seed."""
    return [
        [sample(list(p), seed + i * samples + j) for j in range(samples)] for i, p in enumerate(prompt_ids)
    ]


def distribution_summary(check: dict) -> str:
    """One line for a report's summary."""
    w = check.get("worst") or {}
    where = (
        f"; smallest p {w['p_value']:.2g} (prompt {w['prompt']}, {w['prefix_tokens']} tokens)" if w else ""
    )
    verdict = "kept" if check["ok"] else "NOT KEPT"
    return (f"target's distribution {verdict}: {check['tests']} chi-square tests of {check['samples_per_side'][0]} "
            f"samples a side, first {check['tokens']} tokens{where}; false alarms <= {check['alpha']:.0%}")  # fmt: skip

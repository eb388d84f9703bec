"""Does speculative sampling keep the target's distribution? A two-sample test, the same for both engines.

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

import torch

ALPHA = 0.01  # the family-wise false-alarm rate of the check
MIN_COUNT = 10  # pooled count under which a category joins the "rest" column
PROMPTS = 4  # the check's prompts: the shortest first turns of the evaluation (cheap prefills)
TOKENS = 6  # the new tokens of each sample it compares


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


def compare(
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


def pick_prompts(prompt_ids: Sequence[Sequence[int]], n: int) -> list[int]:
    """The indices of the ``n`` shortest prompts (cheap prefills; ties by order)."""
    return sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))[:n]


def draw(sample: Callable[[list[int], int], list[int]], prompt_ids: Sequence[Sequence[int]], samples: int,
         seed: int) -> list[list[list[int]]]:  # fmt: skip
    """``samples`` samples of each prompt, one ``sample(prompt, seed)`` call each, every call its own seed."""
    return [
        [sample(list(p), seed + i * samples + j) for j in range(samples)] for i, p in enumerate(prompt_ids)
    ]


def summary(check: dict) -> str:
    """One line for a report's summary."""
    w = check.get("worst") or {}
    where = (
        f"; smallest p {w['p_value']:.2g} (prompt {w['prompt']}, {w['prefix_tokens']} tokens)" if w else ""
    )
    verdict = "kept" if check["ok"] else "NOT KEPT"
    return (f"target's distribution {verdict}: {check['tests']} chi-square tests of {check['samples_per_side'][0]} "
            f"samples a side, first {check['tokens']} tokens{where}; false alarms <= {check['alpha']:.0%}")  # fmt: skip

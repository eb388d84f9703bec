"""The figures both evaluations report, defined once: tau, acceptance per position, divergences.

A decoding round drafts up to k tokens and the target accepts a prefix of them; the prefill is not a
round. From the rounds' accepted counts (the reference decoder keeps each one) or from vLLM's spec-decode
counters (totals, plus per position the number of rounds that accepted it) the same figures follow:

  tau                           1 + accepted / rounds: tokens per target forward of a round;
  acceptance_rate_per_position  P(position i accepted | positions 1..i-1 accepted) = reach[i] / reach[i-1],
                                with reach[0] = rounds and reach[i] = rounds accepting at least i tokens
                                (None where reach[i-1] = 0);
  reached_per_position          reach[i] / rounds (what vLLM's log calls "per-position acceptance").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

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

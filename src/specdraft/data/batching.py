"""Batching by token budget, shared by extraction and training."""

from __future__ import annotations


def token_batches(sids: list[int], lengths: dict[int, int], max_tokens: int) -> list[list[int]]:
    """Cut length-sorted samples into batches whose padded size (rows x longest) stays within max_tokens."""
    batches, cur, longest = [], [], 0
    for s in sids:
        n = lengths[s]
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches

"""The teacher's full-vocabulary argmax, kept per sample from the first time it is computed.

The teacher (`ttt.TeacherHead`) costs one (V, H) lm_head product a scored position, only for the argmax over
the whole vocabulary (which positions count, and the accuracy); the draft-vocabulary logits need the t2d rows
alone (Vd of V: 1/6 for SmolLM2). The target's states of a sample are the same every epoch (shards), so its
argmax is too: kept here the first time, a later epoch and every validation after the first compute the
draft-vocabulary logits only. On SmolLM2 at the quickstart's settings the teacher is ~20% of a CPU step.

Kept as the draft index (`TeacherHead` `top`: -1 outside the draft vocabulary), UNKNOWN where not computed yet;
at most `max_entries` positions (a run whose data would not fit computes the rest each time).
"""

from __future__ import annotations

import torch

UNKNOWN = -2  # a position whose argmax was not computed yet


class TopCache:
    """Sample id -> its positions' teacher top (draft index), filled as batches compute it.

    Args:
        max_entries: positions kept at most (int32 each), over all samples.
    """

    def __init__(self, max_entries: int = 1 << 26):
        self.max_entries = max_entries
        self.entries = 0
        self.tops: dict[int, torch.Tensor] = {}  # sid -> (n,) int32 on the CPU

    def known(self, sids: list[int], need: torch.Tensor) -> torch.Tensor | None:
        """The top at every `need` position of rows `sids` ((B, T) bool), as `need[need]`'s (N,) long on its
        device; None when any of them is unknown (the caller then computes them all)."""
        if len(sids) != need.shape[0]:  # a stand-in row (a rank without a sample): compute
            return None
        rows = []
        for r, sid in enumerate(sids):
            t = self.tops.get(sid)
            pos = need[r].nonzero().squeeze(1).cpu()  # (n_r,)
            if len(pos) and (t is None or int(pos[-1]) >= len(t)):
                return None
            got = t[pos] if len(pos) else torch.empty(0, dtype=torch.int32)
            if (got == UNKNOWN).any():
                return None
            rows.append(got)
        return torch.cat(rows).to(need.device, torch.long) if rows else None

    def keep(self, sids: list[int], need: torch.Tensor, top: torch.Tensor) -> None:
        """Record `top` ((N,): `need`'s positions in row-major order) for rows `sids`."""
        if len(sids) != need.shape[0]:
            return
        top = top.to("cpu", torch.int32)
        counts = need.sum(1).tolist()
        at = 0
        for r, sid in enumerate(sids):
            n = int(counts[r])
            if n:
                t = self.tops.get(sid)
                T = need.shape[1]
                if t is None:
                    if self.entries + T > self.max_entries:
                        at += n
                        continue
                    t = self.tops[sid] = torch.full((T,), UNKNOWN, dtype=torch.int32)
                    self.entries += T
                elif len(t) < T:  # a longer row than seen (padding differs by batch): widen
                    if self.entries + T - len(t) > self.max_entries:
                        at += n
                        continue
                    self.entries += T - len(t)
                    t = self.tops[sid] = torch.cat([t, torch.full((T - len(t),), UNKNOWN, dtype=torch.int32)])
                t[need[r].nonzero().squeeze(1).cpu()] = top[at : at + n]
            at += n
        assert at == len(top), (at, len(top))

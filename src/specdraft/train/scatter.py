"""Online through vLLM under torchrun: one engine on rank 0 captures every rank's rows.

Each rank asks for its own rows of a global batch (`load_rows`: `sids[rank::world]`, as offline), so the
per-rank data split is the one offline training makes. The requests are gathered on rank 0, whose engine
captures them in one prefill batch (the engine spreads the target over its own GPUs with
--tensor-parallel-size), and each rank gets its rows back by a scatter.

The exchange runs on its own gloo groups, never on the trainer's (NCCL on GPUs): one for the background
loader, which asks for the training batches in plan order, and one for the main thread, which asks for
the validation batches. Every rank asks in the same order on each group, so the two never interleave.
"""

from __future__ import annotations

import threading

import torch.distributed as dist


class ScatteredSource:
    """A source whose `load(rows)` returns this rank's rows, captured by rank 0's `inner` source."""

    def __init__(self, inner, rank: int, world: int):
        assert (inner is not None) == (rank == 0), "rank 0, and only rank 0, holds the engine"
        self.inner, self.rank, self.world = inner, rank, world
        # created by every rank in the same order (a collective)
        self._groups = {"main": dist.new_group(backend="gloo"), "ahead": dist.new_group(backend="gloo")}

    def _group(self):
        return self._groups["main" if threading.current_thread() is threading.main_thread() else "ahead"]

    def load(self, rows: list[int]) -> list[dict]:
        group = self._group()
        wants: list[list[int] | None] = [None] * self.world
        dist.all_gather_object(wants, rows, group=group)  # every rank's rows of this batch
        parts = None
        if self.rank == 0:
            union = list(dict.fromkeys(s for w in wants for s in w))  # one prefill for the global batch
            got = dict(zip(union, self.inner.load(union)))
            parts = [[got[s] for s in w] for w in wants]
        mine: list[list[dict] | None] = [None]
        dist.scatter_object_list(mine, parts, src=0, group=group)
        return mine[0]

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

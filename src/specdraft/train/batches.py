"""Training data: sample sources (shards or live capture), length-grouped batch plans, collation.

A global batch is a list of sample ids within `--max-tokens` padded tokens; rank r loads rows
`sids[r::world]` of it (`load_rows`) and pads them into a `Batch`.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from specdraft.data.batching import token_batches


class ShardSource:
    """Samples from extracted shards (offline)."""

    def __init__(self, shards):
        self.shards = shards

    def load(self, sids: list[int]) -> list[dict]:
        return [self.shards.load(s) for s in sids]


class OnlineSource:
    """Samples captured from the target (online): the same dicts as the shards give.

    The capture is the transformers backend in this process or a vLLM engine (its own processes); a lock
    serialises it, as the background loader and a validation may ask at once. `max_length` cuts each
    sample before the capture (the trainer reads no further; the target is causal, so the rows kept are
    the same).
    """

    def __init__(self, dataset, capture, max_length: int | None = None):
        self.dataset = dataset
        self.capture = capture
        self.max_length = max_length
        self._lock = threading.Lock()

    def load(self, sids: list[int]) -> list[dict]:
        cut = slice(0, self.max_length)
        ids = [list(self.dataset.input_ids[s])[cut] for s in sids]
        with self._lock:
            hs = self.capture.run(ids)
        return [
            {
                "input_ids": torch.as_tensor(i),
                "loss_mask": torch.as_tensor(self.dataset.loss_mask[s])[cut],
                "hidden": h.clone(),
            }  # clone: capture runs in inference mode  # fmt: skip
            for s, i, h in zip(sids, ids, hs)
        ]

    def close(self) -> None:
        """End the capture's engine (vLLM's processes); the transformers backend has nothing to end."""
        close = getattr(self.capture, "close", None)
        if close:
            close()


# Online through vLLM under torchrun: one engine on rank 0 captures every rank's rows.
#
# Each rank asks for its own rows of a global batch (`load_rows`: `sids[rank::world]`, as offline), so the
# per-rank data split is the one offline training makes. The requests are gathered on rank 0, whose engine
# captures them in one prefill batch (the engine spreads the target over its own GPUs with
# --tensor-parallel-size), and each rank gets its rows back by a scatter.
#
# The exchange runs on its own gloo groups, never on the trainer's (NCCL on GPUs): one for the background
# loader, which asks for the training batches in plan order, and one for the main thread, which asks for
# the validation batches. Every rank asks in the same order on each group, so the two never interleave.
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


@dataclass
class Batch:
    """One rank's share of a global batch, padded to its longest sample."""

    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float
    aux: torch.Tensor  # (B, T, 3H)
    final: torch.Tensor  # (B, T, H)
    tokens: int  # real (unpadded) tokens


def collate(samples: list[dict], max_length: int, all_tokens: bool = False) -> Batch:
    """Right-pad samples (truncated to max_length) into one batch; aux slots in ascending id order.

    all_tokens: the loss mask covers every real token (prompt included) instead of the samples' own.
    """
    T = min(max(int(s["input_ids"].shape[0]) for s in samples), max_length)
    n_slots, H = samples[0]["hidden"].shape[1:]
    assert n_slots == 4, f"expected 4 captured layers (3 aux + final), got {n_slots}"
    B = len(samples)
    ids = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    mask = torch.zeros(B, T, dtype=torch.float32)  # (B, T)
    hid = torch.zeros(B, T, 4, H, dtype=samples[0]["hidden"].dtype)  # (B, T, 4, H)
    tokens = 0
    for b, s in enumerate(samples):
        n = min(int(s["input_ids"].shape[0]), T)
        ids[b, :n] = s["input_ids"][:n]
        mask[b, :n] = 1.0 if all_tokens else s["loss_mask"][:n].float()
        hid[b, :n] = s["hidden"][:n]
        tokens += n
    aux = hid[:, :, :3].reshape(B, T, 3 * H)  # (B, T, 3, H) -> (B, T, 3H)
    return Batch(ids, mask, aux, hid[:, :, 3], tokens)  # final: (B, T, H)


def loss_part(mask: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """Share `part` of `parts` of a (B, T) loss mask: each row's scored positions (mask > 0) cut in order into
    `parts` contiguous runs of near-equal count. The shares partition the mask (they sum to it)."""
    assert 0 <= part < parts
    on = mask > 0  # (B, T)
    rank = on.cumsum(1) - 1  # (B, T): the index of each scored position in its row
    n = on.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
    return mask * (on & (rank * parts // n == part))  # (B, T)


def part_share(n: int, part: int, parts: int) -> int:
    """Share `part` of `parts` of a count `n`: near-equal integers that add up to `n` (a batch's tokens
    over its --steps-per-batch steps)."""
    assert 0 <= part < parts
    return n * (part + 1) // parts - n * part // parts


def load_rows(
    source, sids: list[int], rank: int, world: int, max_length: int, all_tokens: bool = False
) -> Batch:
    """This rank's rows (`sids[rank::world]`) of a global batch, loaded and collated (`collate`).

    A rank with no row (a validation batch of fewer samples than ranks) gets a zero-weight stand-in: the
    batch's first sample with an all-zero loss mask and 0 tokens. It runs the same forward passes as the
    other ranks (FSDP gathers the weights in them: every rank must take part) and counts nothing.
    """
    rows = sids[rank::world]
    if not rows:
        b = collate(source.load(sids[:1]), max_length)
        return replace(b, loss_mask=torch.zeros_like(b.loss_mask), tokens=0)
    return collate(source.load(rows), max_length, all_tokens)


def _to_device(b: Batch, device: torch.device) -> Batch:
    nb = device.type == "cuda"
    return Batch(b.input_ids.to(device, non_blocking=nb), b.loss_mask.to(device, non_blocking=nb),
                 b.aux.to(device, torch.float32, non_blocking=nb), b.final.to(device, non_blocking=nb), b.tokens)  # fmt: skip


def plan_batches(
    sids: list[int],
    lengths: dict[int, int],
    max_tokens: int,
    world: int,
    seed: int | None,
    keep_short: bool = False,
) -> list[list[int]]:
    """Length-grouped global batches within `max_tokens` padded tokens; shuffled when `seed` is given.

    Samples are shuffled, then stably sorted by length and cut greedily; the batch order is shuffled.
    Batches with fewer samples than ranks are dropped (a training step needs a sample on every rank) unless
    `keep_short` (validation: a rank without a row runs `load_rows`'s zero-weight stand-in).
    """
    order = list(sids)
    rng = random.Random(seed) if seed is not None else None
    if rng:
        rng.shuffle(order)
    order.sort(key=lambda s: lengths[s])
    batches = [b for b in token_batches(order, lengths, max_tokens) if keep_short or len(b) >= world]
    if rng:
        rng.shuffle(batches)
    return batches


def _plan_hash(batches: list[list[int]]) -> str:
    """A short hash of a batch plan (a resumed run must see the same data in the same order)."""
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()[:16]


def split_sids(sids: list[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) sample ids: a seeded random `val_fraction` share (at least one when > 0) is held out."""
    if val_fraction <= 0 or len(sids) < 2:
        return list(sids), []
    perm = list(sids)
    random.Random(seed + 7919).shuffle(perm)
    n_val = max(1, round(len(sids) * val_fraction))
    val = set(perm[:n_val])
    return [s for s in sids if s not in val], sorted(val)

"""`train --draft dflash --online`: hidden states captured from the target batch by batch instead of read from
an extraction.

EAGLE-3's online sources do the capture (`train.setup._open_online`: transformers in this process, or a vLLM
engine with `--backend vllm`, rank 0's engine capturing every rank's rows under torchrun); `OnlineSamples`
puts them behind what the block trainer reads shards through (`load`, `token_counts`), plus `load_rows`, one
capture for a rank's share of a batch. `--layers` picks the captured layers (any number: the draft fuses them
all; default EAGLE-3's 2, L//2, L-3); the final layer is captured too, as offline.
"""

from __future__ import annotations

import torch

from specdraft.train.batches import split_sids
from specdraft.train.block.setup import BlockData


class OnlineSamples:
    """A prepared dataset's samples, captured when asked for: the dicts a shard set's `load` gives."""

    def __init__(self, opened):
        self.opened = opened  # train.setup._Opened

    def load_rows(self, sids: list[int]) -> list[dict]:
        """One capture for `sids` (under torchrun through vLLM every rank calls it in step, [] included)."""
        return self.opened.source.load(list(sids)) if self.opened.source is not None else []

    def load(self, sid: int) -> dict:
        return self.load_rows([sid])[0]

    def token_counts(self):
        return self.opened.counts

    def close(self) -> None:
        if self.opened.source is not None:
            self.opened.source.close()


def open_online(data: str, cfg, device: torch.device) -> BlockData:
    """A `specdraft prepare` dataset and the target that captures it, split into train and validation samples."""
    from specdraft.runtime import resolve_dtype
    from specdraft.train.setup import _open_online

    target_dtype = "bfloat16" if resolve_dtype(cfg.dtype, str(device)) == "bfloat16" else "float32"
    opened = _open_online(data, cfg, device, target_dtype)
    lengths = {s: min(n, cfg.max_length) for s, n in opened.lengths.items() if n >= 3}
    train_sids, val_sids = split_sids(sorted(lengths), cfg.val_fraction, cfg.seed)
    tgt = opened.target
    name = cfg.target or getattr(tgt, "path", "") or tgt.name
    return BlockData(OnlineSamples(opened), list(opened.layer_ids)[:-1], lengths, train_sids, val_sids, name,
                     tgt.config_hash, opened.scored, int(getattr(tgt, "vocab_size", 0) or 0))  # fmt: skip

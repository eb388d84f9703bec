"""train.block: training of block-parallel (DFlash) drafts.

- `objective.py`: anchors sampled per sequence, the block attention mask, the position-decayed block loss,
  per-slot validation accuracy, one optimiser step over extracted (features, tokens, loss mask) sequences.
- `run.py`: `train --draft dflash`, the loop over an extraction's shards (any captured layer set): schedule,
  metrics, checkpoints, exact resume, final/.

May import: `model` (the DFlash draft and its files), `data` (the shards).
"""

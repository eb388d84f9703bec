"""train.block: training of block-parallel (DFlash) drafts.

- `objective.py`: anchors sampled per sequence, the block attention mask, the position-decayed block loss,
  per-slot validation accuracy, one optimiser step over extracted (features, tokens, loss mask) sequences.

May import: `model` (the DFlash draft).
"""

"""train.block: training of block-parallel (DFlash) drafts.

- `objective.py`: anchors sampled per sequence, the block attention mask, the position-decayed block loss,
  per-slot validation accuracy, the summed loss of a batch (and one optimiser step over it).
- `setup.py`: the extraction's shards and target, the draft (fresh, `--init-from` checked against the data,
  or the checkpoint `--resume` continues), the data order, each sample's anchor stream.
- `online.py`: `--online`, a prepared dataset captured by the target batch by batch (EAGLE-3's capture sources)
  behind what the trainer reads shards through.
- `sharded.py`: the draft behind one call per step (`BlockModel`), sharded by FSDP2 under `--fsdp`, and the
  full states a checkpoint holds (one process's format, with or without `--fsdp`).
- `run.py`: `train --draft dflash`, the loop phase by phase: torchrun data parallel (`--fsdp`),
  `--steps-per-batch`, the small-run recipe, metrics and trackers, checkpoints, exact resume, final/.

May import: `model` (the DFlash draft and its files), `data` (the shards), and from `train` the pieces EAGLE-3's
loop shares (metrics and trackers, the process group, the schedule, the settings).
"""

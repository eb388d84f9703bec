"""train: the train stage, the EAGLE-3 draft trained with training-time test (TTT).

Read `loop.py` first: `train` is the loop, phase by phase (check, setup, resume, then per step data,
forward, non-finite check, backward + step, log, validate, checkpoint), each phase a function there.
The rest, in the order `train` uses it:

- `config.py`: `TrainConfig`, the settings (each field's comment is its --help), and their checks.
- `setup.py`: open the data (shards, or a dataset + the target online), build the draft (or, --init-from, load a
  trained one) and the teacher.
- `batches.py`: sample sources, length-grouped batch plans, collation into a padded `Batch`.
- `ahead.py`: batches loaded (shards) or captured (online through vLLM) ahead of the trainer, a bounded queue.
- `ttt.py`: the TTT unroll, its attention mask, the teacher head (and each sample's teacher argmax, kept from its
  first batch: `TopCache`) and the loss (`TTTModel`).
- `distributed.py`: the torchrun process group, DDP / FSDP2 wrapping, all-reduces.
- `checkpoint.py`: write, prune and restore resumable checkpoints (draft files via `model.checkpoint`).
- `losses.py`: the token losses of --loss (KL, reverse KL, JS, TV, NLA, LK and weighted sums).
- `optim.py`: the optimizers of --optimizer (AdamW, Muon for matrices beside AdamW).
- `report/`: OUT/metrics.jsonl and the trackers of --report-to (TensorBoard, W&B, Trackio, MLflow, each
  offline/local); training.png from it.
- `block/`: the DFlash (block-parallel) draft's training.

May import: `fileio`, `targets`, `engine`, `data`, `model`, `capture` (online mode pulls hidden states from
a target in process or through a vLLM engine).
"""

"""train.report: what a training run reports, for the EAGLE-3 loop and the DFlash run alike.

- `metrics.py`: OUT/metrics.jsonl and the trackers of --report-to (TensorBoard, W&B, Trackio, MLflow, each
  offline/local).
- `plot.py`: training.png drawn from that log (smoothed losses, acceptance per position, learning rate).

May import: `fileio` only (it knows nothing of models or data).
"""

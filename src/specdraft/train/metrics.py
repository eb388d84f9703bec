"""The run's record: OUT/metrics.jsonl, one JSON record a line (+ TensorBoard in OUT/tb); rank 0 writes."""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.fileio import atomic_write_text

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Append records to OUT/metrics.jsonl (and TensorBoard scalars); a no-op on ranks other than 0.

    A fresh run starts an empty file; a resumed one drops the records past its checkpoint (they are redone).
    """

    def __init__(self, out_dir: Path, rank: int, resume: bool, start: int, tensorboard: bool):
        self.path = out_dir / METRICS_FILE
        self.rank = rank
        self.tb = None
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():  # drop records past the checkpoint: they will be redone
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
            atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))
        elif not resume:
            self.path.write_text("")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tb"))
            except ImportError:
                self.tb = None

    def __call__(self, rec: dict) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{rec.get('split', 'train')}/{k}", v, rec["step"])
                elif isinstance(v, list):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{rec.get('split', 'train')}/{k}_{i}", x, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()

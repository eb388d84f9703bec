"""training.png: the loss, per-TTT-step accuracy and out-of-vocabulary share of a run, from its metrics.jsonl.

Drawn at every mid-run validation and checkpoint and at the end, so a long run can be watched. A Ctrl-C or
SIGTERM that arrives while matplotlib draws is held until the drawing is done, then delivered: raised inside
matplotlib, it could land in a finalizer, where Python prints and drops it, and the run would go on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

from specdraft.fileio import tmp_path


def _per_step(ax, recs: list[dict], key: str) -> None:
    """Plot the per-TTT-step list `key` of train (lines) and val (markers) records against the step."""
    for split, style in (("train", "-"), ("val", "o--")):
        rs = [r for r in recs if r.get("split") == split and key in r]
        if not rs:
            continue
        steps = [r["step"] for r in rs]
        for i in range(len(rs[0][key])):
            ax.plot(steps, [r[key][i] for r in rs], style, label=f"{split} step {i}",
                    alpha=0.5 if split == "train" else 1.0)  # fmt: skip


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM received inside the block are delivered again, to this process, when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = {
        s: signal.signal(s, lambda signum, frame: held.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):  # each kind once, in the order they came
            os.kill(os.getpid(), s)


def plot_metrics(metrics_path: Path, png: Path) -> Path | None:
    """training.png (written whole: a temporary renamed over it), with signals held while it draws."""
    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    if not recs:
        return None
    with signals_held():
        tmp = tmp_path(png)
        try:
            _draw(recs, tmp)
            os.replace(tmp, png)
        finally:
            tmp.unlink(missing_ok=True)
    return png


def _draw(recs: list[dict], png: Path) -> None:
    """Loss; top-1 accuracy against the target's full-vocabulary argmax per TTT step; the share of loss
    positions whose target argmax is outside the draft vocabulary (dropped with --oov-mask)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_oov) = plt.subplots(1, 3, figsize=(15, 4))
    for split, style in (("train", "-"), ("val", "o--")):
        rs = [r for r in recs if r.get("split") == split]
        if rs:
            ax_loss.plot([r["step"] for r in rs], [r["loss"] for r in rs], style, label=split)
    _per_step(ax_acc, recs, "acc")
    _per_step(ax_oov, recs, "oov_share")
    ax_loss.set(xlabel="optimizer step", ylabel="loss (sum over TTT steps, decayed)", title="loss")
    ax_acc.set(xlabel="optimizer step", ylabel="draft top-1 == target full-vocabulary top-1",
               title="accuracy per TTT step")  # fmt: skip
    ax_oov.set(xlabel="optimizer step", ylabel="share of loss positions",
               title="target top-1 outside the draft vocabulary")  # fmt: skip
    ax_loss.legend()
    ax_acc.legend(fontsize=7)
    ax_oov.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110, format="png")
    plt.close(fig)

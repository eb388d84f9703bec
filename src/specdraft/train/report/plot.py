"""training.png: the loss, per-TTT-step accuracy, out-of-vocabulary share and learning rate of a run, from its
metrics.jsonl (training curves smoothed over their raw values, validation as markers).

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


def smooth(values: list[float], window: int) -> list[float]:
    """A trailing moving average over up to `window` values (the first ones over what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _window(n: int) -> int:
    """The smoothing window for n training records: about 1/20 of the run, 1 (none) for short runs."""
    return max(1, n // 20)


def _curves(ax, recs: list[dict], key: str, index: int | None, color, label: str) -> None:
    """Train records raw (faint) and smoothed (solid), validation as markers, of `key` (its `index`-th entry for
    a per-TTT-step list); one legend entry for the series."""
    value = (lambda r: r[key]) if index is None else (lambda r: r[key][index])  # noqa: E731
    tr = [r for r in recs if r.get("split") == "train" and key in r]
    if tr:
        steps, ys = [r["step"] for r in tr], [value(r) for r in tr]
        w = _window(len(tr))
        if w > 1:
            ax.plot(steps, ys, "-", color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, smooth(ys, w), "-", color=color, label=label)
    va = [r for r in recs if r.get("split") == "val" and key in r]
    if va:
        ax.plot([r["step"] for r in va], [value(r) for r in va], "o", color=color, markersize=4,
                markeredgecolor="black", markeredgewidth=0.5, label=None if tr else label)  # fmt: skip


def _per_step(ax, recs: list[dict], key: str) -> None:
    """One series per TTT step of the per-step list `key` (train smoothed, val markers)."""
    first = next((r for r in recs if key in r), None)
    if first is None:
        return
    colors = ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9"]
    for i in range(len(first[key])):
        _curves(ax, recs, key, i, colors[i % len(colors)], f"TTT step {i}")


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
    positions whose target argmax is outside the draft vocabulary (dropped with --oov-mask); the learning rate.
    Training curves are smoothed (a moving average over ~1/20 of the run) over their raw values drawn faint;
    validation is markers (edged black)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_oov, ax_lr) = plt.subplots(1, 4, figsize=(19, 4))
    _curves(ax_loss, recs, "loss", None, "C0", "loss")
    _per_step(ax_acc, recs, "acc")
    _per_step(ax_oov, recs, "oov_share")
    lr = [r for r in recs if r.get("split") == "train" and "lr" in r]
    if lr:
        ax_lr.plot([r["step"] for r in lr], [r["lr"] for r in lr], "-", color="C0")
    n_train = sum(1 for r in recs if r.get("split") == "train")
    w = _window(n_train)
    how = f"train: moving average of {w} records over raw (faint); val: markers" if w > 1 else "val: markers"
    ax_loss.set(xlabel="optimizer step", ylabel="loss (sum over TTT steps, decayed)", title="loss")
    ax_acc.set(xlabel="optimizer step", ylabel="draft top-1 == target full-vocabulary top-1",
               title="accuracy per TTT step")  # fmt: skip
    ax_oov.set(xlabel="optimizer step", ylabel="share of loss positions",
               title="target top-1 outside the draft vocabulary")  # fmt: skip
    ax_lr.set(xlabel="optimizer step", ylabel="learning rate", title="learning rate")
    for ax in (ax_acc, ax_oov):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(how, fontsize=8, y=0.02)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(png, dpi=110, format="png")
    plt.close(fig)

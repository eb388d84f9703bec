"""training.png: the loss, per-TTT-step accuracy and out-of-vocabulary share of a run, from its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


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


def plot_metrics(metrics_path: Path, png: Path) -> Path | None:
    """training.png: loss; top-1 accuracy against the target's full-vocabulary argmax per TTT step; the
    share of loss positions whose target argmax is outside the draft vocabulary (dropped with --oov-mask)."""
    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    if not recs:
        return None
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
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png

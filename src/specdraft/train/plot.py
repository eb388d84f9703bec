"""training.png: the loss and per-TTT-step accuracy of a run, drawn from its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(metrics_path: Path, png: Path) -> Path | None:
    """training.png: loss and per-TTT-step accuracy against the step, train and validation."""
    recs = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for split, style in (("train", "-"), ("val", "o--")):
        rs = [r for r in recs if r.get("split") == split]
        if not rs:
            continue
        steps = [r["step"] for r in rs]
        ax_loss.plot(steps, [r["loss"] for r in rs], style, label=split)
        for i in range(len(rs[0]["acc"])):
            ax_acc.plot(
                steps,
                [r["acc"][i] for r in rs],
                style,
                label=f"{split} step {i}",
                alpha=0.5 if split == "train" else 1.0,
            )
    ax_loss.set(xlabel="optimizer step", ylabel="loss (sum over TTT steps, decayed)", title="loss")
    ax_acc.set(
        xlabel="optimizer step", ylabel="top-1 agreement with the target", title="accuracy per TTT step"
    )
    ax_loss.legend()
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png

"""Reading a report: the human summary of either evaluation, and the reference evaluation's plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _rates(rates: list[float | None], digits: int) -> str:
    return ", ".join("-" if r is None else f"{r:.{digits}f}" for r in rates)


def _lossless(d: dict) -> str:
    """yes / NO (n divergences) at T = 0; n/a (T>0) where outputs are samples (the distribution check's line
    follows then)."""
    ll = d["lossless"]
    if not ll.get("checked", True):  # (a report from before T > 0: always checked)
        return "n/a (T>0)"
    return "yes" if ll.get("ok", not ll["divergences"]) else f"NO ({len(ll['divergences'])} divergences)"


def _distribution_line(d: dict) -> list[str]:
    from specdraft.eval.stats import distribution_summary as summary

    check = d.get("distribution")
    return [f"  {summary(check)}"] if check else []


def summary_lines(report: dict) -> list[str]:
    """A short human-readable summary of a report: the reference decoder's or vLLM's (``engine: vllm``)."""
    if report.get("engine") == "vllm":
        return _vllm_summary_lines(report)
    b = report["baseline"]
    lines = [f"baseline (target only): {b['new_tokens']} tokens, {b['tokens_per_s']:.1f} tok/s"]
    for name, d in report["drafts"].items():
        acc = _rates(d["acceptance_rate_per_position"], 2)
        lines.append(f"{name}: tau {d['tau']:.3f}, acceptance per position [{acc}], {d['tokens_per_s']:.1f} tok/s "
                     f"(x{d['speedup']:.2f}), target forwards saved {100 * d['target_forwards_saved']:.1f}%, "
                     f"lossless {_lossless(d)}")  # fmt: skip
        lines += _distribution_line(d)
        r = d.get("round_ms")
        if r and r["target_step"]:
            lines.append(f"  a round: draft {r['draft']:.1f} ms + verify {r['verify']:.1f} ms = "
                         f"{(r['draft'] + r['verify']) / r['target_step']:.2f} target steps of {r['target_step']:.1f} ms "
                         f"(draft {r['draft'] / r['target_step']:.2f}, verify {r['verify'] / r['target_step']:.2f}); "
                         f"it gains {d['tau']:.2f} tokens")  # fmt: skip
    return lines


def _vllm_summary_lines(report: dict) -> list[str]:
    """The summary of an :func:`specdraft.eval.serving.evaluate_vllm` report."""
    b, st = (
        report["baseline"],
        report.get("settings", {}),
    )  # (a report from before settings were kept: greedy)
    sampling = _sampling(st)
    lines = [f"vLLM {report['vllm_version']}, {sampling}, target alone: {b['new_tokens']} tokens, "
             f"{b['tokens_per_s']:.1f} tok/s"]  # fmt: skip
    for name, d in report["drafts"].items():
        acc = _rates(d["acceptance_rate_per_position"], 3)
        lines.append(f"{name} ({d['format']}): tau {d['tau']:.3f}, acceptance per position [{acc}], "
                     f"{d['tokens_per_s']:.1f} tok/s (x{d['speedup'] or 0:.2f}), lossless {_lossless(d)}")  # fmt: skip
        lines += _distribution_line(d)
        if d.get("vocab_coverage") is not None:
            lines.append(f"  its draft vocabulary holds {d['vocab_coverage']:.1%} of the target's own tokens here "
                         "(a draft proposes none of the rest)")  # fmt: skip
        ref = d.get("reference")
        if ref:
            racc = _rates(ref["acceptance_rate_per_position"], 3)
            lines.append(f"  reference decoder: tau {ref['tau']:.3f}, acceptance per position [{racc}]; "
                         f"identical rounds in {ref['prompts_with_identical_rounds']}/{ref['prompts_compared']} "
                         "prompts")  # fmt: skip
        if d.get("batch1"):
            lines += _batch1_lines(d["batch1"], b["batch1"], d.get("k", st.get("k")), d.get("method"))
    return lines


def _sampling(settings: dict) -> str:
    """How a report's tokens were chosen: greedy, or the temperature with top-p and the sampling methods."""
    t = settings.get("temperature", 0.0)
    if not t:
        return "greedy (T=0)"
    top_p = settings.get("top_p", 1.0)
    return (f"T={t:g}" + (f", top-p {top_p:g}" if top_p < 1 else "")
            + f", {settings.get('draft_sample', 'greedy')} drafting, {settings.get('verify', 'standard')} verification")  # fmt: skip


def _batch1_lines(d1: dict, b1: dict, k: int, method: str | None = None) -> list[str]:
    """Batch-1 speed with the draft vs alone, and plainly why the draft is slower when it is."""
    drafting = "1 draft forward for the block" if method == "dflash" else f"{k} draft steps"
    alone = d1.get("baseline_tokens_per_s", b1["tokens_per_s"])
    lines = [f"  batch 1 ({d1['prompts']} prompts one at a time): {d1['tokens_per_s']:.1f} tok/s with the draft vs "
             f"{alone:.1f} alone (x{d1['speedup'] or 0:.2f}), tau {d1['tau']:.3f}; a round "
             f"({drafting} + a {k + 1}-token verify) costs {d1['round_cost_in_target_steps']:.2f} target steps"]  # fmt: skip
    if d1.get("interleaved_rounds"):
        per = ", ".join(f"x{s:.2f}" for s in d1["speedup_per_round"])
        lines.append(
            f"  the median of {d1['interleaved_rounds']} rounds interleaved with the target alone: {per}"
        )
    if (d1["speedup"] or 0) < 1:
        lines.append(f"  the draft is SLOWER at batch 1: each round gains {d1['tau']:.2f} tokens but costs "
                     f"{d1['round_cost_in_target_steps']:.2f} target steps; it pays above tau "
                     f"{d1['break_even_tau']:.2f} (a better draft) or with a cheaper round ("
                     f"{'a smaller --block-size' if method == 'dflash' else 'smaller k or draft vocabulary'})")  # fmt: skip
    return lines


def short_name(name: str) -> str:
    """A draft's label on a plot: its last two path parts (a run's `final/` named by the run), not the absolute
    path; a name that is no path (`untrained`) as it is."""
    p = Path(name)
    if p.name == "final":
        p = p.parent
    return "/".join(p.parts[-2:]) if len(p.parts) > 1 else name


def write_plots(report: dict, out: str | Path) -> list[Path]:
    """acceptance_per_position.png (one series per draft; a vLLM report's reference decoder figures dashed) and,
    for a reference report, tau_per_category.png (a vLLM report has no categories)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in report["drafts"].items():
        rates = [r if r is not None else np.nan for r in d["acceptance_rate_per_position"]]
        line = ax.plot(
            range(1, len(rates) + 1), rates, marker="o", label=f"{short_name(name)} (tau {d['tau']:.2f})"
        )[0]
        ref = d.get("reference")  # eval --engine vllm --reference: the reference decoder on the same prompts
        if ref:
            rates = [r if r is not None else np.nan for r in ref["acceptance_rate_per_position"]]
            ax.plot(range(1, len(rates) + 1), rates, marker="x", linestyle="--", color=line.get_color(),
                    label=f"{short_name(name)}, reference decoder (tau {ref['tau']:.2f})")  # fmt: skip
    k = max((len(d["acceptance_rate_per_position"]) for d in report["drafts"].values()), default=1)
    ax.set_xticks(range(1, k + 1))  # positions are whole numbers
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given earlier positions accepted)")
    ax.set_ylim(0, 1.02)
    engine = "vLLM, " if report.get("engine") == "vllm" else ""
    n = report["settings"].get("prompts") or len(
        {(r.get("id"), r.get("turn")) for r in report.get("records", [])}
    )
    how = _sampling(report["settings"]) if engine else f"T={report['settings']['temperature']}"
    ax.set_title(f"acceptance per position, {engine}{how}, {n} prompts", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "acceptance_per_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if any("tau_per_category" not in d for d in report["drafts"].values()):
        return paths

    cats = sorted({c for d in report["drafts"].values() for c in d["tau_per_category"]})
    names = list(report["drafts"])
    per_cat = {
        c: len({r.get("id") for r in report.get("records", []) if r.get("category") == c}) for c in cats
    }
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cats) + 2), 4))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        vals = [report["drafts"][name]["tau_per_category"].get(c, np.nan) for c in cats]
        ax.bar(np.arange(len(cats)) + j * width, vals, width, label=short_name(name))
    ticks = [f"{c} (n={per_cat[c]})" for c in cats]
    ax.set_xticks(np.arange(len(cats)) + width * (len(names) - 1) / 2, ticks, rotation=30, ha="right")
    ax.set_ylabel("tau (tokens per target forward)")
    most = max(per_cat.values(), default=0)
    few = (
        f": {most} prompt{'s' if most > 1 else ''} a category at most, too few to compare them"
        if most <= 2
        else ""
    )
    ax.set_title("tau per category" + few)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "tau_per_category.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths

"""How acceptance grows with training data: vLLM tau against reply tokens, on the embedded default.

    python benchmarks/scaling.py [--points 25000,50000,100000,200000,400000,1000000] [--seeds-at 50000,200000,1000000]
                                 [--regen-at 25000,50000] [--max-length 1024] [--prompts 80] [--backend vllm]
                                 [--report-to tensorboard] [--out DIR]

One large extraction, prefixes of it: ShareGPT conversations (each cut to its first two user/assistant pairs,
rendered with the target's chat template, at most `--max-length` tokens) are prepared and extracted once, enough
for the largest point; the run at N reply tokens trains on the shortest prefix of that dataset holding N
loss-masked tokens (`--max-samples`), one epoch, with the small-run recipe (`RECIPE`: the best arm of
benchmarks/ablate.py), seed 0, and again with seed 1 at `--seeds-at`. At `--regen-at`, the same first user turns
answered by the target itself (`specdraft regenerate`, greedy, first turn only) train a draft of the same size
of data. Every draft is exported and served by vLLM behind the target over the MT-bench first turns (k=3,
greedy, 64 new tokens) in one run, side by side. Then: a table, the fit tau = a + b log10(tokens) over the
ShareGPT points (seed 0) with the tokens it projects for tau 1.5 and 2.0, the seed spread, and `scaling.png`.
An `--out` of an earlier run is reused: its extraction and every draft already exported there.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ablate import ARMS, conversations  # benchmarks/ablate.py, beside this script
from quality import first_turns, serve_rows  # benchmarks/quality.py

from specdraft.capture.extract import extract
from specdraft.data.prepare import load_dataset, prepare
from specdraft.data.regenerate import regenerate
from specdraft.export import export
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

RECIPE = {k: v for k, v in ARMS["best_spb2_fc_high_ema0.99"].items()}  # the small-run recipe (README)
BASE = TrainConfig(draft_vocab_size=8192, ttt_steps=3, epochs=1, val_fraction=0.0, checkpoint_every=10**6,
                   progress=False, tensorboard=False, **RECIPE)  # fmt: skip


def prefix_for(loss_tokens: list[int], want: int) -> int:
    """The number of leading samples whose loss-masked tokens first reach `want` (all when they never do)."""
    total = 0
    for i, n in enumerate(loss_tokens):
        total += n
        if total >= want:
            return i + 1
    return len(loss_tokens)


def fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares tau = a + b log10(tokens): (a, b, r^2)."""
    xs, ys = [math.log10(t) for t, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs) or 1e-12
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys) or 1e-12
    r2 = 1 - sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys)) / ss
    return a, b, r2


def projected(a: float, b: float, tau: float) -> float | None:
    """The tokens at which the fit reaches `tau` (None when it does not rise)."""
    return 10 ** ((tau - a) / b) if b > 0 else None


def _train_export(root: Path, name: str, data: str, cfg: TrainConfig) -> dict:
    """Train (one epoch of `data` under `cfg`) and export one draft; reused when exported by an earlier run."""
    exp = root / f"export_{name}"
    if not exp.exists():
        t0 = time.perf_counter()
        final = train(data, str(root / f"train_{name}"), cfg)
        assert export(str(final), str(exp), format="speculators", k=3, check_vllm=False) == 0
        (root / f"train_{name}" / "seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}")
    meta = json.loads((exp / "config.json").read_text())
    run = root / f"train_{name}"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["tokens"] for r in recs if r["split"] == "train")
    return {"arm": name, "export": str(exp), "train_tokens": tokens, "steps": recs[-1]["step"],
            "train_s": float((run / "seconds.txt").read_text()), "vd": meta.get("draft_vocab_size")}  # fmt: skip


def sharegpt_rows(root: Path, a, points: list[int], seeds_at: set[int]) -> list[dict]:
    """One extraction for the largest point, a prefix of it per point (and a second seed at `seeds_at`)."""
    ds_dir, hs = root / "dataset", root / "hidden_states"
    if not any(hs.glob("manifest-*.json")):
        n = max(64, max(points) // 150)  # ~150+ reply tokens per conversation here: enough, checked below
        convs = conversations(root / "conversations.jsonl", n, 2)
        prepare(str(convs), str(ds_dir), max_length=a.max_length, overwrite=True)
        extract(str(ds_dir), str(hs), backend=a.backend, skip_doctor=True)
    ds = load_dataset(str(ds_dir))
    loss = [int(sum(m)) for m in ds.loss_mask]
    if sum(loss) < max(points):
        print(f"scaling: the dataset holds {sum(loss)} reply tokens, fewer than {max(points)}: the last point "
              "trains on all of them", flush=True)  # fmt: skip
    rows = []
    for p in points:
        k = prefix_for(loss, p)
        for seed in (0, 1) if p in seeds_at else (0,):
            cfg = replace(BASE, max_length=a.max_length, max_samples=k, seed=seed, report_to=a.report_to)
            rows.append({**_train_export(root, f"sharegpt_{p}_seed{seed}", str(hs), cfg), "point": p,
                         "data": "sharegpt", "seed": seed, "samples": k, "reply_tokens": sum(loss[:k])})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def regen_rows(root: Path, a, points: list[int]) -> list[dict]:
    """At each point, the target's own first-turn replies to ShareGPT's first user turns, as much data."""
    rows = []
    for p in points:
        convs = first_turns(root / f"first_turns_{p}.jsonl", max(16, p // 120), a.max_length - 256)
        regen = regenerate(str(convs), str(root / f"regenerated_{p}"), turns="first", max_new_tokens=256,
                           max_prompt_tokens=a.max_length - 256)  # fmt: skip
        ds = prepare(str(regen), str(root / f"ds_regen_{p}"), max_length=a.max_length, overwrite=True)
        hs = root / f"hs_regen_{p}"
        if not any(hs.glob("manifest-*.json")):
            extract(str(ds), str(hs), backend=a.backend, skip_doctor=True)
        loss = [int(sum(m)) for m in load_dataset(str(ds)).loss_mask]
        k = prefix_for(loss, p)
        cfg = replace(BASE, max_length=a.max_length, max_samples=k, report_to=a.report_to)
        rows.append({**_train_export(root, f"regen_{p}_seed0", str(hs), cfg), "point": p, "data": "regenerated",
                     "seed": 0, "samples": k, "reply_tokens": sum(loss[:k])})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict], out: Path) -> dict:
    """The table, the fit and its projections, the seed spread, and scaling.png."""
    main = sorted((r["reply_tokens"], r["tau"]) for r in rows if r["data"] == "sharegpt" and r["seed"] == 0)
    a, b, r2 = fit(main)
    spread = {}
    for p in sorted({r["point"] for r in rows if r["seed"] == 1}):
        taus = [r["tau"] for r in rows if r["point"] == p and r["data"] == "sharegpt"]
        spread[p] = round(max(taus) - min(taus), 3)
    summary = {"fit": {"a": round(a, 4), "b_per_decade": round(b, 4), "r2": round(r2, 3)},
               "tokens_for_tau_1.5": projected(a, b, 1.5), "tokens_for_tau_2.0": projected(a, b, 2.0),
               "seed_spread": spread}  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for data, marker in (("sharegpt", "o"), ("regenerated", "s")):
        pts = [(r["reply_tokens"], r["tau"]) for r in rows if r["data"] == data]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=f"{data} replies")
    xs = [min(t for t, _ in main) * 0.8, max(t for t, _ in main) * 1.25]
    ax.plot(xs, [a + b * math.log10(x) for x in xs], "--", label=f"fit: {a:.3f} + {b:.3f} log10(tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("training reply tokens (one epoch)")
    ax.set_ylabel("vLLM tau, MT-bench first turns (k=3)")
    ax.set_title("SmolLM2-135M-Instruct: acceptance against training data")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="25000,50000,100000,200000,400000,1000000")
    p.add_argument("--seeds-at", default="50000,200000,1000000")
    p.add_argument("--regen-at", default="25000,50000")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--backend", default="vllm", help="extraction backend")
    p.add_argument("--report-to", default="", help="trackers of every training run (train --report-to)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        points = ints(a.points)
        rows = sharegpt_rows(root, a, points, set(ints(a.seeds_at))) + regen_rows(root, a, ints(a.regen_at))
        rep = serve_rows(rows, a.prompts, root / "eval")
        summary = report(rows, root)
        (root / "scaling.json").write_text(json.dumps({"rows": rows, **summary}, indent=1))
    print(f"\nvLLM {rep['vllm_version']}, MT-bench first turns: {rep['settings']['prompts']}, k=3, greedy, 64 new "
          f"tokens; recipe {RECIPE}")  # fmt: skip
    print(f"{'arm':<26}{'reply tokens':>13}{'steps':>7}{'train s':>9}{'tau':>7}  acceptance per position")
    for r in sorted(rows, key=lambda r: (r["data"], r["reply_tokens"], r["seed"])):
        print(f"{r['arm']:<26}{r['reply_tokens']:>13}{r['steps']:>7}{r['train_s']:>9}{r['tau']:>7.3f}  "
              f"{r['acceptance']}  lossless {r['lossless']}")  # fmt: skip
    f = summary["fit"]
    proj = {
        k: (f"{v:,.0f}" if v else "never (the fit does not rise)")
        for k, v in summary.items()
        if k.startswith("tokens")
    }
    print(f"fit tau = {f['a']} + {f['b_per_decade']} log10(tokens), r^2 {f['r2']}; projected {proj}; "
          f"seed spread (max - min tau) {summary['seed_spread']}; plot: {root / 'scaling.png'}")  # fmt: skip


if __name__ == "__main__":
    main()

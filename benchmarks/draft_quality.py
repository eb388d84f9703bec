"""Draft quality at equal data: the field's newer ways to train a draft, each alone and combined, on top of the
quickstart's settings, every draft served by vLLM behind the target (tau, batch-1 speed-up, lossless).

    python benchmarks/draft_quality.py --shards runs/quickstart/hidden_states [--arms lk,nla,eagle31,...]
                                       [--seeds 0] [--base-run runs/quickstart/train] [--prompts 80]
                                       [--batch1-prompts 8] [--batch1-rounds 3] [--snapshots 2,3] [--out DIR]

`--shards`: an extraction of the embedded default (the quickstart's: 240 ShareGPT conversations of at most 1024
tokens, 142k reply tokens; a larger one for the second data size). Every arm trains one epoch with the quickstart's
settings (draft vocabulary 8192, 3 TTT steps, lr 1e-3, 512 tokens a step, constant, 5% held out, the small-run
recipe as it was before issue 45: prompt loss, decay 0.5, argmax loss, AdamW, 2 steps a batch, fc-init high, EMA
0.99) and the changes its row of ARMS names, with seed N for `ARM_sN`. `--base-run` adopts an existing run with the
base settings as `base_s0` instead of training it again, and `--adopt ARM_sN=RUN` any arm's (the quickstart's own
train/, trained from the same shards with today's budget, is `kl+epochs2_s0`; before 2026-12-06,
`kl+muon+epochs2+spb1_s0`). `--snapshots 2,3` serves an arm of more epochs after 2 and 3 of them too (one run,
stopped, exported and resumed). `ARM@NAME` trains that arm on another extraction, `--data NAME=SHARDS` (the
quickstart's records regenerated at a temperature). `--temperatures 0,0.7,1 --draft-samples greedy,probabilistic`
serves every arm at each temperature and drafting method instead (issue 57). An `--out` kept from an earlier run reuses every arm trained and exported there;
each call serves the arms it names (one vLLM run: the target alone, then each draft; k = 3, greedy, 64 new
tokens, 80 MT-bench first turns) and prints the table: arm, seed, training seconds, validation accuracy of TTT step
0, vLLM tau, acceptance per position, batch-1 tokens/s against the target alone, lossless. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from specdraft.data.store import ShardSet
from specdraft.eval.serving import evaluate_vllm
from specdraft.export import export
from specdraft.train.batches import plan_batches, split_sids
from specdraft.train.config import SMALL_RUN, TrainConfig
from specdraft.train.loop import train

# the quickstart's training settings (quickstart.BUDGETS["default"]) with the small-run recipe as it was before
# issue 45 (the argmax loss and AdamW, which the table's base measures), seed 0
BEFORE = {**SMALL_RUN, "hard_weight": 1.0, "optimizer": "adamw"}
BASE = TrainConfig(draft_vocab_size=8192, ttt_steps=3, epochs=1, lr=1e-3, max_tokens=512, schedule="constant",
                   checkpoint_every=10**6, val_fraction=0.05, val_every=0, recipe="off", progress=False,
                   tensorboard=False, **{k: v for k, v in BEFORE.items() if k not in ("lr", "max_tokens", "schedule")})  # fmt: skip
SOFT = {"hard_weight": 0.0}  # the argmax loss off: the soft loss (--loss) is what trains
ARMS = {  # name: what changes against BASE
    "base": {},  # the recipe before issue 45; today's recipe is kl+muon
    "kl": {**SOFT, "loss": "kl"},
    "lk": {**SOFT, "loss": "lk"},
    "nla": {**SOFT, "loss": "nla"},
    "tv": {**SOFT, "loss": "tv"},
    "rkl": {**SOFT, "loss": "rkl"},
    "jsd": {**SOFT, "loss": "jsd"},
    "hard_lk": {"hard_weight": 0.5, "loss": "lk"},  # half the argmax loss, half LK
    "eagle31": {"fc_norm": True, "norm_output": True},
    "fc_norm": {"fc_norm": True},
    "layers2": {"draft_layers": 2},
    "noise": {"noise": "uniform", "noise_scale": 0.05},
    "muon": {"optimizer": "muon"},
    # around today's recipe (kl+muon): the optimizer's own settings, re-tuned at Muon and the soft loss
    "epochs2": {"epochs": 2},  # the same data twice
    "epochs3": {"epochs": 3},  # three times, and four: where more passes over 142k reply tokens stop paying
    "epochs4": {"epochs": 4},
    "ema995": {"ema": 0.995},  # a longer weight average (~200 of the ~1,000 steps at 142k reply tokens)
    "lr2e3": {"lr": 2e-3},
    # one step a batch (the recipe takes 2, each scoring half of every row): with epochs2, two passes over the
    # data for about the compute of the recipe's one (each context run twice either way)
    "spb1": {"steps_per_batch": 1},
    # the draft vocabulary: 8192 rows cover 88% of the target's own greedy tokens on MT-bench (their misses are
    # content words: ' orbital', ' majestic', ...), which no draft can propose; lm_head starts at the target's rows
    "vocab16k": {"draft_vocab_size": 16384},
    "vocab32k": {"draft_vocab_size": 32768},
    # the losses around today's quickstart default (kl+epochs2) that aim at acceptance itself (issue 57: TV and LK
    # are reported to gain most at T = 1)
    "tv2": {**SOFT, "loss": "tv", "epochs": 2},
    "lk2": {**SOFT, "loss": "lk", "epochs": 2},
    "nla2": {**SOFT, "loss": "nla", "epochs": 2},
    # bf16 autocast (the quickstart's training on a CPU with AVX512-BF16 or AMX, `runtime.bf16_native`); with
    # `@DATA` of an extraction computed in bf16 too, the quickstart's whole compute there
    "bf16": {"dtype": "bfloat16"},
}


def settings(arm: str) -> tuple[str, TrainConfig]:
    """`NAME` or `NAME_sSEED` (several names joined by `+` combine their changes; `NAME@DATA` trains on the
    extraction `--data DATA=SHARDS` names) -> (label, settings)."""
    name, _, seed = arm.partition("_s")
    name, _, data = name.partition("@")
    change: dict = {}
    for part in name.split("+"):
        if part not in ARMS:
            raise SystemExit(
                f"unknown arm {part!r}; one of {', '.join(ARMS)} (joined by +), with _sN for seed N"
            )
        change.update(ARMS[part])
    return f"{name}{'@' + data if data else ''}_s{int(seed or 0)}", replace(
        BASE, seed=int(seed or 0), **change
    )


def shards_of(label: str, a) -> str:
    """The extraction an arm trains on: `--shards`, or the one `--data` names for `NAME@DATA`."""
    data = label.partition("@")[2].rpartition("_s")[0]
    if not data:
        return a.shards
    named = dict(x.split("=", 1) for x in a.data)
    if data not in named:
        raise SystemExit(f"arm {label}: no --data {data}=SHARDS given")
    return named[data]


def _val_acc(run: Path) -> float | None:
    val = [r for r in _records(run) if r.get("split") == "val"]
    return round(val[-1]["acc"][0], 4) if val and val[-1].get("acc") else None


def steps_per_epoch(shards: str, cfg: TrainConfig) -> int:
    """The optimizer steps of one epoch of `cfg` on `shards`: the trainer's own plan (`train.loop._plan`: the same
    length cut, validation split and batching; one rank). Checked against the run's own records after training."""
    ss = ShardSet.open([p for p in shards.split(",") if p])
    sids = ss.sample_ids()[: cfg.max_samples or None]
    lengths = {s: min(ss.length(s), cfg.max_length) for s in sids if ss.length(s) >= 3}
    train_sids, _ = split_sids(sorted(lengths), cfg.val_fraction, cfg.seed)
    return len(plan_batches(train_sids, lengths, cfg.max_tokens, 1, cfg.seed)) * cfg.steps_per_batch


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _steps_done(run: Path) -> int:
    """The last optimizer step the run recorded (0 before its first)."""
    if not (run / "metrics.jsonl").exists():
        return 0
    return max((r["step"] for r in _records(run) if r.get("split") == "train"), default=0)


def trained(root: Path, label: str, cfg: TrainConfig, shards: str, adopted: dict[str, str],
            snapshots: list[int]) -> list[dict]:  # fmt: skip
    """Train (unless done or adopted) and export one arm; its rows so far: one per epoch of `snapshots` below the
    arm's epochs (`LABEL-eE`: the run stopped after E epochs, exported, and resumed, which is exact: the schedule
    is constant after warmup and the data order is per epoch), then the arm's own."""
    run = root / f"train-{label}"
    if label in adopted and not run.exists():
        run.symlink_to(Path(adopted[label]).resolve())
    stops = sorted(e for e in set(snapshots) if 0 < e < cfg.epochs) + [cfg.epochs]
    per_epoch = steps_per_epoch(shards, cfg) if len(stops) > 1 else 0  # 0: one stop, the run's end
    rows, t_file = [], run / "bench_train_s.json"
    for e in stops:
        name, target = (label if e == cfg.epochs else f"{label}-e{e}"), e * per_epoch
        exp = root / f"export-{name}"
        if not (exp / "config.json").exists():
            if not (run / "final" / "config.json").exists() or _steps_done(run) < target:
                spent = json.loads(t_file.read_text()) if t_file.exists() else 0.0
                t0 = time.perf_counter()
                train(shards, str(run), replace(cfg, max_steps=target if e < cfg.epochs else 0,
                                                resume=(run / "checkpoints").exists()))  # fmt: skip
                t_file.write_text(json.dumps(round(spent + time.perf_counter() - t0, 1)))
            # the trainer's plan and ours differ, or the run went past this snapshot before
            if target and _steps_done(run) != target:
                raise SystemExit(f"{label}: the run is at step {_steps_done(run)}, not {target} ({e} epochs): train "
                                 "it again in a new --out")  # fmt: skip
            shutil.rmtree(exp, ignore_errors=True)
            assert export(str(run), str(exp), format="speculators", k=3, check_vllm=False) == 0
            (exp / "bench_row.json").write_text(json.dumps(_row(name, run, t_file)))
        row_file = exp / "bench_row.json"  # absent for an export made before snapshots were kept
        row = json.loads(row_file.read_text()) if row_file.exists() else _row(name, run, t_file)
        rows.append({**row, "epochs": e, "export": str(exp)})
    return rows


def _row(name: str, run: Path, t_file: Path) -> dict:
    """An arm's row as its run stands now: training seconds so far, validation accuracy of TTT step 0."""
    secs = json.loads(t_file.read_text()) if t_file.exists() else None
    return {"arm": name, "train_s": secs, "val_acc0": _val_acc(run)}


def plot_epochs(rows: list[dict], png: Path) -> Path | None:
    """tau against passes over the data: a line per arm served after several epochs (`--snapshots`), a point per
    other arm, each labelled with its training seconds; None when no arm has two points."""
    lines: dict[str, list[dict]] = {}
    for r in rows:
        name, _, seed = r["arm"].rpartition("_s")
        lines.setdefault(f"{name.split('-e')[0]}_s{seed.split('-e')[0]}", []).append(r)
    lines = {k: sorted(v, key=lambda r: r["epochs"]) for k, v in lines.items()}
    if all(len(v) < 2 for v in lines.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in lines.items():
        ax.plot([r["epochs"] for r in pts], [r["tau"] for r in pts], marker="o", label=name)
        for r in pts:
            if r.get("train_s"):
                ax.annotate(f"{r['train_s']:.0f} s", (r["epochs"], r["tau"]), textcoords="offset points",
                            xytext=(4, -12), fontsize=8)  # fmt: skip
    ax.set_xlabel("epochs over the same data")
    ax.set_ylabel(f"vLLM tau (k = {rows[0].get('k', 3)}, 80 MT-bench first turns)")
    ax.set_xticks(sorted({r["epochs"] for pts in lines.values() for r in pts}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="an extraction of the embedded default")
    p.add_argument(
        "--arms", default="base,kl,lk,nla,eagle31,muon", help=f"comma-separated, of: {', '.join(ARMS)}"
    )
    p.add_argument("--seeds", default="0", help="comma-separated seeds of every arm")
    p.add_argument("--base-run", default="", help="a finished run with the base settings, adopted as base_s0")
    p.add_argument("--adopt", action="append", default=[], metavar="ARM_sN=RUN",
                   help="a finished run with that arm's settings (the quickstart's train/: kl+epochs2_s0), "
                        "adopted instead of trained again; repeatable")  # fmt: skip
    p.add_argument("--snapshots", default="", metavar="E,E",
                   help="also serve each arm after these epochs (below its own): the run stopped there, exported, resumed")  # fmt: skip
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--batch1-prompts", type=int, default=8)
    p.add_argument(
        "--batch1-rounds", type=int, default=3, help="batch-1 rounds interleaved with the target alone"
    )
    p.add_argument("--k", type=int, default=3, help="draft tokens a round when served")
    p.add_argument("--dist-samples", type=int, default=0,
                   help="T > 0: samples a side of eval's distribution check (a ! after a cell: not kept)")  # fmt: skip
    p.add_argument("--serve-out", default="serve", help="the serving report's directory under --out")
    p.add_argument("--train-only", action="store_true", help="train and export, serve nothing")
    p.add_argument("--temperatures", default="0", metavar="T,T",
                   help="serve every arm at each temperature (issue 57: 0,0.7,1); each (T, drafting) pair is one vLLM "
                        "run, its report kept under --out and reused by a rerun")  # fmt: skip
    p.add_argument(
        "--draft-samples",
        default="greedy",
        metavar="M,M",
        help="vLLM's drafting at T > 0: greedy,probabilistic (T = 0 is greedy only)",
    )
    p.add_argument("--data", action="append", default=[], metavar="NAME=SHARDS",
                   help="another extraction, trained on by arms named ARM@NAME (issue 57: the quickstart's records "
                        "regenerated at a temperature); repeatable")  # fmt: skip
    p.add_argument("--out", default="runs/bench-draft-quality")
    a = p.parse_args()
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    snapshots = [int(e) for e in a.snapshots.split(",") if e]
    adopted = dict(x.split("=", 1) for x in a.adopt) | ({"base_s0": a.base_run} if a.base_run else {})
    rows = []
    for arm in a.arms.split(","):
        for seed in a.seeds.split(",") if "_s" not in arm else [""]:  # an arm named with its seed keeps it
            label, cfg = settings(f"{arm}_s{seed}" if seed else arm)
            print(f"=== {label}: {', '.join(f'{k}={v}' for k, v in sorted(vars(cfg).items()) if getattr(BASE, k) != v)}",
                  flush=True)  # fmt: skip
            for row in trained(root, label, cfg, shards_of(label, a), adopted, snapshots):
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.train_only:
        return
    temps = [float(t) for t in a.temperatures.split(",")]
    if temps != [0.0]:
        return sampled_table(rows, root, a, temps, a.draft_samples.split(","))
    rep = evaluate_vllm([r["export"] for r in rows], prompts="mtbench", k=a.k, max_new_tokens=64,
                        max_prompts=a.prompts, batch1_prompts=a.batch1_prompts, batch1_rounds=a.batch1_rounds,
                        out=str(root / a.serve_out))  # fmt: skip
    print(
        f"\n{'arm':<24}{'train s':>8}{'val acc0':>9}{'vLLM tau':>9}{'batch 1':>8}  acceptance per position, lossless"
    )
    for r in rows:
        d = rep["drafts"][r["export"]]
        b1 = (d.get("batch1") or {}).get("speedup")
        speed = f"{b1:.2f}x" if b1 else "-"
        cost = (d.get("batch1") or {}).get("round_cost_in_target_steps")
        acc = [None if x is None else round(x, 3) for x in d["acceptance_rate_per_position"]]
        r.update(
            tau=round(d["tau"], 3),
            batch1=speed,
            round_cost=cost,
            acceptance=acc,
            lossless=d["lossless"]["ok"],
            k=a.k,
        )
        print(f"{r['arm']:<24}{r['train_s'] or '-':>8}{r['val_acc0'] or '-':>9}{r['tau']:>9.3f}{speed:>8}{cost or '-':>7}  "
              f"{acc}, {'lossless' if r['lossless'] else 'NOT LOSSLESS'}")  # fmt: skip
    (root / f"table-{a.serve_out}.json").write_text(json.dumps(rows, indent=1))
    png = plot_epochs(rows, root / f"tau-by-epochs-{a.serve_out}.png")
    if png:
        print(f"tau by epochs: {png}")


def sampled_table(rows: list[dict], root: Path, a, temps: list[float], methods: list[str]) -> None:
    """Every arm served at each temperature and drafting method (one vLLM run per arm and column, with the target
    alone beside it, its report kept under OUT/SERVE-T{t}-{m}/ARM and reused by a rerun, so an arm added later
    costs only its own runs): a table of tau, arm by (T, drafting), with the batched speed-up, and
    tau-by-temperature.png. Every sampled column also runs the distribution check (`--dist-samples`)."""
    cols = [(t, m) for t in temps for m in (["greedy"] if t == 0 else methods)]
    results = {}
    for t, m in cols:
        for r in rows:
            out = root / f"{a.serve_out}-T{t:g}-{m}" / r["arm"]
            f = out / "report_vllm.json"
            rep = json.loads(f.read_text()) if f.exists() else {}
            if r["export"] not in rep.get("drafts", {}):
                shutil.rmtree(out, ignore_errors=True)
                rep = evaluate_vllm([r["export"]], prompts="mtbench", k=a.k, max_new_tokens=64, max_prompts=a.prompts,
                                    batch1_prompts=0, out=str(out), temperature=t, draft_sample=m,
                                    dist_samples=a.dist_samples if t > 0 else 0)  # fmt: skip
            results[(t, m, r["export"])] = rep["drafts"][r["export"]]
    head = "".join(f"{f'T={t:g} {m[:5]}':>14}" for t, m in cols)
    print(
        f"\n{'arm':<24}{head}   (vLLM tau over {a.prompts} MT-bench first turns, k={a.k}; batched speed-up)"
    )
    for r in rows:
        cells = []
        for c in cols:
            d = results[(*c, r["export"])]
            kept = (d.get("distribution") or {}).get("ok")
            cells.append(f"{d['tau']:.3f} x{d['speedup'] or 0:.2f}{'' if kept in (None, True) else '!'}")
            r[f"tau_T{c[0]:g}_{c[1]}"] = round(d["tau"], 3)
            r[f"speedup_T{c[0]:g}_{c[1]}"] = d["speedup"]
            r[f"kept_T{c[0]:g}_{c[1]}"] = kept
        print(f"{r['arm']:<24}" + "".join(f"{x:>14}" for x in cells))
    (root / f"table-{a.serve_out}-sampled.json").write_text(json.dumps(rows, indent=1))
    print(
        f"tau by temperature: {plot_temperatures(rows, cols, root / f'tau-by-temperature-{a.serve_out}.png')}"
    )


def plot_temperatures(rows: list[dict], cols: list[tuple[float, str]], png: Path) -> Path:
    """tau against the serving temperature, a line per arm and drafting method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        for m, style in (("greedy", "-"), ("probabilistic", "--")):
            pts = [(t, r[f"tau_T{t:g}_{mm}"]) for t, mm in cols if mm == m or t == 0]
            if len(pts) > 1:
                ax.plot(*zip(*pts), style, marker="o", label=f"{r['arm']} ({m} drafting)")
    ax.set_xlabel("serving temperature")
    ax.set_ylabel("vLLM tau (tokens per target forward)")
    ax.set_title("the drafts served at the temperature users serve at (k=3, MT-bench)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    main()

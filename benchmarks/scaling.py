"""How acceptance grows with training data: vLLM tau against reply tokens, on the embedded default.

    python benchmarks/scaling.py [--points 25000,50000,100000,200000,400000,1000000] [--seeds-at 50000,200000,1000000]
                                 [--regen-at 25000,50000] [--max-length 1024] [--prompts 80] [--backend vllm]
                                 [--warm-to 1000000] [--defaults-at 25000,100000] [--report-to tensorboard] [--out DIR]

One large extraction, prefixes of it: ShareGPT conversations (each cut to its first two user/assistant pairs,
rendered with the target's chat template, at most `--max-length` tokens) are prepared and extracted once, enough
for the largest point; the run at N reply tokens trains on the shortest prefix of that dataset holding N
loss-masked tokens (`--max-samples`), one epoch, with the small-run recipe (`RECIPE`: the best arm of
benchmarks/ablate.py), seed 0, and again with seed 1 at `--seeds-at`. At `--regen-at`, the same first user turns
answered by the target itself (`specdraft regenerate`, greedy, first turn only) train a draft of the same size
of data. Every draft is exported and served by vLLM behind the target over the MT-bench first turns (k=3,
greedy, 64 new tokens) in one run, side by side. Then: a table, the fit tau = a + b log10(tokens) over the
ShareGPT points (seed 0) with the tokens it projects for tau 1.5 and 2.0, the seed spread, and `scaling.png`.
`--warm-to N` adds one point past the extraction without redoing it: the largest point's draft trained on the
next samples by `train --init-from` (`warm_rows`). `--defaults-at` trains the library's own settings at those
points, against the recipe (`defaults_rows`). An `--out` of an earlier run is reused: its extraction, every
draft already exported there, and the vLLM results of every draft served there by the same vLLM at the same
settings (`served.json`).
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
from quality import first_turns, serve_rows, served  # benchmarks/quality.py

from specdraft.capture.extract import extract
from specdraft.data.prepare import load_dataset, prepare
from specdraft.data.regenerate import regenerate
from specdraft.export import export
from specdraft.train.batches import plan_batches
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

RECIPE = {k: v for k, v in ARMS["best_spb2_fc_high_ema0.99"].items()}  # the small-run recipe (README)
BASE = TrainConfig(draft_vocab_size=8192, ttt_steps=3, epochs=1, val_fraction=0.0, checkpoint_every=10**6,
                   recipe="off", progress=False, tensorboard=False, **RECIPE)  # fmt: skip


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


def steps_at(lengths: list[int], loss: list[int], k: int, points: list[int], seed: int, max_length: int
             ) -> dict[int, tuple[int, int]]:  # fmt: skip
    """point -> (optimizer steps, reply tokens trained) after the first batches of the trainer's own epoch-0 plan
    over samples [0, k) that hold `point` loss-masked tokens (the plan `train` makes: same lengths, same seed)."""
    lens = {s: min(lengths[s], max_length) for s in range(k) if lengths[s] >= 3}
    plan = plan_batches(sorted(lens), lens, BASE.max_tokens, 1, seed)
    out, cum, todo = {}, 0, sorted(points)
    for i, batch in enumerate(plan):
        cum += sum(loss[s] for s in batch)
        while todo and cum >= todo[0]:
            out[todo.pop(0)] = ((i + 1) * BASE.steps_per_batch, cum)
    for p in todo:  # the data holds fewer reply tokens: the whole epoch
        out[p] = (len(plan) * BASE.steps_per_batch, cum)
    return out


def trained(hs: Path, run: Path, exp: Path, cfg: TrainConfig) -> tuple[float, list[dict]]:
    """Train `cfg` on `hs` into `run` and export its final draft to `exp`, unless `exp` is there (done before):
    (the seconds that took, the run's train records)."""
    if not exp.exists():
        t0 = time.perf_counter()
        final = train(str(hs), str(run), cfg)
        assert export(str(final), str(exp), format="speculators", k=3, check_vllm=False) == 0
        (exp / "seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return float((exp / "seconds.txt").read_text()), [r for r in recs if r["split"] == "train"]


def snapshot_rows(root: Path, data: str, hs: Path, ds_dir: Path, points: list[int], top: int, seed: int, a
                  ) -> list[dict]:  # fmt: skip
    """One run per (data, seed) over the shortest prefix holding `top` reply tokens, stopped at each point's
    step, exported there, and resumed (exact; `--max-steps` may change on `--resume`). The schedule is
    constant after warmup (the recipe), so the draft at point p is the draft of a one-epoch run on p reply
    tokens: a random p-token subset of the prefix rather than its first p tokens. Warmup is the first
    point's (1.5% of its steps), where a separate run would warm up over 1.5% of its own."""
    ds = load_dataset(str(ds_dir))
    loss, lengths = [int(sum(m)) for m in ds.loss_mask], [len(x) for x in ds.input_ids]
    k = prefix_for(loss, top)
    at = steps_at(lengths, loss, k, points, seed, a.max_length)
    run, rows, spent = root / f"train_{data}_seed{seed}", [], 0.0
    for p in sorted(points):
        steps, tokens = at[p]
        cfg = replace(BASE, max_length=a.max_length, max_samples=k, seed=seed, max_steps=steps,
                      resume=(run / "final").exists(), report_to=a.report_to)  # fmt: skip
        exp = root / f"export_{data}_{p}_seed{seed}"
        seconds, recs = trained(hs, run, exp, cfg)
        done = max(r["step"] for r in recs if r["step"] <= steps)
        assert done == steps, (done, steps)
        spent += seconds
        rows.append({"arm": f"{data}_{p}_seed{seed}", "export": str(exp), "point": p, "data": data, "seed": seed,
                     "steps": steps, "reply_tokens": tokens, "samples_in_prefix": k, "train_s": round(spent, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sharegpt_rows(root: Path, a, points: list[int], seeds_at: list[int]) -> list[dict]:
    """One extraction of the shortest prefix holding the largest point; snapshots of one run per seed."""
    ds_dir, hs = root / "dataset", root / "hidden_states"
    if not any(hs.glob("manifest-*.json")):
        n = max(64, max(points) // 150)  # ~150+ reply tokens per conversation here: enough, checked below
        convs = conversations(root / "conversations.jsonl", n, 2)
        prepare(str(convs), str(ds_dir), max_length=a.max_length, overwrite=True)
        loss = [int(sum(m)) for m in load_dataset(str(ds_dir)).loss_mask]
        extract(
            str(ds_dir),
            str(hs),
            backend=a.backend,
            skip_doctor=True,
            max_samples=prefix_for(loss, max(a.prefix_tokens, max(points))),
        )
    loss = [int(sum(m)) for m in load_dataset(str(ds_dir)).loss_mask]
    if sum(loss) < max(points):
        print(f"scaling: the dataset holds {sum(loss)} reply tokens, fewer than {max(points)}: the last point "
              "trains on all of them", flush=True)  # fmt: skip
    top = max(a.prefix_tokens, max(points))
    rows = snapshot_rows(root, "sharegpt", hs, ds_dir, points, top, 0, a)
    return rows + (snapshot_rows(root, "sharegpt", hs, ds_dir, seeds_at, top, 1, a) if seeds_at else [])


def defaults_rows(root: Path, a, points: list[int]) -> list[dict]:
    """`--defaults-at`: the library's own settings (`specdraft train` as it ships: lr 1e-4, 4096 tokens a step,
    cosine to zero, none of the recipe's), with the curve's draft vocabulary and K, one epoch on the shortest
    prefix holding each point's reply tokens. A run per point (cosine's schedule depends on the run's length);
    the recipe's own point is the seed-0 ShareGPT row at the same tokens."""
    ds_dir, hs = root / "dataset", root / "hidden_states"
    loss = [int(sum(m)) for m in load_dataset(str(ds_dir)).loss_mask]
    lib = TrainConfig()
    base = replace(BASE, **{k: getattr(lib, k) for k in RECIPE})  # lr, tokens a step, schedule and the rest
    rows = []
    for p in sorted(points):
        k, run, exp = prefix_for(loss, p), root / f"train_defaults_{p}", root / f"export_defaults_{p}_seed0"
        cfg = replace(base, max_length=a.max_length, max_samples=k, seed=0, resume=(run / "checkpoints").exists(),
                      report_to=a.report_to)  # fmt: skip
        seconds, recs = trained(hs, run, exp, cfg)
        rows.append({"arm": f"defaults_{p}_seed0", "export": str(exp), "point": p, "data": "sharegpt_defaults", "seed": 0,
                     "steps": max(r["step"] for r in recs), "reply_tokens": sum(loss[:k]), "samples_in_prefix": k,
                     "train_s": seconds})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def warm_rows(root: Path, a, top: int, rows: list[dict]) -> list[dict]:
    """`--warm-to N`: the curve past the prefix without extracting and training it again. The seed-0 draft at the
    prefix's end trains on (`train --init-from`: its weights and vocabulary, a new optimizer and warmup) the next
    samples of the same dataset, until N reply tokens in all, one epoch: every reply token seen once, as at the
    other points, but the optimizer's state restarts at the prefix's end and the draft vocabulary is the
    prefix's. A point of its own kind (`sharegpt_warm`), plotted apart and left out of the fit."""
    if not a.warm_to:
        return []
    ds = load_dataset(str(root / "dataset"))
    loss = [int(sum(m)) for m in ds.loss_mask]
    k0, k1 = prefix_for(loss, top), prefix_for(loss, a.warm_to)
    assert k1 > k0, f"--warm-to {a.warm_to}: the dataset holds no samples past the prefix's {k0}"
    more, hs, run = root / "ds_more", root / "hs_more", root / "train_sharegpt_seed0_warm"
    if not any(hs.glob("manifest-*.json")):  # samples [k0, k1), prepared again from their own records
        import pyarrow.parquet as pq

        recs = (
            pq.read_table(root / "dataset" / "data.parquet", columns=["record"]).column("record").to_pylist()
        )
        lines = (root / "conversations.jsonl").read_text().splitlines()
        src = root / "conversations_more.jsonl"
        src.write_text("".join(lines[r] + "\n" for r in recs[k0:k1]))
        prepare(str(src), str(more), max_length=a.max_length, overwrite=True)
        again = load_dataset(str(more))
        assert again.input_ids == ds.input_ids[k0:k1] and again.loss_mask == ds.loss_mask[k0:k1]
        extract(str(more), str(hs), backend=a.backend, skip_doctor=True)
    (start,) = [r for r in rows if r["data"] == "sharegpt" and r["seed"] == 0 and r["point"] == max(r["point"] for r in rows)]  # fmt: skip
    exp = root / f"export_sharegpt_warm_{a.warm_to}_seed0"
    cfg = replace(BASE, max_length=a.max_length, seed=0, init_from=str(root / "train_sharegpt_seed0" / "final"),
                  resume=(run / "checkpoints").exists(), report_to=a.report_to)  # fmt: skip
    seconds, recs = trained(hs, run, exp, cfg)
    steps = max(r["step"] for r in recs)
    row = {"arm": f"sharegpt_warm_{a.warm_to}_seed0", "export": str(exp), "point": a.warm_to, "data": "sharegpt_warm",
           "seed": 0, "steps": start["steps"] + steps, "reply_tokens": start["reply_tokens"] + sum(loss[k0:k1]),
           "samples_in_prefix": k1, "train_s": round(start["train_s"] + seconds, 1)}  # fmt: skip
    print(json.dumps(row), flush=True)
    return [row]


def regen_rows(root: Path, a, points: list[int]) -> list[dict]:
    """The target's own first-turn replies to ShareGPT's first user turns: one regeneration and extraction for
    the largest point, snapshots at each."""
    if not points:
        return []
    top = max(points)
    convs = first_turns(root / "first_turns.jsonl", max(16, top // 100), a.max_length - 256)
    regen = regenerate(str(convs), str(root / "regenerated"), turns="first", max_new_tokens=256,
                       max_prompt_tokens=a.max_length - 256)  # fmt: skip
    ds = prepare(str(regen), str(root / "ds_regen"), max_length=a.max_length, overwrite=True)
    hs = root / "hs_regen"
    if not any(hs.glob("manifest-*.json")):
        loss = [int(sum(m)) for m in load_dataset(str(ds)).loss_mask]
        extract(str(ds), str(hs), backend=a.backend, skip_doctor=True, max_samples=prefix_for(loss, top))
    return snapshot_rows(root, "regenerated", hs, Path(ds), points, top, 0, a)


def serve_cached(rows: list[dict], a, root: Path) -> dict:
    """serve_rows for the exports not served yet by this vLLM at these settings (`root/served.json`, seeded from
    an earlier run's `eval/report_vllm.json`): greedy tau is a property of the draft, so an extended curve serves
    only its new drafts. Returns {"vllm_version", "prompts"}."""
    import vllm

    key = {"vllm_version": vllm.__version__, "prompts": a.prompts, "max_num_seqs": a.max_num_seqs}
    f, old = root / "served.json", root / "eval" / "report_vllm.json"
    cache = json.loads(f.read_text()) if f.exists() else {"key": key, "drafts": {}}
    if cache["key"] != key:
        cache = {"key": key, "drafts": {}}
    if old.exists() and not cache["drafts"]:
        rep = json.loads(old.read_text())
        s = rep["settings"]
        if (rep["vllm_version"], s["prompts"], s["max_num_seqs"], s["k"]) == (*key.values(), 3):
            cache["drafts"] = {e: served(d) for e, d in rep["drafts"].items()}
    todo = [r for r in rows if r["export"] not in cache["drafts"]]
    if todo:
        serve_rows(todo, a.prompts, root / "eval", a.max_num_seqs)
        for r in todo:
            cache["drafts"][r["export"]] = {k: r[k] for k in ("tau", "acceptance", "lossless")}
        f.write_text(json.dumps(cache, indent=1))
    print(f"scaling: {len(rows) - len(todo)} draft(s) served before by vLLM {key['vllm_version']} at these "
          f"settings, {len(todo)} served now", flush=True)  # fmt: skip
    for r in rows:
        r.update(cache["drafts"][r["export"]])
    return {"vllm_version": key["vllm_version"], "prompts": a.prompts}


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
               "seed_spread": spread, "recipe_minus_defaults": {}}  # fmt: skip
    for d in (r for r in rows if r["data"] == "sharegpt_defaults"):
        same = [
            r["tau"] for r in rows if r["data"] == "sharegpt" and r["seed"] == 0 and r["point"] == d["point"]
        ]
        if same:
            summary["recipe_minus_defaults"][d["point"]] = round(same[0] - d["tau"], 3)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for data, marker, label in (
        ("sharegpt", "o", "sharegpt replies"),
        ("regenerated", "s", "regenerated replies"),
        ("sharegpt_warm", "^", "sharegpt, warm-started from the largest point (not fitted)"),
        ("sharegpt_defaults", "x", "sharegpt, the library's default settings (not fitted)"),
    ):
        pts = [(r["reply_tokens"], r["tau"]) for r in rows if r["data"] == data]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=label)
    xs = [min(r["reply_tokens"] for r in rows) * 0.8, max(r["reply_tokens"] for r in rows) * 1.25]
    ax.plot(xs, [a + b * math.log10(x) for x in xs], "--", label=f"fit: {a:.3f} + {b:.3f} log10(tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("training reply tokens (one epoch)")
    ax.set_ylabel("vLLM tau, MT-bench first turns (k=3)")
    ax.set_title("SmolLM2-135M-Instruct: acceptance against training data")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="25000,50000,100000,200000,400000,1000000")
    p.add_argument("--seeds-at", default="50000,200000,1000000")
    p.add_argument("--regen-at", default="25000,50000")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=0,
        help="reply tokens of the prefix the ShareGPT runs draw from (default: the largest point)",
    )
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--max-num-seqs", type=int, default=80, help="MT-bench prompts vLLM decodes together")
    p.add_argument(
        "--warm-to",
        type=int,
        default=0,
        help="one more point, N reply tokens: the prefix's draft trained on by --init-from (warm_rows)",
    )
    p.add_argument(
        "--defaults-at", default="", help="points also trained with the library's defaults (defaults_rows)"
    )
    p.add_argument("--backend", default="vllm", help="extraction backend")
    p.add_argument("--report-to", default="", help="trackers of every training run (train --report-to)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        points = ints(a.points)
        rows = sharegpt_rows(root, a, points, ints(a.seeds_at))
        rows += warm_rows(root, a, max(a.prefix_tokens, max(points)), rows)
        rows += regen_rows(root, a, ints(a.regen_at)) + defaults_rows(root, a, ints(a.defaults_at))
        rep = serve_cached(rows, a, root)
        summary = report(rows, root)
        (root / "scaling.json").write_text(json.dumps({"rows": rows, **summary}, indent=1))
    print(f"\nvLLM {rep['vllm_version']}, MT-bench first turns: {rep['prompts']}, k=3, greedy, 64 new "
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
          f"seed spread (max - min tau) {summary['seed_spread']}; recipe minus the library's defaults "
          f"{summary['recipe_minus_defaults']}; plot: {root / 'scaling.png'}")  # fmt: skip


if __name__ == "__main__":
    main()

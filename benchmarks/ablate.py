"""Training ablations at one setting, each draft served by vLLM: which defaults give the best tau per token of data.

    python benchmarks/ablate.py [--samples 300] [--max-length 512] [--pairs 2] [--prompts 80]
                                [--arms defaults,lr3e-4,...] [--out DIR]

An `--out` kept from an earlier run is reused: its extraction, and every arm already exported there.

The setting (issue 11's, the speculators peer's): the first `--samples` usable ShareGPT conversations cut to
at most `--pairs` user/assistant pairs, rendered with the target's (ChatML) template and truncated to
`--max-length` tokens, extracted once (hf backend); draft vocabulary 8192, 3 TTT steps, one epoch. Every
arm trains from the same shards with seed 0 and its data order (`ARM_seedN`, listed in `SEEDS`, with seed N:
the seed moves tau by about +-0.015 here) and lists what it changes against the library defaults; every draft is exported
and served by vLLM behind the target over the MT-bench first turns (k=3, greedy, 64 new tokens) in one run,
side by side. Prints one table. The best arm: `best_spb2_fc_high_ema0.99` (`BEST`, the best loss settings,
with `--steps-per-batch 2 --fc-init high --ema 0.99`). An arm with `layers` extracts its own aux layers once.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from quality import serve_rows  # benchmarks/quality.py, beside this script

from specdraft.capture.extract import extract
from specdraft.data.prepare import MANIFEST_FILE, normalize, prepare, read_conversations, sharegpt_path
from specdraft.export import export
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

BASE = TrainConfig(draft_vocab_size=8192, ttt_steps=3, epochs=1, val_fraction=0.0, checkpoint_every=10**6,
                   recipe="off", progress=False, tensorboard=False, seed=0)  # fmt: skip
SMALL = {"lr": 1e-3, "max_tokens": 512, "schedule": "constant"}  # the best optimizer settings at this size
ARMS = {  # name: what changes against the library defaults at this setting
    "defaults": {},
    "lr3e-4": {"lr": 3e-4},
    "lr1e-3": {"lr": 1e-3},
    "lr1e-3_tok2048": {"lr": 1e-3, "max_tokens": 2048},
    "lr1e-3_decay1": {"lr": 1e-3, "decay": 1.0},
    "lr1e-3_no_init_head": {"lr": 1e-3, "init_lm_head": False},
    "lr1e-3_constant": {"lr": 1e-3, "schedule": "constant"},
    "lr1e-3_no_oov_mask": {"lr": 1e-3, "oov_mask": False},
    "lr1e-3_nbr": {"lr": 1e-3, "norm_before_residual": True},
    "tok512": {"max_tokens": 512},
    "lr3e-4_tok512": {"lr": 3e-4, "max_tokens": 512},
    "lr1e-3_tok512": {"lr": 1e-3, "max_tokens": 512},
    "lr1e-3_tok1024": {"lr": 1e-3, "max_tokens": 1024},
    "lr1e-3_tok512_constant": SMALL,
    "lr2e-3_tok512_constant": {**SMALL, "lr": 2e-3},
    "lr1e-3_tok512_constant_no_init_head": {**SMALL, "init_lm_head": False},
    "lr1e-3_tok512_constant_decay0.5": {**SMALL, "decay": 0.5},
    "lr1e-3_tok512_constant_noclip": {**SMALL, "grad_clip": 0.0},
    "lr1e-3_tok512_constant_hard": {**SMALL, "hard_weight": 1.0},
    "lr1e-3_tok512_constant_prompt_loss": {**SMALL, "prompt_loss": True},
    "lr1e-3_tok512_constant_prompt_loss_decay0.5": {**SMALL, "prompt_loss": True, "decay": 0.5},
    "lr1e-3_tok512_constant_prompt_loss_decay0.5_hard": {
        **SMALL,
        "prompt_loss": True,
        "decay": 0.5,
        "hard_weight": 1.0,
    },
    "lr1e-3_tok512_constant_prompt_loss_hard": {**SMALL, "prompt_loss": True, "hard_weight": 1.0},
    "lr1e-3_tok512_wsd_prompt_loss_hard": {
        **SMALL,
        "schedule": "wsd",
        "prompt_loss": True,
        "hard_weight": 1.0,
    },
    "lr1e-3_tok512_constant_prompt_loss_mix0.5": {**SMALL, "prompt_loss": True, "hard_weight": 0.5},
    "lr1.5e-3_tok512_constant_prompt_loss_hard": {
        **SMALL,
        "lr": 1.5e-3,
        "prompt_loss": True,
        "hard_weight": 1.0,
    },
    "lr7e-4_tok512_constant_prompt_loss_hard": {**SMALL, "lr": 7e-4, "prompt_loss": True, "hard_weight": 1.0},
}
BEST = ARMS["lr1e-3_tok512_constant_prompt_loss_decay0.5_hard"]
ARMS.update({
    "best_spb2": {**BEST, "steps_per_batch": 2},
    "best_spb4": {**BEST, "steps_per_batch": 4},
    "best_spb4_lr5e-4": {**BEST, "steps_per_batch": 4, "lr": 5e-4},
    "best_spb2_decay0.3": {**BEST, "steps_per_batch": 2, "decay": 0.3},
    "best_spb2_ttt4": {**BEST, "steps_per_batch": 2, "ttt_steps": 4},
    "best_spb3_lr7e-4": {**BEST, "steps_per_batch": 3, "lr": 7e-4},
    "best_spb2_layers2_15_29": {**BEST, "steps_per_batch": 2, "layers": (2, 15, 29)},  # own extraction
    "best_spb2_fc_high": {**BEST, "steps_per_batch": 2, "fc_init": "high"},
    "best_spb2_fc_high_lr1.5e-3": {**BEST, "steps_per_batch": 2, "fc_init": "high", "lr": 1.5e-3},
    "best_spb2_fc_high_decay0.3": {**BEST, "steps_per_batch": 2, "fc_init": "high", "decay": 0.3},
    "best_spb2_fc_high_ema0.99": {**BEST, "steps_per_batch": 2, "fc_init": "high", "ema": 0.99},
})  # fmt: skip
for _n in (30, 120, 240):  # issue 27: the bias-corrected --ema at few steps, against the raw weights
    ARMS[f"best_spb2_fc_high_steps{_n}"] = {**BEST, "steps_per_batch": 2, "fc_init": "high", "max_steps": _n}
    ARMS[f"best_spb2_fc_high_ema0.99_steps{_n}"] = {**ARMS[f"best_spb2_fc_high_steps{_n}"], "ema": 0.99}
SEEDS = {  # arms also run with other seeds (the draft's init and the data order): ARM_seedN
    "lr1e-3_tok512_constant": (1, 2),
    "lr1e-3_tok512_constant_prompt_loss": (1,),
    "lr1e-3_tok512_constant_prompt_loss_decay0.5": (1, 2),
    "lr1e-3_tok512_constant_prompt_loss_decay0.5_hard": (1, 2, 3, 4),
    "lr1e-3_tok512_constant_prompt_loss_hard": (1,),
    "lr1e-3_tok512_wsd_prompt_loss_hard": (1,),
    "best_spb2": (1, 2, 3, 4),
    "best_spb2_fc_high": (1, 2, 3, 4),
    "best_spb2_fc_high_ema0.99": (1, 2, 3, 4),
}
ARMS.update({f"{name}_seed{s}": {**ARMS[name], "seed": s} for name, seeds in SEEDS.items() for s in seeds})


def conversations(out: Path, n: int, pairs: int) -> Path:
    """The first n usable ShareGPT conversations, each cut to its first `pairs` user/assistant pairs."""
    rows = []
    for _, raw in read_conversations(sharegpt_path()):
        msgs, why = normalize(raw)
        if why:
            continue
        kept, users = [], 0
        for m in msgs:
            users += m["role"] == "user"
            if users > pairs:
                break
            kept.append(m)
        rows.append({"messages": kept})
        if len(rows) == n:
            break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _steps(run: Path) -> int:
    """Optimizer steps of a finished training run (its last metrics record)."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == "train"][-1]["step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    p.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    a = p.parse_args()
    arms = a.arms.split(",")
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        ds, hs = root / "dataset", root / "hidden_states"
        if not any(hs.glob("manifest-*.json")):  # an --out of an earlier run keeps its extraction: reused
            convs = conversations(root / "conversations.jsonl", a.samples, a.pairs)
            prepare(str(convs), str(ds), max_length=a.max_length)
            extract(str(ds), str(hs), backend="hf", skip_doctor=True)
        man = json.loads((ds / MANIFEST_FILE).read_text())
        rows = []
        for name in arms:
            if (root / f"export_{name}").exists():  # trained by an earlier run on this --out
                rows.append({"arm": name, "changes": ARMS[name], "export": str(root / f"export_{name}"),
                             "steps": _steps(root / f"train_{name}"), "train_s": None})  # fmt: skip
                continue
            changes = dict(ARMS[name])
            layers = changes.pop("layers", None)  # other aux layers than the default: their own extraction
            shards = hs if layers is None else root / ("hidden_states_layers_" + "_".join(map(str, layers)))
            if layers is not None and not any(shards.glob("manifest-*.json")):
                extract(str(ds), str(shards), backend="hf", layers=list(layers), skip_doctor=True)
            cfg = replace(BASE, max_length=a.max_length, **changes)
            t0 = time.perf_counter()
            final = train(str(shards), str(root / f"train_{name}"), cfg)
            meta = json.loads((Path(final) / "config.json").read_text())["train"]
            exp = root / f"export_{name}"
            assert export(str(final), str(exp), format="speculators", k=3, check_vllm=False) == 0
            rows.append({"arm": name, "changes": ARMS[name], "steps": meta["steps"],
                         "train_s": round(time.perf_counter() - t0, 1), "export": str(exp)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        rep = serve_rows(rows, a.prompts, root / "eval")
    print(f"\n{man['num_samples']} conversations, {man['num_loss_tokens']} loss tokens, one epoch each; "
          f"draft vocabulary 8192, K=3; MT-bench first turns: {rep['settings']['prompts']}, k=3, greedy, "
          f"64 new tokens; vLLM {rep['vllm_version']}")  # fmt: skip
    print(f"{'arm':<22}{'steps':>6}{'train s':>8}{'vLLM tau':>9}  acceptance per position")
    for r in rows:
        print(f"{r['arm']:<22}{r['steps']:>6}{r['train_s'] or '-':>8}{r['tau']:>9.3f}  {r['acceptance']}  "
              f"lossless {r['lossless']}")  # fmt: skip


if __name__ == "__main__":
    main()

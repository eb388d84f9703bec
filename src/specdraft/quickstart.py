"""quickstart: the whole pipeline on the embedded default (SmolLM2-135M-Instruct) with real conversations.

regenerate (ShareGPT user turns, the target's own replies: on-policy data) -> prepare -> extract -> train
-> eval on MT-bench (trained vs untrained draft, lossless check) -> export (speculators + eagle3) -> serve the
export in vLLM (when installed: tau, tokens/s with and without the draft, batched and at batch 1)
-> a summary table and plots. Every stage skips work already complete
(prepare and eval by their outputs, extract shard by shard, train from its newest checkpoint), so an
interrupted quickstart resumes where it stopped when run again.

The CPU budget is tight (2 cores: prefill ~250-550 tok/s, draft training ~770 tok/s at the settings
below), so quickstart picks a smaller draft vocabulary (8192), 3 TTT steps and a few hundred
conversations, and the settings measured best at that data size (lr 1e-3, 512 tokens a step, constant
lr: `benchmarks/ablate.py`), and says so in its summary; the library defaults (`specdraft train`) stay
EAGLE-3's (32000, 7, lr 1e-4, 4096 tokens, cosine), which are for large data.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specdraft.fileio import DirLock, atomic_write_text, changed_settings
from specdraft.targets import EMBEDDED_DEFAULT

SETTINGS_FILE = "quickstart.json"  # the budget and device of the run in this directory


@dataclass
class Budget:
    """Sizes of one quickstart run."""

    samples: int  # ShareGPT conversations prepared and extracted
    max_length: int  # tokens per conversation (longer ones are truncated)
    epochs: int  # training passes
    draft_vocab_size: int  # reduced draft vocabulary
    ttt_steps: int  # training-time-test depth
    eval_prompts: int  # MT-bench first turns decoded
    max_new_tokens: int  # tokens generated per prompt
    k: int  # draft tokens per round (chain)
    reply_tokens: int  # regenerate: cap of the target's own replies (0 = train on ShareGPT's replies)
    serve_prompts: int  # vLLM: MT-bench first turns served with and without the draft (0 = skip)
    batch1_prompts: int  # vLLM: of those, served one at a time (batch 1, latency)
    lr: float  # peak learning rate
    max_tokens: int  # padded tokens per optimizer step (small: more steps from little data)
    schedule: str  # learning-rate schedule after warmup


BUDGETS = {
    "tiny": Budget(
        48, 256, 1, 4096, 3, 4, 32, 3, 48, 4, 2, 1e-3, 2048, "cosine"
    ),  # a smoke run, a few minutes
    # default: lr 1e-3, 512 tokens a step and a constant schedule measured best at this data size
    # (benchmarks/ablate.py; issue 11's closing note)
    "default": Budget(320, 384, 3, 8192, 3, 16, 64, 3, 256, 80, 8, 1e-3, 512, "constant"),  # ~30 min, 2 cores
    "large": Budget(2000, 1024, 3, 16384, 5, 80, 128, 5, 512, 80, 16, 1e-3, 2048, "cosine"),  # hours on CPU
}


def _stage(name: str) -> float:
    print(f"\n=== quickstart: {name} ===", flush=True)
    return time.time()


def quickstart(
    out: str = "runs/quickstart", budget: str = "default", device: str = "cpu", fresh: bool = False
) -> int:
    """Run prepare -> extract -> train -> eval -> export on the embedded default, resuming where it stopped.

    Args:
        out: working directory of the run (every stage writes a subdirectory).
        budget: `tiny` (smoke test), `default` (under 30 min on a 2-core CPU) or `large`.
        device: cpu or cuda (bf16 on GPU).
        fresh: delete the working directory first instead of resuming.
    """
    if budget not in BUDGETS:
        raise ValueError(f"--budget must be one of {sorted(BUDGETS)}, not {budget!r}")
    b = BUDGETS[budget]
    root = Path(out).resolve()  # one spelling of the run's paths, whatever the user typed
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    with DirLock(root, "quickstart"):
        _check_settings(root, {"budget": budget, **asdict(b), "device": device})
        return _run(root, budget, b, device)


def _check_settings(root: Path, settings: dict) -> None:
    """Refuse to resume a run made with other settings (its stages would be reused under a new label)."""
    f = root / SETTINGS_FILE
    if f.exists():
        before = json.loads(f.read_text())
        diff = changed_settings(before, settings)
        if diff:
            shown = ", ".join(f"{k} {was!r} -> {now!r}" for k, was, now in diff)
            raise ValueError(f"{root} holds a quickstart run with other settings ({shown}): rerun with "
                             f"--budget {before.get('budget')} to resume it, add --fresh to start over, or "
                             "choose another --out")  # fmt: skip
    atomic_write_text(f, json.dumps(settings, indent=1))


def _run(root: Path, budget: str, b: Budget, device: str) -> int:
    """The stages, each skipping the work already complete."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import MANIFEST_FILE, prepare
    from specdraft.eval.reference import UNTRAINED, evaluate_report
    from specdraft.eval.report import summary_lines
    from specdraft.export import export, serve_commands
    from specdraft.model.checkpoint import latest_checkpoint
    from specdraft.targets import resolve_target_dir
    from specdraft.train.config import TrainConfig
    from specdraft.train.loop import train

    times: dict[str, float] = {}
    t_all = time.time()
    dtype = "bfloat16" if device.startswith("cuda") else "float32"

    # 0. regenerate: ShareGPT's user turns, the target's own replies (vLLM when installed, else transformers)
    conversations = _regenerate(root, b, device, dtype, times) if b.reply_tokens else "sharegpt"

    # 1. prepare: conversations -> ids + assistant loss mask
    t = _stage("prepare (conversations -> token ids + assistant loss mask)")
    ds_dir = root / "dataset"
    if not (ds_dir / MANIFEST_FILE).exists():
        prepare(
            conversations,
            str(ds_dir),
            target=EMBEDDED_DEFAULT,
            max_length=b.max_length,
            max_samples=b.samples,
        )
    dman = json.loads((ds_dir / MANIFEST_FILE).read_text())
    times["prepare"] = time.time() - t

    # 2. extract: hidden states of the EAGLE-3 layers (resumes shard by shard)
    t = _stage("extract (target prefill, hidden states of layers 2, 15, 27 and 30)")
    hs_dir = root / "hidden_states"
    extract(str(ds_dir), str(hs_dir), target=EMBEDDED_DEFAULT, device=device, dtype=dtype, samples_per_shard=16,
            max_tokens_per_batch=2048)  # fmt: skip
    xman = json.loads(next(hs_dir.glob("manifest-*.json")).read_text())
    times["extract"] = time.time() - t

    # 3. train: the EAGLE-3 draft with training-time test (resumes from its newest checkpoint)
    t = _stage(f"train (draft vocabulary {b.draft_vocab_size}, {b.ttt_steps} TTT steps, {b.epochs} epochs)")
    train_dir = root / "train"
    final = train_dir / "final"
    if not (final / "config.json").exists():
        cfg = TrainConfig(draft_vocab_size=b.draft_vocab_size, ttt_steps=b.ttt_steps, epochs=b.epochs, lr=b.lr,
                          max_tokens=b.max_tokens, schedule=b.schedule, checkpoint_every=50, val_fraction=0.05,
                          val_every=100, device=device,
                          resume=latest_checkpoint(train_dir) is not None)  # fmt: skip
        train(str(hs_dir), str(train_dir), cfg)
    tmeta = json.loads((final / "config.json").read_text()).get("train", {})
    times["train"] = time.time() - t

    # 4. eval: speculative decoding on MT-bench, trained vs untrained draft, lossless check
    t = _stage(
        f"eval (MT-bench first turns: {b.eval_prompts} prompts x {b.max_new_tokens} tokens, chain k={b.k})"
    )
    eval_dir = root / "eval"
    report_file = eval_dir / "report.json"
    if report_file.exists():
        report = json.loads(report_file.read_text())
    else:
        report = evaluate_report([str(final), UNTRAINED], target=EMBEDDED_DEFAULT, prompts="mtbench", turns=1,
                                 max_prompts=b.eval_prompts, max_new_tokens=b.max_new_tokens, k=b.k,
                                 counts=str(ds_dir), draft_vocab_size=b.draft_vocab_size, device=device,
                                 out=str(eval_dir))  # fmt: skip
    times["eval"] = time.time() - t

    # 5. export: a vLLM (speculators) and an SGLang/vLLM (eagle3) checkpoint
    t = _stage("export (speculators for vLLM, eagle3 for SGLang)")
    exp_spec, exp_e3 = root / "export" / "speculators", root / "export" / "eagle3"
    for fmt, d in (("speculators", exp_spec), ("eagle3", exp_e3)):
        if not (d / "config.json").exists():
            export(str(final), str(d), format=fmt, k=b.k, check_vllm=False)
    times["export"] = time.time() - t

    # 6. serve: the speculators export in vLLM, with and without the draft, batched and at batch 1
    served = None
    if b.serve_prompts and importlib.util.find_spec("vllm"):
        t = _stage(
            f"serve in vLLM ({b.serve_prompts} MT-bench first turns batched, {b.batch1_prompts} at batch 1)"
        )
        served = _serve(root / "serve", exp_spec, b)
        times["serve"] = time.time() - t

    # 7. summary
    trained = report["drafts"][str(final)]
    untrained = report["drafts"][UNTRAINED]
    summary = {
        "target": EMBEDDED_DEFAULT,
        "budget": {"name": budget, **asdict(b)},
        "library_defaults_differ": f"quickstart uses draft vocabulary {b.draft_vocab_size}, {b.ttt_steps} TTT "
        f"steps, lr {b.lr:g}, {b.max_tokens} tokens a step, {b.schedule} lr; `specdraft train` defaults to "
        "EAGLE-3's 32000, 7, 1e-4, 4096, cosine (for large data)",
        "data": {k: dman[k] for k in ("num_samples", "num_tokens", "num_loss_tokens")},
        "extract_tokens_per_s": xman.get("tokens_per_second_last_run"),
        "train": tmeta,
        "eval": {
            "trained": _brief(trained),
            "untrained": _brief(untrained),
            "baseline_tokens_per_s": report["baseline"]["tokens_per_s"],
        },
        "serve": served,
        "seconds": {k: round(v, 1) for k, v in times.items()} | {"total": round(time.time() - t_all, 1)},
        "plots": [str(p) for p in [train_dir / "training.png", *report.get("plots", [])] if Path(p).exists()],
        "exports": {"speculators": str(exp_spec), "eagle3": str(exp_e3)},
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    target_dir = str(resolve_target_dir(EMBEDDED_DEFAULT))
    print(_table(summary))
    print("\n".join(summary_lines(report)))
    if served:
        print("\n".join(served["lines"]))
    print("\nserve the draft:")
    for c in serve_commands(target_dir, str(exp_spec.resolve()), str(exp_e3.resolve()), b.k):
        print(f"  {c}")
    print(f"\nquickstart: summary {root / 'summary.json'}, plots {', '.join(summary['plots'])}")
    return 0


def _regenerate(root: Path, b: Budget, device: str, dtype: str, times: dict[str, float]) -> str:
    """The conversations file with the target's own replies to ShareGPT's first turns (resumes by chunk)."""
    from specdraft.data.regenerate import regenerate

    t = _stage(
        f"regenerate (the target's own replies to {b.samples} ShareGPT first turns, <= {b.reply_tokens} tokens)"
    )
    out = regenerate("sharegpt", str(root / "regenerated"), target=EMBEDDED_DEFAULT, turns="first",
                     max_new_tokens=b.reply_tokens, max_samples=b.samples, device=device, dtype=dtype,
                     max_prompt_tokens=b.max_length - 64)  # prompts that leave no room for a reply: skipped  # fmt: skip
    times["regenerate"] = time.time() - t
    return str(out)


def _serve(out: Path, export_dir: Path, b: Budget) -> dict:
    """vLLM's figures for the export (report reused when there): tau, speed batched and at batch 1, lossless."""
    from specdraft.eval.report import summary_lines
    from specdraft.eval.serving import REPORT_FILE, evaluate_vllm

    f = out / REPORT_FILE
    if f.exists():
        rep = json.loads(f.read_text())
    else:
        rep = evaluate_vllm([str(export_dir)], target=EMBEDDED_DEFAULT, prompts="mtbench", k=b.k,
                            max_new_tokens=b.max_new_tokens, max_prompts=b.serve_prompts,
                            batch1_prompts=b.batch1_prompts, out=str(out))  # fmt: skip
    d = rep["drafts"][str(export_dir)]
    b1 = d.get("batch1") or {}
    return {"prompts": rep["settings"]["prompts"], "tau": round(d["tau"], 3), "speedup": d["speedup"],
            "tokens_per_s": d["tokens_per_s"], "baseline_tokens_per_s": rep["baseline"]["tokens_per_s"],
            "batch1": {k: b1.get(k) for k in ("prompts", "tau", "speedup", "tokens_per_s", "round_cost_in_target_steps")},
            "batch1_baseline_tokens_per_s": rep["baseline"].get("batch1", {}).get("tokens_per_s"),
            "lossless": d["lossless"]["ok"], "lines": summary_lines(rep)}  # fmt: skip


def _brief(d: dict) -> dict:
    return {
        "tau": round(d["tau"], 3),
        "acceptance_per_position": [
            None if r is None else round(r, 3) for r in d["acceptance_rate_per_position"]
        ],
        "speedup": round(d["speedup"], 3),
        "tokens_per_s": round(d["tokens_per_s"], 2),
        "lossless": d["lossless"]["ok"] if d["lossless"]["checked"] else None,
    }


def _table(s: dict) -> str:
    tr, un = s["eval"]["trained"], s["eval"]["untrained"]
    val = s["train"].get("val", {}) if isinstance(s["train"], dict) else {}
    rows = [
        ("data", f"{s['data']['num_samples']} conversations, {s['data']['num_tokens']} tokens "
                 f"({s['data']['num_loss_tokens']} assistant)"),
        ("extraction", f"{s['extract_tokens_per_s'] or 0:.0f} tokens/s"),
        ("training", f"{s['seconds']['train']:.0f} s, {s['train'].get('steps', '?')} steps, val {_fmt_val(val)}"),
        ("tau (trained)", f"{tr['tau']:.3f}   acceptance per position {tr['acceptance_per_position']}"),
        ("tau (untrained)", f"{un['tau']:.3f}   acceptance per position {un['acceptance_per_position']}"),
        ("speedup", f"x{tr['speedup']:.2f} trained, x{un['speedup']:.2f} untrained "
                    f"(target alone {s['eval']['baseline_tokens_per_s']:.1f} tok/s)"),
        ("lossless (T=0)", "yes" if tr["lossless"] and un["lossless"] else "NO"),
        *_serve_rows(s.get("serve")),
        ("settings", s["library_defaults_differ"]),
        ("total time", f"{s['seconds']['total']:.0f} s ({', '.join(f'{k} {v:.0f}s' for k, v in s['seconds'].items() if k != 'total')})"),
    ]  # fmt: skip
    w = max(len(r[0]) for r in rows)
    line = "-" * 100
    return "\n".join([line, "quickstart summary: SmolLM2-135M-Instruct (embedded default)", line]
                     + [f"{k:<{w}}  {v}" for k, v in rows] + [line])  # fmt: skip


def _serve_rows(sv: dict | None) -> list[tuple[str, str]]:
    if not sv:
        return [("vLLM", "not installed: `make install-vllm` (or pip install vllm) to serve the draft")]
    b1 = sv["batch1"]
    return [
        ("vLLM tau", f"{sv['tau']:.3f} over {sv['prompts']} MT-bench first turns, lossless {'yes' if sv['lossless'] else 'NO'}"),
        ("vLLM batched", f"x{sv['speedup'] or 0:.2f}: {sv['tokens_per_s']:.1f} tok/s with the draft vs {sv['baseline_tokens_per_s']:.1f} alone"),
        ("vLLM batch 1", f"x{b1['speedup'] or 0:.2f}: {b1['tokens_per_s'] or 0:.1f} tok/s vs {sv['batch1_baseline_tokens_per_s'] or 0:.1f} alone "
                         f"({b1['prompts']} prompts; a round costs {b1['round_cost_in_target_steps'] or 0:.2f} target steps)"),
    ]  # fmt: skip


def _fmt_val(val: dict) -> str:
    if not val:
        return "-"
    parts = [
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
        for k, v in val.items()
        if not isinstance(v, (list, dict))
    ]
    return ", ".join(parts[:4])

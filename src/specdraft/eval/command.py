"""`specdraft eval`: the command, with the reference decoder (`--engine hf`) or vLLM (`--engine vllm`).

`--engine hf` is :func:`specdraft.eval.reference.evaluate_report`; `--engine vllm` exports training outputs
first and runs :func:`specdraft.eval.serving.evaluate_vllm` (with `--reference`, the reference decoder alongside). The summary
lines are :func:`specdraft.eval.report.summary_lines`; the exit status says whether a greedy run was lossless, or
at T > 0 with `--dist-samples`, whether the output kept the target's distribution (:mod:`specdraft.eval.stats`).
Every option is checked against the engine before anything loads: one engine's options given to the other are
refused with the fix, never dropped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

from specdraft.eval.prompts import rendering
from specdraft.eval.reference import REPORT_FILE, UNTRAINED, evaluate_report
from specdraft.eval.report import summary_lines
from specdraft.targets import EMBEDDED_DEFAULT


def evaluate(
    draft: list[str],
    target: str = "",
    prompts: str = "mtbench",
    turns: int = 1,
    max_prompts: int = 0,
    max_new_tokens: int = 128,
    k: int = 3,
    tree: bool = False,
    topk: int = 8,
    depth: int = 6,
    budget: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    draft_sample: Literal["greedy", "probabilistic"] = "greedy",
    verify: Literal["standard", "block"] = "standard",
    dist_samples: int = 0,
    counts: str = "",
    draft_vocab_size: int = 32000,
    device: str = "auto",
    dtype: Literal["auto", "float32", "bfloat16"] = "auto",
    out: str = "runs/eval",
    seed: int = 0,
    progress: bool = True,
    threads: int = 0,
    engine: Literal["hf", "vllm"] = "hf",
    tensor_parallel_size: int = 1,
    engine_args: str = "",
    batch1_prompts: int = 8,
    batch1_rounds: int = 1,
    reference: bool = False,
    trust_remote_code: bool = False,
    chat_template: str = "",
    chat_template_kwargs: str = "",
    layers: list[int] | None = None,
) -> int:
    """Measure drafts by real speculative decoding: tau, acceptance per position, speed, losslessness.

    Exit status 1 when a greedy (T=0) run's output differs from target-only decoding, else 0.

    Args:
        draft: one or more drafts: a `specdraft train` output dir (newest checkpoint), a saved draft dir, or
            `untrained` (a fresh draft: the baseline for a trained one; tau ~1).
        target: the target model (HF dir or id, or the embedded default smollm2-135m); default: the one the
            first trained draft records, else smollm2-135m.
        prompts: `mtbench` (80 MT-bench questions) or a jsonl of questions (`turns`) or chats (`messages`).
        turns: 1 = first turns only; 2 = both turns (the 2nd turn follows the target's own first answer).
        max_prompts: evaluate N prompts, round-robin over categories (0 = all).
        max_new_tokens: tokens generated per turn.
        k: chain drafting: draft tokens per round (3, as export writes and the serve lines use).
        tree: draft a dynamic tree (EAGLE-2/3) instead of a chain.
        topk: tree: children per node and nodes kept per depth.
        depth: tree: maximum draft tokens along one path.
        budget: tree: draft tokens verified per round.
        temperature: 0 = greedy (checked lossless: the same tokens as the target alone); > 0 = sampling with the
            exact rejection rule, both engines (checked with --dist-samples).
        top_p: vLLM: nucleus sampling's mass at T > 0 (1 = off).
        draft_sample: at T > 0, how the draft picks its tokens: greedy (its argmax; acceptance is then capped by
            the target's probability of that token) or probabilistic (sampled from the draft, the full p/q test);
            vLLM's draft_sample_method. The reference decoder drafts either way in a chain.
        verify: vLLM: standard (token by token) or block verification (Sun et al.; Model Runner V2, a GPU).
        dist_samples: at T > 0: check that speculative sampling keeps the target's distribution: N samples of the
            first 6 new tokens of the 4 shortest prompts with each draft and N from the target alone, compared by
            chi-square tests at a family-wise false-alarm rate of 1% (0 = off; 200 detects a few percent).
        counts: for `untrained`: a prepared dataset or extraction dir whose token counts pick the draft
            vocabulary (empty = uniform counts: the lowest token ids).
        draft_vocab_size: for `untrained`: draft vocabulary size.
        device: auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, cuda, cuda:1, ...
        dtype: auto (bfloat16 on a GPU that supports it, else float32), float32 or bfloat16.
        out: output directory (report.json, acceptance_per_position.png, tau_per_category.png).
        seed: seed of prompt-level random streams (sampling, untrained draft init).
        progress: show a progress bar.
        threads: torch CPU threads (0 = torch's default; 1 is steadier on a busy machine).
        engine: `hf` (the reference decoder here) or `vllm` (vLLM speculative decoding of the exported draft,
            its spec-decode counters; chain drafting, greedy or sampled).
        tensor_parallel_size: vLLM: GPUs the target is split over (the reference decoder runs unsplit).
        engine_args: vLLM: a JSON object of further `LLM(...)` options, checked before anything loads.
        batch1_prompts: vLLM: also serve the first N prompts one at a time (batch 1, latency) with and without
            the draft, and report the cost of a round (0 = batched only).
        batch1_rounds: vLLM: measure batch 1 in N rounds interleaved with the target alone (each in a fresh
            engine) and report the median speed-up: steadier on a shared machine, N reloads of every engine.
        reference: vLLM: also run the reference decoder here, on the full (unsplit) target, for each training
            output, its figures next to vLLM's (slow on a large target; exports are served by vLLM only).
        trust_remote_code: allow model code shipped with the target.
        chat_template: render prompts with this Jinja chat template (a file or the text) instead of the
            target's own (a base model has none: it is refused without this, before anything loads); a draft
            trained on data rendered otherwise is refused.
        chat_template_kwargs: JSON object of template variables, e.g. '{"enable_thinking": false}', as serving
            would pass them (thinking on or off).
        layers: for `untrained`: the draft's 3 aux layer ids, as extract's and train's --layers (default 2, L//2,
            L-3; needed for targets under 6 layers).
    """
    from specdraft.runtime import resolve_device, resolve_dtype

    _check_options(engine, temperature, top_p, draft_sample, verify, dist_samples, reference, tree,
                   hf_only={"--tree": tree, "--topk": topk != 8, "--depth": depth != 6, "--budget": budget != 32,
                            "--counts": counts, "--draft-vocab-size": draft_vocab_size != 32000,
                            "--device": device != "auto", "--threads": threads, "--layers": layers is not None})  # fmt: skip
    engine_kwargs = _check_engine(engine, tensor_parallel_size, engine_args, reference, batch1_rounds)
    check_eval_out(Path(out))  # before anything loads: results are never lost at the end to a bad --out
    target = target or _recorded_target(draft)
    from specdraft.targets import tensor_parallel_problems

    for problem in tensor_parallel_problems(
        target, tensor_parallel_size if engine == "vllm" else 1, trust_remote_code
    ):
        raise ValueError(f"eval: {problem}")  # from the target's config, before any engine loads
    device = resolve_device(device, "eval")
    dtype = resolve_dtype(dtype, device)
    template, kwargs = _check_rendering(draft, target, chat_template, chat_template_kwargs, trust_remote_code)
    with rendering(template, kwargs):
        sampling = dict(temperature=temperature, top_p=top_p, draft_sample=draft_sample, verify=verify,
                        dist_samples=dist_samples)  # fmt: skip
        return _evaluate(draft, target, prompts, turns, max_prompts, max_new_tokens, k, tree, topk, depth, budget,
                         sampling, counts, draft_vocab_size, device, dtype, out, seed, progress, threads, engine,
                         engine_kwargs, batch1_prompts, reference, trust_remote_code, layers, batch1_rounds)  # fmt: skip


#: what eval writes into --out: a directory holding only these (or nothing) is eval's to write into
EVAL_WRITES = ("report.json", "report_vllm.json", "acceptance_per_position.png", "tau_per_category.png",
               "eval_settings.json", ".specdraft.lock")  # fmt: skip


def check_eval_out(out_dir: Path) -> None:
    """Refuse, in one line with the fix, an --out eval cannot write or must not write into (a directory holding
    files eval did not write: a dataset's, a run's), as export refuses; a writable new or eval directory passes."""
    from specdraft.fileio import file_in_the_way

    fix = "choose a new or empty --out, or an earlier eval's"
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"eval: --out {out_dir} exists and is not a directory: {fix}")
    blocked = file_in_the_way(out_dir, "eval")
    if blocked is not None:
        raise ValueError(f"eval: {blocked}")
    if out_dir.is_dir():
        other = sorted(
            p.name
            for p in out_dir.iterdir()
            if p.name not in EVAL_WRITES and not p.name.startswith("export-")
        )
        if other:
            shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
            raise ValueError(
                f"eval: refusing to write into {out_dir}: it holds files eval did not write ({shown}): {fix}"
            )
    probe = out_dir if out_dir.is_dir() else next(p for p in out_dir.parents if p.exists())
    if not os.access(probe, os.W_OK):
        raise ValueError(f"eval: --out {out_dir} cannot be written here ({probe} is not writable): {fix}")


def _recorded_target(draft: list[str]) -> str:
    """The target the first trained draft records (the one it was trained for), else the embedded default."""
    from specdraft.model.checkpoint import draft_dir, load_draft_config

    for d in draft:
        p = draft_dir(d) if d != UNTRAINED else None
        if p is None:
            continue
        try:
            name = load_draft_config(p).target_name
        except (OSError, ValueError):
            continue
        if name:
            from specdraft.export import served_target  # an export naming a hub id not here: its local target

            name = served_target(p, name)
            print(f"eval: --target {name} (the target {p} records)", flush=True)
            return name
    return EMBEDDED_DEFAULT


def _check_options(
    engine: str, temperature: float, top_p: float, draft_sample: str, verify: str, dist_samples: int,
    reference: bool, tree: bool, hf_only: dict[str, object],
) -> None:  # fmt: skip
    """The sampling options and each engine's own options, every error at once, before anything loads."""
    errors = []
    if not (temperature >= 0 and math.isfinite(temperature)):
        errors.append(f"--temperature must be a finite number >= 0, not {temperature}")
    if not 0 < top_p <= 1:  # NaN fails too
        errors.append(f"--top-p must be in (0, 1], not {top_p}")
    if dist_samples < 0:
        errors.append(f"--dist-samples must be >= 0, not {dist_samples}")
    elif dist_samples and temperature == 0:
        errors.append("--dist-samples checks sampled output (T > 0); at T=0 every run checks token identity: "
                      "add --temperature or drop --dist-samples")  # fmt: skip
    if reference and temperature > 0:
        errors.append("--reference compares vLLM's rounds with the reference decoder's one by one, at T=0 only: "
                      "drop --reference or --temperature")  # fmt: skip
    if engine == "vllm":
        given = [name for name, v in hf_only.items() if v]
        if given:
            errors.append(f"{', '.join(given)}: options of the reference decoder (--engine hf); vLLM drafts a chain "
                          "of --k tokens from the export: drop them, or use --engine hf")  # fmt: skip
        errors += _check_sampling_methods(draft_sample, verify)
    else:
        if top_p != 1:
            errors.append("--top-p: vLLM only (the reference decoder samples from the whole distribution): add "
                          "--engine vllm or drop it")  # fmt: skip
        if verify != "standard":
            errors.append("--verify block: vLLM only (the reference decoder verifies token by token): add --engine "
                          "vllm or drop it")  # fmt: skip
        if tree and draft_sample != "greedy":
            errors.append("--draft-sample probabilistic drafts a chain; a tree's candidates are the draft's top-k: "
                          "drop one of --tree and --draft-sample")  # fmt: skip
    if errors:
        raise ValueError("eval: " + "; ".join(errors))


def _check_sampling_methods(draft_sample: str, verify: str) -> list[str]:
    """Errors for --draft-sample / --verify values the installed vLLM cannot serve (read from its
    SpeculativeConfig's fields, no model loaded); [] for vLLM's defaults."""
    import dataclasses
    import typing

    import torch

    from specdraft.engine import contract as engines
    from specdraft.eval.vllm_engine import sampling_methods

    wanted = sampling_methods(draft_sample, verify)
    if not wanted:
        return []
    version = engines.installed_version("vllm")
    if version is None:
        return ["--engine vllm needs vLLM installed (make install-vllm, or pip install vllm)"]
    cls = engines.get("vllm.SpeculativeConfig.sampling")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    errors = []
    for name, value in wanted.items():
        if name not in fields:
            errors.append(f"vLLM {version} has no speculative_config.{name} (it serves only greedy drafting and "
                          "standard verification): upgrade vLLM or drop the option")  # fmt: skip
        elif value not in typing.get_args(typing.get_type_hints(cls).get(name, str)):
            errors.append(
                f"vLLM {version}'s speculative_config.{name} has no {value!r}: upgrade vLLM or drop the option"
            )
    if wanted.get("rejection_sample_method") == "block" and not torch.cuda.is_available():
        errors.append("--verify block: vLLM implements block verification in its Model Runner V2 only (a GPU with "
                      "Triton); without a GPU it runs the V1 runner, which would verify token by token under a "
                      "config that says block: drop --verify block here")  # fmt: skip
    return errors


def _check_engine(
    engine: str, tensor_parallel_size: int, engine_args: str, reference: bool = False, batch1_rounds: int = 1
) -> dict:
    """The engine options checked before anything loads; returns vLLM's options ({} for `hf`)."""
    if engine == "vllm":
        return _engine_kwargs(tensor_parallel_size, engine_args)
    if engine != "hf":
        raise ValueError(f"--engine must be hf or vllm, not {engine!r}")
    if tensor_parallel_size != 1 or engine_args or reference or batch1_rounds != 1:
        raise ValueError(
            "--tensor-parallel-size, --engine-args, --reference and --batch1-rounds are vLLM options: add --engine vllm"
        )
    return {}


def _check_rendering(
    draft: list[str], target: str, chat_template: str, chat_template_kwargs: str, trust_remote_code: bool
) -> tuple[str | None, dict]:
    """The template (None: the target's own) and kwargs prompts are rendered with, from the target's tokenizer
    alone (no model loaded yet): refuses a target that cannot render chats (a base model without
    --chat-template) and a trained draft whose data was rendered otherwise (`train` records it)."""
    from specdraft.data.render import choose_template, require_chat_template, template_identity
    from specdraft.targets import load_tokenizer

    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    kwargs = choose_template(tok, chat_template, chat_template_kwargs)
    require_chat_template(tok, target)  # the prompts are chats (mtbench, or a file's user turns)
    now = template_identity(tok, kwargs)
    for d in draft:
        was = _recorded_rendering(d)
        if was.get("mode", "chat") != "chat":
            continue  # trained on raw documents: any chat rendering is new to it
        diff = [f"{k} {was[k]!r} in training, {now[k]!r} here" for k in now if k in was and was[k] != now[k]]
        if diff:
            raise ValueError(f"eval: {d} was trained on data rendered otherwise ({'; '.join(diff)}): pass the "
                             "--chat-template and --chat-template-kwargs its dataset was prepared with")  # fmt: skip
    return (tok.chat_template if chat_template else None), kwargs


def _recorded_rendering(draft: str) -> dict:
    """How a trained draft's data was rendered, from its `final/config.json` ({} when unknown)."""
    for f in (Path(draft) / "final" / "config.json", Path(draft) / "config.json"):
        if draft != UNTRAINED and f.is_file():
            try:
                return json.loads(f.read_text()).get("train", {}).get("rendering", {}) or {}
            except (OSError, ValueError, AttributeError):
                return {}
    return {}


def _evaluate(
    draft, target, prompts, turns, max_prompts, max_new_tokens, k, tree, topk, depth, budget, sampling, counts,
    draft_vocab_size, device, dtype, out, seed, progress, threads, engine, engine_kwargs, batch1_prompts,
    reference, trust_remote_code, layers, batch1_rounds=1,
) -> int:  # fmt: skip
    """`evaluate` with the engine options checked and the rendering chosen."""
    if engine == "vllm":
        return _evaluate_with_vllm(draft, target, prompts, turns, max_prompts, max_new_tokens, k, dtype, out, seed,
                                   trust_remote_code, engine_kwargs, batch1_prompts, reference, batch1_rounds,
                                   sampling)  # fmt: skip
    report = evaluate_report(draft, target, prompts, turns, max_prompts, max_new_tokens, k, tree, topk, depth,
                             budget, sampling["temperature"], counts, draft_vocab_size, device, dtype, out, seed,
                             progress, threads, trust_remote_code, layers, draft_sample=sampling["draft_sample"],
                             dist_samples=sampling["dist_samples"])  # fmt: skip
    for line in summary_lines(report):
        print(line)
    print(f"report: {Path(out) / REPORT_FILE}; plots: {', '.join(report['plots'])}")
    bad = _failed(report)
    for n in bad:
        for dv in report["drafts"][n]["lossless"]["divergences"][:10]:
            print(f"DIVERGENCE {n}: prompt {dv['id']} ({dv['category']}) turn {dv['turn']} at token {dv['position']}: "
                  f"speculative {dv['speculative']} vs baseline {dv['baseline']}")  # fmt: skip
    return 1 if bad else 0


def _failed(report: dict) -> list[str]:
    """The drafts whose output was not the target's: tokens that differ at T=0, or a distribution check that
    failed at T > 0."""
    return [n for n, d in report["drafts"].items()
            if (d["lossless"]["checked"] and not d["lossless"]["ok"])
            or not d.get("distribution", {"ok": True})["ok"]]  # fmt: skip


def _evaluate_with_vllm(
    draft: list[str], target: str, prompts: str, turns: int, max_prompts: int, max_new_tokens: int, k: int,
    dtype: str, out: str, seed: int, trust_remote_code: bool, engine_kwargs: dict, batch1_prompts: int,
    reference: bool = False, batch1_rounds: int = 1, sampling: dict | None = None,
) -> int:  # fmt: skip
    """`eval --engine vllm`: training outputs are exported first; with ``reference`` they are also run by the
    reference decoder (on the full target, here)."""
    from specdraft.eval.serving import evaluate_vllm
    from specdraft.export import export

    exports, refs = [], []
    for i, spec in enumerate(draft):
        cfg_file = Path(spec) / "config.json"
        meta = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        if "speculators_model_type" in meta or "LlamaForCausalLMEagle3" in meta.get("architectures", []):
            exports.append(spec)  # already an export: vLLM only
            continue
        if spec == UNTRAINED:
            raise ValueError(
                "--engine vllm evaluates trained drafts (a train output or an export), not `untrained`"
            )
        exp = Path(out) / _export_name(spec, i, {Path(e).name for e in exports})
        export(
            spec,
            str(exp),
            format="speculators",
            target=target,
            k=k,
            check_vllm=False,
            trust_remote_code=trust_remote_code,
        )
        exports.append(str(exp))
        refs.append(spec)
    if reference and len(refs) != len(exports):
        raise ValueError(
            "--engine vllm --reference: pass training outputs (the reference decoder runs them), not exports"
        )
    report = evaluate_vllm(exports, target=target, prompts=prompts, k=k, max_new_tokens=max_new_tokens, turns=turns,
                           max_prompts=max_prompts, dtype=dtype, seed=seed, reference=refs if reference else None, out=out,
                           trust_remote_code=trust_remote_code, engine_kwargs=engine_kwargs,
                           batch1_prompts=batch1_prompts, batch1_rounds=batch1_rounds, **(sampling or {}))  # fmt: skip
    for line in summary_lines(report):
        print(line)
    print(f"report: {Path(out) / 'report_vllm.json'}; plots: {', '.join(report.get('plots', []))}")
    return 1 if _failed(report) else 0


def _export_name(spec: str, i: int, taken: set[str]) -> str:
    """export-<the run the draft comes from> (a train OUT or its final/: the OUT's name; a checkpoint: the OUT's
    name and the step), with -<i> where another draft of this eval took that name."""
    p = Path(spec).resolve()
    stem = p.parent.name if p.name == "final" else p.name
    if p.parent.name == "checkpoints":
        stem = f"{p.parent.parent.name}-{p.name}"
    name = f"export-{stem}"
    return f"{name}-{i}" if name in taken else name


def _engine_kwargs(tensor_parallel_size: int, engine_args: str) -> dict:
    """vLLM options from the command line, checked against the installed vLLM before anything loads."""
    from specdraft.capture.vllm import check_engine_args
    from specdraft.engine.options import parse_engine_args

    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, not {tensor_parallel_size}")
    user = parse_engine_args(engine_args)
    if "tensor_parallel_size" in user:
        raise ValueError("give the tensor-parallel size with --tensor-parallel-size, not in --engine-args")
    checked = check_engine_args(user)
    return {**checked, "tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else checked

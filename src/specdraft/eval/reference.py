"""`specdraft eval --engine hf`: acceptance, losslessness and speed of drafts by real speculative decoding.

For every prompt (MT-bench questions, both turns if asked, or any jsonl of chats) the target first decodes
alone (the baseline, timed), then with each draft (`specdraft.decode.speculate`, timed). Reported per draft:
  tau                 mean tokens per target forward of a decoding round (accepted draft tokens + 1);
  acceptance          per draft position i: P(position i accepted | positions < i accepted), and the share of
                      rounds reaching i (definitions: `specdraft.eval.stats`);
  target forwards     total, and the share saved against the baseline;
  tokens/s            wall clock, speculative and baseline, and their ratio (the speedup);
  lossless            at T = 0 the speculative tokens must equal the baseline's for every prompt; each divergence
                      is listed with its prompt, turn and position (fp32 on CPU gives none);
  per category        tau per MT-bench category.
Writes OUT/report.json, OUT/acceptance_per_position.png and OUT/tau_per_category.png
(`specdraft.eval.report`). Runs with the same settings and seed draw the same prompts and the same random
numbers (sampling), so they reproduce. The command itself (`--engine hf|vllm`) is `specdraft.eval.command`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from specdraft.decode.speculate import GenResult, SpecConfig, Speculator
from specdraft.eval import stats as figures
from specdraft.eval.prompts import Prompt, load_prompts, render_prompt, render_turn
from specdraft.eval.report import write_plots
from specdraft.eval.stats import acceptance_stats, divergence, tau_of
from specdraft.targets import EMBEDDED_DEFAULT, stop_ids

UNTRAINED = "untrained"
REPORT_FILE = "report.json"


# ---------------------------------------------------------------------------------------------------------
# drafts
# ---------------------------------------------------------------------------------------------------------


def token_counts_from(path: str, vocab_size: int) -> np.ndarray:
    """Token counts of a prepared dataset dir (token_counts.npy) or an extraction dir; '' = uniform counts."""
    if not path:
        return np.ones(vocab_size, dtype=np.int64)
    p = Path(path)
    from specdraft.data.prepare import COUNTS_FILE

    if (p / COUNTS_FILE).exists():
        return np.load(p / COUNTS_FILE)
    if list(p.glob("manifest-*.json")):
        from specdraft.data.store import ShardSet

        return ShardSet.open(str(p)).token_counts()
    raise FileNotFoundError(f"{p} holds no token counts: pass a `specdraft prepare` output (with {COUNTS_FILE}) "
                            "or a `specdraft extract` output, or leave --counts empty for uniform counts")  # fmt: skip


def load_eval_draft(spec: str, target, counts: str = "", draft_vocab_size: int = 32000, seed: int = 0,
                    layers: list[int] | None = None):  # fmt: skip
    """A draft for evaluation: `untrained` (a fresh `build_draft` with the aux ids `layers`, default (2, L//2,
    L-3), and the draft vocabulary from `counts`), a saved draft dir, or a training output dir (its newest
    checkpoint)."""
    from specdraft.model.checkpoint import load_trained
    from specdraft.model.draft import build_draft
    from specdraft.targets import capture_layer_ids

    if spec == UNTRAINED:
        c = token_counts_from(counts, target.vocab_size)
        ids = capture_layer_ids(target.num_layers, layers)[:-1]  # the checks extract and train make
        return build_draft(target, c, ids, draft_vocab_size, seed=seed)
    if layers:
        raise ValueError("eval: --layers applies to `untrained` only: a trained draft reads the aux layer ids it "
                         "was trained with")  # fmt: skip
    from specdraft.model.checkpoint import draft_dir
    from specdraft.model.dflash_files import is_dflash_dir, load_dflash

    saved = draft_dir(spec)
    if saved is not None and is_dflash_dir(saved):  # a DFlash draft: its final/ or newest checkpoint
        return load_dflash(saved).to(target.device)
    try:
        return load_trained(spec, target=target)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; or pass `{UNTRAINED}` for a fresh draft") from None


# ---------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Totals:
    """What one decoder (the baseline or a draft) produced over all prompts and turns."""

    accepted: list[int] = field(default_factory=list)  # per round (drafts only)
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    generations: int = 0  # one prefill each
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # drafts: catch-up + drafting + accepting, over all rounds
    verify_seconds: float = 0.0  # drafts: the target's verify forwards, over all rounds
    divergences: list[dict] = field(default_factory=list)  # drafts at T = 0

    def add(self, r: GenResult) -> None:
        self.accepted += r.accepted
        self.tokens += len(r.tokens)
        self.seconds += r.seconds
        self.forwards += r.target_forwards
        self.generations += 1
        self.prefill_seconds += r.prefill_seconds
        self.draft_seconds += r.draft_seconds
        self.verify_seconds += r.verify_seconds


def _warm_up(specs: dict[str, Speculator], tok, cfg: SpecConfig, seed: int) -> None:
    """First calls allocate and pick kernels: run them on a short prompt, not timed, not reported."""
    warm = SpecConfig(**{**asdict(cfg), "max_new_tokens": 4, "stop_ids": ()})
    w_ids = render_prompt(tok, ["Hello"], [])
    next(iter(specs.values())).baseline(w_ids, warm, seed)
    for sp in specs.values():
        sp.generate(w_ids, warm, seed)


def _decode_turn(
    specs: dict[str, Speculator], ids: list[int], cfg: SpecConfig, s: int, p: Prompt, turn: int,
    base: _Totals, per: dict[str, _Totals],
) -> tuple[dict, GenResult]:  # fmt: skip
    """One prompt turn: the target alone, then each draft; its record and the baseline's result."""
    b = next(iter(specs.values())).baseline(ids, cfg, s)
    base.add(b)
    rec = {"id": p.id, "category": p.category, "turn": turn + 1, "prompt_tokens": len(ids),
           "baseline": {"new_tokens": len(b.tokens), "seconds": round(b.seconds, 4),
                        "target_forwards": b.target_forwards}, "drafts": {}}  # fmt: skip
    for name, sp in specs.items():
        r = sp.generate(ids, cfg, s)
        acc = per[name]
        acc.add(r)
        dv = None
        if cfg.temperature == 0:
            dv = divergence(r.tokens, b.tokens, id=p.id, category=p.category, turn=turn + 1)
        if dv is not None:
            acc.divergences.append(dv)
        rec["drafts"][name] = {"new_tokens": len(r.tokens), "seconds": round(r.seconds, 4),
                               "target_forwards": r.target_forwards, "tau": round(r.tau, 4),
                               "accepted": r.accepted, "diverges_at": None if dv is None else dv["position"]}  # fmt: skip
    return rec, b


def _draft_entry(name: str, acc: _Totals, records: list[dict], cfg: SpecConfig, base: _Totals) -> dict:
    """The report of one draft: the statistics, per category tau, speed, forwards and the lossless check."""
    stats = acceptance_stats(acc.accepted, cfg.max_draft_depth)
    cats: dict[str, list[int]] = {}
    for rec in records:
        cats.setdefault(rec["category"], []).extend(rec["drafts"][name]["accepted"])
    base_tps = base.tokens / base.seconds if base.seconds else 0.0
    tps = acc.tokens / acc.seconds if acc.seconds else 0.0
    greedy = cfg.temperature == 0
    rounds = max(1, len(acc.accepted))
    step_s = (base.seconds - base.prefill_seconds) / max(1, base.forwards - base.generations)
    return {
        **stats,
        "tau_per_category": {c: tau_of(v) for c, v in sorted(cats.items())},
        "new_tokens": acc.tokens,
        "seconds": round(acc.seconds, 3),
        "tokens_per_s": round(tps, 3),
        "speedup": round(tps / base_tps, 4) if base_tps else None,
        "target_forwards": acc.forwards,
        "target_forwards_saved": round(1 - acc.forwards / base.forwards, 4) if base.forwards else 0.0,
        # what a round costs, measured: the draft's part (catch-up, k steps, accept) and the verify forward,
        # against one target-only decoding step
        "round_ms": {
            "draft": round(1e3 * acc.draft_seconds / rounds, 3),
            "verify": round(1e3 * acc.verify_seconds / rounds, 3),
            "target_step": round(1e3 * step_s, 3),
        },  # fmt: skip
        "lossless": {
            "checked": greedy,
            "ok": (not acc.divergences) if greedy else None,
            "divergences": acc.divergences,
        },  # fmt: skip
    }


def run_evaluation(
    target,
    drafts: dict[str, object],
    prompts: list[Prompt],
    cfg: SpecConfig,
    turns: int = 1,
    seed: int = 0,
    progress: bool = True,
    dist_samples: int = 0,
) -> dict:
    """Decode every prompt with the target alone and with each draft; the report as a dict (see module doc).

    `target` is a loaded `specdraft.targets.Target` (with tokenizer); `drafts` maps a name to an `Eagle3Draft`
    already on the target's device. The baseline runs once per prompt and turn and is shared by all drafts.
    """
    from tqdm.auto import tqdm

    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 (first turns) or 2 (both turns), not {turns}")
    if target.tokenizer is None:
        raise ValueError("the target was loaded without its tokenizer: load it with with_tokenizer=True")
    if not drafts:
        raise ValueError("no drafts to evaluate: pass at least one (a checkpoint dir or `untrained`)")
    from specdraft.decode.block import BlockSpeculator
    from specdraft.model.dflash import DFlashDraft

    specs = {
        name: (BlockSpeculator if isinstance(d, DFlashDraft) else Speculator)(target, d)
        for name, d in drafts.items()
    }
    tok = target.tokenizer
    if not cfg.stop_ids:
        stops = stop_ids(tok, getattr(target.model, "generation_config", None))
        cfg = SpecConfig(**{**asdict(cfg), "stop_ids": stops})
    _warm_up(specs, tok, cfg, seed)

    records: list[dict] = []
    base, per = _Totals(), {n: _Totals() for n in specs}
    jobs = [(i, p, t) for i, p in enumerate(prompts) for t in range(min(turns, len(p.turns)))]
    answers: dict[int, list[str]] = {}  # the baseline's answers: a 2nd turn follows the target's own 1st
    bar = tqdm(total=len(jobs), desc="eval", unit="turn", disable=not progress)
    for i, p, t in jobs:
        ids = render_turn(tok, p, t, answers.get(i, []))
        s = seed * 1_000_003 + i * 7 + t  # a distinct, reproducible stream per prompt and turn
        rec, b = _decode_turn(specs, ids, cfg, s, p, t, base, per)
        answers.setdefault(i, []).append(tok.decode(b.tokens, skip_special_tokens=True))
        records.append(rec)
        bar.update(1)
        bar.set_postfix({n: f"tau {tau_of(v.accepted):.2f}" for n, v in per.items() if v.accepted})
    bar.close()
    checks = _distribution_checks(specs, [render_turn(tok, p, 0, []) for p in prompts], cfg, dist_samples,
                                  seed, progress)  # fmt: skip
    for sp in specs.values():
        sp.close()

    base_tps = base.tokens / base.seconds if base.seconds else 0.0
    return {
        "target": getattr(target, "name", ""),
        "settings": {
            **asdict(cfg),
            "turns": turns,
            "seed": seed,
            "prompts": len(prompts),
            "device": str(target.device),
            "dtype": str(next(target.model.parameters()).dtype),
        },  # fmt: skip
        "baseline": {
            "new_tokens": base.tokens,
            "seconds": round(base.seconds, 3),
            "tokens_per_s": round(base_tps, 3),
            "target_forwards": base.forwards,
        },  # fmt: skip
        "drafts": {
            name: _draft_entry(name, acc, records, cfg, base) | checks.get(name, {})
            for name, acc in per.items()
        },  # fmt: skip
        "records": records,
    }


def _distribution_checks(specs: dict[str, Speculator], first_ids: list[list[int]], cfg: SpecConfig, samples: int,
                         seed: int, progress: bool) -> dict[str, dict]:  # fmt: skip
    """T > 0: each draft's distribution check against the target alone (eval/stats.py), as
    ``{name: {"distribution": ...}}``; {} without one."""
    if not samples:
        return {}
    assert cfg.temperature > 0, "the distribution check is for sampled output"
    short = SpecConfig(**{**asdict(cfg), "max_new_tokens": figures.DIST_TOKENS})
    ids = [first_ids[i] for i in figures.shortest_prompts(first_ids, figures.DIST_PROMPTS)]
    any_spec = next(iter(specs.values()))
    if progress:
        print(f"eval: distribution check, {samples} samples a side of {len(ids)} prompts", flush=True)
    alone = figures.draw_samples(
        lambda p, s: any_spec.baseline(p, short, s).tokens, ids, samples, 10**7 + seed
    )
    return {name: {"distribution": figures.compare_distributions(
                figures.draw_samples(lambda p, s, sp=sp: sp.generate(p, short, s).tokens, ids, samples, 2 * 10**7 + seed),
                alone, figures.DIST_TOKENS)} for name, sp in specs.items()}  # fmt: skip


def evaluate_report(
    draft: list[str],
    target: str = EMBEDDED_DEFAULT,
    prompts: str = "mtbench",
    turns: int = 1,
    max_prompts: int = 0,
    max_new_tokens: int = 128,
    k: int = 5,
    tree: bool = False,
    topk: int = 8,
    depth: int = 6,
    budget: int = 32,
    temperature: float = 0.0,
    counts: str = "",
    draft_vocab_size: int = 32000,
    device: str = "cpu",
    dtype: str = "",
    out: str = "runs/eval",
    seed: int = 0,
    progress: bool = True,
    threads: int = 0,
    trust_remote_code: bool = False,
    layers: list[int] | None = None,
    draft_sample: str = "greedy",
    dist_samples: int = 0,
) -> dict:
    """`specdraft eval --engine hf` returning the report dict (for quickstart and the vLLM comparison);
    the arguments of `specdraft.eval.command.evaluate`."""
    from specdraft.targets import load_target

    if isinstance(draft, str):
        draft = [draft]
    cfg = SpecConfig(k=k, tree=tree, topk=topk, depth=depth, budget=budget, temperature=temperature,
                     max_new_tokens=max_new_tokens, draft_sample=draft_sample)  # fmt: skip
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    plist = load_prompts(prompts, max_prompts)
    t0 = time.time()
    tgt = load_target(target, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    drafts = {}
    for spec in draft:
        name = spec if spec == UNTRAINED else str(Path(spec))
        if name in drafts:
            raise ValueError(f"draft {spec!r} given twice")
        drafts[name] = load_eval_draft(spec, tgt, counts, draft_vocab_size, seed, layers).to(
            device, getattr(torch, dtype)
        )
    report = run_evaluation(tgt, drafts, plist, cfg, turns=turns, seed=seed, progress=progress,
                            dist_samples=dist_samples)  # fmt: skip
    report["settings"].update({"threads": torch.get_num_threads(), "prompts_source": prompts, "counts": counts,
                               "target_arg": target, "untrained_draft_vocab_size": draft_vocab_size})  # fmt: skip
    report["wall_seconds"] = round(time.time() - t0, 2)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    (o / REPORT_FILE).write_text(json.dumps(report, indent=1))
    report["plots"] = [str(p) for p in write_plots(report, o)]
    (o / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return report

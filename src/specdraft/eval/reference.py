"""`specdraft eval`: acceptance, losslessness and speed of drafts by real speculative decoding.

For every prompt (MT-bench questions, both turns if asked, or any jsonl of chats) the target first decodes
alone (the baseline, timed), then with each draft (`specdraft.decode.speculate`, timed). Reported per draft:
  tau                 mean tokens per target forward of a decoding round (accepted draft tokens + 1);
  acceptance          per draft position i: P(position i accepted | positions < i accepted), and the share of
                      rounds reaching i;
  target forwards     total, and the share saved against the baseline;
  tokens/s            wall clock, speculative and baseline, and their ratio (the speedup);
  lossless            at T = 0 the speculative tokens must equal the baseline's for every prompt; each divergence
                      is listed with its prompt, turn and position (fp32 on CPU gives none);
  per category        tau per MT-bench category.
Writes OUT/report.json, OUT/acceptance_per_position.png and OUT/tau_per_category.png. Runs with the same
settings and seed draw the same prompts and the same random numbers (sampling), so they reproduce.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specdraft.decode.speculate import GenResult, SpecConfig, Speculator
from specdraft.targets import EMBEDDED_DEFAULT

UNTRAINED = "untrained"
REPORT_FILE = "report.json"


# ---------------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """One evaluation question: its user turns (the assistant turns are generated)."""

    id: str
    category: str
    turns: list[str]


def load_prompts(prompts: str = "mtbench", max_prompts: int = 0) -> list[Prompt]:
    """Questions from MT-bench (`mtbench`: 80, 2 turns each, with categories) or a jsonl / JSON file.

    A record is either MT-bench style {"turns": [str, ...], "category"?, "question_id"?} or a chat
    ({"messages"|"conversations": [...]}, OpenAI or ShareGPT roles) whose user turns are used.
    `max_prompts` > 0 keeps that many, taken round-robin over categories (MT-bench: 8 -> one per category).
    """
    from specdraft.data.prepare import mtbench_path, normalize, read_conversations

    path = mtbench_path() if prompts == "mtbench" else Path(prompts)
    if not Path(path).exists():
        raise FileNotFoundError(
            f"prompt file {path} not found: pass `mtbench` or a jsonl of chats / questions"
        )
    out: list[Prompt] = []
    skipped = 0
    for rec, raw in read_conversations(path):
        if isinstance(raw, dict) and isinstance(raw.get("turns"), list) and raw["turns"]:
            turns = [t for t in raw["turns"] if isinstance(t, str) and t.strip()]
        else:
            msgs, _ = normalize(raw)
            turns = [m["content"] for m in msgs or [] if m["role"] == "user"]
        if not turns:
            skipped += 1
            continue
        qid = str(raw.get("question_id", raw.get("id", rec))) if isinstance(raw, dict) else str(rec)
        cat = str(raw.get("category", "all")) if isinstance(raw, dict) else "all"
        out.append(Prompt(id=qid, category=cat, turns=turns))
    if not out:
        raise ValueError(f"no usable prompts in {path} ({skipped} records without user turns): each line needs "
                         "`turns` (a list of strings) or `messages` with user turns")  # fmt: skip
    if max_prompts and max_prompts < len(out):  # round-robin over categories, file order within each
        by_cat: dict[str, list[Prompt]] = {}
        for p in out:
            by_cat.setdefault(p.category, []).append(p)
        picked: list[Prompt] = []
        for rank in range(max(len(v) for v in by_cat.values())):
            picked += [v[rank] for v in by_cat.values() if rank < len(v)]
        out = picked[:max_prompts]
    return out


def render_prompt(tokenizer, user_turns: list[str], answers: list[str]) -> list[int]:
    """Token ids of a chat (user turn 1, answer 1, .., user turn n) with the generation prompt appended."""
    assert len(answers) == len(user_turns) - 1, "one answer per earlier user turn"
    msgs = []
    for i, u in enumerate(user_turns):
        msgs.append({"role": "user", "content": u})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_ids_of(target) -> tuple[int, ...]:
    """End-of-sequence ids of the target (tokenizer and generation config)."""
    ids: set[int] = set()
    tok_eos = getattr(target.tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


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


def load_eval_draft(spec: str, target, counts: str = "", draft_vocab_size: int = 32000, seed: int = 0):
    """A draft for evaluation: `untrained` (a fresh `build_draft` with the default aux ids and the draft
    vocabulary from `counts`), a saved draft dir, or a training output dir (its newest checkpoint)."""
    from specdraft.model.checkpoint import load_trained
    from specdraft.model.draft import build_draft
    from specdraft.targets import default_aux_layer_ids

    if spec == UNTRAINED:
        c = token_counts_from(counts, target.vocab_size)
        return build_draft(target, c, default_aux_layer_ids(target.num_layers), draft_vocab_size, seed=seed)
    try:
        return load_trained(spec)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; or pass `{UNTRAINED}` for a fresh draft") from None


# ---------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------


def acceptance_stats(accepted: list[int], max_depth: int) -> dict:
    """tau and per-position acceptance from per-round accepted counts (pooled over prompts)."""
    a = np.asarray(accepted, dtype=np.int64)
    rounds = int(a.size)
    reach = [int((a >= i).sum()) for i in range(max_depth + 1)]  # reach[0] = rounds
    cond = [reach[i] / reach[i - 1] if reach[i - 1] else None for i in range(1, max_depth + 1)]
    return {
        "rounds": rounds,
        "tau": float(a.mean() + 1) if rounds else 1.0,
        "acceptance_rate_per_position": cond,  # P(i accepted | 1..i-1 accepted)
        "reached_per_position": [r / rounds if rounds else 0.0 for r in reach[1:]],  # P(1..i accepted)
        "accepted_histogram": np.bincount(a, minlength=max_depth + 1).tolist() if rounds else [],
    }


def first_divergence(spec: list[int], base: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None."""
    for i, (s, b) in enumerate(zip(spec, base)):
        if s != b:
            return i
    return None if len(spec) == len(base) else min(len(spec), len(base))


# ---------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------


def run_evaluation(
    target,
    drafts: dict[str, object],
    prompts: list[Prompt],
    cfg: SpecConfig,
    turns: int = 1,
    seed: int = 0,
    progress: bool = True,
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
    specs = {name: Speculator(target, d) for name, d in drafts.items()}
    tok = target.tokenizer
    if not cfg.stop_ids:
        cfg = SpecConfig(**{**asdict(cfg), "stop_ids": stop_ids_of(target)})
    # warm-up (first calls allocate and pick kernels): not timed, not reported
    warm = SpecConfig(**{**asdict(cfg), "max_new_tokens": 4, "stop_ids": ()})
    w_ids = render_prompt(tok, ["Hello"], [])
    first = next(iter(specs.values()))
    first.baseline(w_ids, warm, seed)
    for sp in specs.values():
        sp.generate(w_ids, warm, seed)

    records: list[dict] = []
    base_tok = base_sec = base_fwd = 0
    per: dict[str, dict] = {
        n: {"accepted": [], "tokens": 0, "seconds": 0.0, "forwards": 0, "div": []} for n in specs
    }
    jobs = [(i, p, t) for i, p in enumerate(prompts) for t in range(min(turns, len(p.turns)))]
    answers: dict[int, list[str]] = {}
    bar = tqdm(total=len(jobs), desc="eval", unit="turn", disable=not progress)
    for i, p, t in jobs:
        ids = render_prompt(tok, p.turns[: t + 1], answers.get(i, [])[:t])
        s = seed * 1_000_003 + i * 7 + t  # a distinct, reproducible stream per prompt and turn
        base: GenResult = first.baseline(ids, cfg, s)
        answers.setdefault(i, []).append(tok.decode(base.tokens, skip_special_tokens=True))
        base_tok += len(base.tokens)
        base_sec += base.seconds
        base_fwd += base.target_forwards
        rec = {"id": p.id, "category": p.category, "turn": t + 1, "prompt_tokens": len(ids),
               "baseline": {"new_tokens": len(base.tokens), "seconds": round(base.seconds, 4),
                            "target_forwards": base.target_forwards}, "drafts": {}}  # fmt: skip
        for name, sp in specs.items():
            r = sp.generate(ids, cfg, s)
            acc = per[name]
            acc["accepted"] += r.accepted
            acc["tokens"] += len(r.tokens)
            acc["seconds"] += r.seconds
            acc["forwards"] += r.target_forwards
            div = first_divergence(r.tokens, base.tokens) if cfg.temperature == 0 else None
            if div is not None:
                acc["div"].append({"id": p.id, "category": p.category, "turn": t + 1, "position": div,
                                   "speculative": r.tokens[div : div + 5], "baseline": base.tokens[div : div + 5]})  # fmt: skip
            rec["drafts"][name] = {"new_tokens": len(r.tokens), "seconds": round(r.seconds, 4),
                                   "target_forwards": r.target_forwards, "tau": round(r.tau, 4),
                                   "accepted": r.accepted, "diverges_at": div}  # fmt: skip
        records.append(rec)
        bar.update(1)
        bar.set_postfix({n: f"tau {np.mean(v['accepted']) + 1:.2f}" for n, v in per.items() if v["accepted"]})
    bar.close()
    for sp in specs.values():
        sp.close()

    base_tps = base_tok / base_sec if base_sec else 0.0
    report_drafts = {}
    for name, acc in per.items():
        stats = acceptance_stats(acc["accepted"], cfg.max_draft_depth)
        cats: dict[str, list[int]] = {}
        for rec in records:
            cats.setdefault(rec["category"], []).extend(rec["drafts"][name]["accepted"])
        tps = acc["tokens"] / acc["seconds"] if acc["seconds"] else 0.0
        report_drafts[name] = {
            **stats,
            "tau_per_category": {c: float(np.mean(v) + 1) if v else 1.0 for c, v in sorted(cats.items())},
            "new_tokens": acc["tokens"],
            "seconds": round(acc["seconds"], 3),
            "tokens_per_s": round(tps, 3),
            "speedup": round(tps / base_tps, 4) if base_tps else None,
            "target_forwards": acc["forwards"],
            "target_forwards_saved": round(1 - acc["forwards"] / base_fwd, 4) if base_fwd else 0.0,
            "lossless": {
                "checked": cfg.temperature == 0,
                "ok": (not acc["div"]) if cfg.temperature == 0 else None,
                "divergences": acc["div"],
            },
        }
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
            "new_tokens": base_tok,
            "seconds": round(base_sec, 3),
            "tokens_per_s": round(base_tps, 3),
            "target_forwards": base_fwd,
        },  # fmt: skip
        "drafts": report_drafts,
        "records": records,
    }


def write_plots(report: dict, out: str | Path) -> list[Path]:
    """acceptance_per_position.png and tau_per_category.png for a report (one series per draft)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in report["drafts"].items():
        rates = [r if r is not None else np.nan for r in d["acceptance_rate_per_position"]]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} (tau {d['tau']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (given earlier positions accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"acceptance per position, T={report['settings']['temperature']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "acceptance_per_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    cats = sorted({c for d in report["drafts"].values() for c in d["tau_per_category"]})
    names = list(report["drafts"])
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cats) + 2), 4))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        vals = [report["drafts"][name]["tau_per_category"].get(c, np.nan) for c in cats]
        ax.bar(np.arange(len(cats)) + j * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(cats)) + width * (len(names) - 1) / 2, cats, rotation=30, ha="right")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("tau per category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "tau_per_category.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


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
) -> dict:
    """`evaluate` returning the report dict (for quickstart); same arguments."""
    from specdraft.targets import load_target

    if isinstance(draft, str):
        draft = [draft]
    cfg = SpecConfig(k=k, tree=tree, topk=topk, depth=depth, budget=budget, temperature=temperature,
                     max_new_tokens=max_new_tokens)  # fmt: skip
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    plist = load_prompts(prompts, max_prompts)
    t0 = time.time()
    tgt = load_target(target, device=device, dtype=dtype)
    drafts = {}
    for spec in draft:
        name = spec if spec == UNTRAINED else str(Path(spec))
        if name in drafts:
            raise ValueError(f"draft {spec!r} given twice")
        drafts[name] = load_eval_draft(spec, tgt, counts, draft_vocab_size, seed).to(
            device, getattr(torch, dtype)
        )
    report = run_evaluation(tgt, drafts, plist, cfg, turns=turns, seed=seed, progress=progress)
    report["settings"].update({"threads": torch.get_num_threads(), "prompts_source": prompts, "counts": counts,
                               "target_arg": target, "untrained_draft_vocab_size": draft_vocab_size})  # fmt: skip
    report["wall_seconds"] = round(time.time() - t0, 2)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    (o / REPORT_FILE).write_text(json.dumps(report, indent=1))
    report["plots"] = [str(p) for p in write_plots(report, o)]
    (o / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return report


def summary_lines(report: dict) -> list[str]:
    """A short human-readable summary of a report."""
    b = report["baseline"]
    lines = [f"baseline (target only): {b['new_tokens']} tokens, {b['tokens_per_s']:.1f} tok/s"]
    for name, d in report["drafts"].items():
        acc = ", ".join("-" if r is None else f"{r:.2f}" for r in d["acceptance_rate_per_position"])
        ll = d["lossless"]
        lossless = (
            ("yes" if ll["ok"] else f"NO ({len(ll['divergences'])} divergences)")
            if ll["checked"]
            else "n/a (T>0)"
        )
        lines.append(f"{name}: tau {d['tau']:.3f}, acceptance per position [{acc}], {d['tokens_per_s']:.1f} tok/s "
                     f"(x{d['speedup']:.2f}), target forwards saved {100 * d['target_forwards_saved']:.1f}%, "
                     f"lossless {lossless}")  # fmt: skip
    return lines


def evaluate(
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
    engine: str = "hf",
) -> int:
    """Measure drafts by real speculative decoding: tau, acceptance per position, speed, losslessness.

    Exit status 1 when a greedy (T=0) run's output differs from target-only decoding, else 0.

    Args:
        draft: one or more drafts: a `specdraft train` output dir (newest checkpoint), a saved draft dir, or
            `untrained` (a fresh draft: the baseline for a trained one; tau ~1).
        target: the target model (HF dir or id, or the embedded default smollm2-135m).
        prompts: `mtbench` (80 MT-bench questions) or a jsonl of questions (`turns`) or chats (`messages`).
        turns: 1 = first turns only; 2 = both turns (the 2nd turn follows the target's own first answer).
        max_prompts: evaluate N prompts, round-robin over categories (0 = all).
        max_new_tokens: tokens generated per turn.
        k: chain drafting: draft tokens per round.
        tree: draft a dynamic tree (EAGLE-2/3) instead of a chain.
        topk: tree: children per node and nodes kept per depth.
        depth: tree: maximum draft tokens along one path.
        budget: tree: draft tokens verified per round.
        temperature: 0 = greedy (checked lossless); > 0 = sampling with the exact rejection rule.
        counts: for `untrained`: a prepared dataset or extraction dir whose token counts pick the draft
            vocabulary (empty = uniform counts: the lowest token ids).
        draft_vocab_size: for `untrained`: draft vocabulary size.
        device: cpu, cuda, cuda:1, ...
        dtype: float32 or bfloat16 (empty = float32 on CPU, bfloat16 on GPU).
        out: output directory (report.json, acceptance_per_position.png, tau_per_category.png).
        seed: seed of prompt-level random streams (sampling, untrained draft init).
        progress: show a progress bar.
        threads: torch CPU threads (0 = torch's default; 1 is steadier on a busy machine).
        engine: `hf` (the reference decoder here) or `vllm` (vLLM speculative decoding of the exported draft,
            its spec-decode counters next to the reference decoder's figures; chain drafting, T=0).
    """
    if engine == "vllm":
        return _evaluate_with_vllm(
            draft, target, prompts, turns, max_prompts, max_new_tokens, k, dtype, out, seed
        )
    if engine != "hf":
        raise ValueError(f"--engine must be hf or vllm, not {engine!r}")
    report = evaluate_report(draft, target, prompts, turns, max_prompts, max_new_tokens, k, tree, topk, depth,
                             budget, temperature, counts, draft_vocab_size, device, dtype, out, seed, progress, threads)  # fmt: skip
    for line in summary_lines(report):
        print(line)
    print(f"report: {Path(out) / REPORT_FILE}; plots: {', '.join(report['plots'])}")
    bad = [n for n, d in report["drafts"].items() if d["lossless"]["checked"] and not d["lossless"]["ok"]]
    for n in bad:
        for dv in report["drafts"][n]["lossless"]["divergences"][:10]:
            print(f"DIVERGENCE {n}: prompt {dv['id']} ({dv['category']}) turn {dv['turn']} at token {dv['position']}: "
                  f"speculative {dv['speculative']} vs baseline {dv['baseline']}")  # fmt: skip
    return 1 if bad else 0


def _evaluate_with_vllm(
    draft: list[str], target: str, prompts: str, turns: int, max_prompts: int, max_new_tokens: int, k: int,
    dtype: str, out: str, seed: int,
) -> int:  # fmt: skip
    """`eval --engine vllm`: training outputs are exported first and also run by the reference decoder."""
    from specdraft.eval.vllm import evaluate_vllm
    from specdraft.eval.vllm import summary_lines as vllm_summary
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
        exp = Path(out) / f"export-{i}"
        export(spec, str(exp), format="speculators", target=target, k=k, check_vllm=False)
        exports.append(str(exp))
        refs.append(spec)
    if refs and len(refs) != len(exports):
        raise ValueError(
            "--engine vllm: pass either training outputs (compared with the reference decoder) or exports"
        )
    report = evaluate_vllm(exports, target=target, prompts=prompts, k=k, max_new_tokens=max_new_tokens, turns=turns,
                           max_prompts=max_prompts, dtype=dtype, seed=seed, reference=refs or None, out=out)  # fmt: skip
    for line in vllm_summary(report):
        print(line)
    return 1 if any(not d["lossless"]["ok"] for d in report["drafts"].values()) else 0

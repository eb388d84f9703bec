"""`specdraft eval --engine vllm`: an exported draft served by vLLM's own EAGLE-3 speculative decoding.

The target is served twice, in sequence, in this process (:class:`~specdraft.eval.vllm_engine.VLLMEngine`;
the first engine is dropped before the next is built): alone (the baseline) and with each exported draft
as ``speculative_config={"method": "eagle3", "model": EXPORT, "num_speculative_tokens": k}`` (with
``draft_sample_method`` and ``rejection_sample_method`` when asked). Both decode greedily (T = 0) or sample at a
temperature (top-p, a seed per request: ``seed``, ``seed + 1``, ... in prompt order), fp32 on CPU, eager mode. Prompts are built exactly as the reference evaluation builds
them (:mod:`specdraft.eval.prompts`: the tokenizer's chat template with the generation prompt, then the
ids passed to vLLM as ``TokensPrompt``), and generation stops at the same end-of-sequence ids, so the two
reports are comparable prompt by prompt.

Read from vLLM (``disable_log_stats=False``), as differences of snapshots taken around the timed
runs: ``vllm:spec_decode_num_drafts`` (verify rounds), ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (rounds that accepted position
i). Reported per draft (definitions shared with the reference report: :mod:`specdraft.eval.stats`):
  tau                           1 + accepted / drafts (tokens per target forward of a round);
  acceptance_rate_per_position  P(i accepted | 1..i-1 accepted) = per_pos[i] / per_pos[i-1], the
                                definition of the reference report;
  reached_per_position          per_pos[i] / drafts (what vLLM's log calls "per-position acceptance");
  per-request rounds            vLLM's per-request record (``per_request_spec_decode_metrics=
                                "detailed"``, when the installed vLLM has it): accepted count of
                                every round of every prompt, the same list the reference decoder
                                keeps, so the two can be compared round by round;
  tokens/s                      new tokens / wall time of ``LLM.generate``, with and without draft;
  batch1                        the same for the first ``batch1_prompts`` prompts served one at a time
                                (one sequence in the engine: latency, the regime drafts are for), with the
                                measured cost of a round (k draft steps + one verify of k+1 tokens) in
                                target-only decoding steps, and the tau it takes to break even; with
                                ``batch1_rounds`` > 1 measured in rounds interleaved with the target
                                alone's (:mod:`specdraft.eval.batch1`), so a slower minute of a shared
                                machine slows both sides of a speed-up;
  lossless                      at T = 0: speculative output == target-only output token for token; every
                                divergence with its prompt, turn and position. At T > 0 outputs are samples
                                ("n/a (T>0)"); ``dist_samples`` > 0 runs the two-sample test of
                                :mod:`specdraft.eval.stats` instead (``distribution`` in the report);
  speculative_config            what the engine ran with, read back from it (method, k, the sampling methods,
                                the model runner).

Accounting, measured on vLLM 0.32.0 and matching :mod:`specdraft.decode.speculate`: a round drafts k tokens
even when fewer remain to ``max_tokens``, and its accepted count is taken before the output is cut
at ``max_tokens`` or a stop token; the prefill is not a round.

With ``reference=`` the reference decoder runs on the same prompts and k and its figures are put next to
vLLM's (:func:`specdraft.eval.parity.compare_with_reference`). Whether vLLM runs our draft at all, call by
call, is :func:`specdraft.eval.parity.drafter_parity`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdraft.engine import contract as engines
from specdraft.eval import batch1
from specdraft.eval import stats as figures
from specdraft.eval.parity import compare_with_reference
from specdraft.eval.prompts import Prompt, collect_prompts, render_turn
from specdraft.eval.report import write_plots
from specdraft.eval.stats import counter_stats, divergence
from specdraft.eval.vllm_engine import VLLMEngine
from specdraft.targets import EMBEDDED_DEFAULT, read_generation_config, stop_ids

REPORT_FILE = "report_vllm.json"


def export_format(export_dir: str | Path) -> str:
    """``speculators`` or ``eagle3`` for a `specdraft export` directory.

    Raises:
        FileNotFoundError: no config.json (not an export).
    """
    cfg = Path(export_dir) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(
            f"{export_dir} has no config.json: pass a directory written by `specdraft export` "
            "(--format speculators or eagle3)"
        )
    return "speculators" if "speculators_model_type" in json.loads(cfg.read_text()) else "eagle3"


def served_method(export_dir: str | Path, k: int) -> tuple[str, int]:
    """(vLLM's speculative method, tokens drafted a round) for an export: `eagle3` with the asked k, or, for a
    DFlash draft (speculators `dflash`), `dflash` with the k its export records (its block size - 1: one
    forward drafts the whole block)."""
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    if cfg.get("speculators_model_type") == "dflash":
        return "dflash", int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    return "eagle3", k


def vocab_coverage(export_dir: str | Path, tokens: Sequence[Sequence[int]]) -> float | None:
    """The share of ``tokens`` (the target alone's own output) that the export's draft vocabulary holds: no draft
    proposes a token outside it, so this caps every position's acceptance. None when the export has no map
    (``t2d``: its draft vocabulary is the target's, or a DFlash export keeps it elsewhere), no safetensors
    weights to read it from, or no tokens."""
    from specdraft.model.frozen import read_tensors, weight_map

    flat = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)  # (N,)
    if not flat.numel() or not any(Path(export_dir).glob("*.safetensors")):
        return None
    wmap = weight_map(export_dir)
    if "t2d" not in wmap:
        return None
    t2d = read_tensors(export_dir, ["t2d"], wmap)["t2d"].bool()  # (V,): target id -> in the draft vocabulary
    held = t2d[flat[flat < t2d.numel()]].sum().item()  # an id past the map is not held
    return round(held / flat.numel(), 4)


# ---------------------------------------------------------------------------------------------------------
# the steps of an evaluation
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One evaluation's fixed inputs: the target, its prompts and how every engine of the run is built."""

    target_dir: str
    tokenizer: Any
    prompts: list[Prompt]
    first_ids: list[list[int]]  # the first turn of each prompt, as token ids
    k: int
    max_new_tokens: int
    max_len: int  # the engines' max_model_len
    engine_args: dict[str, Any]  # VLLMEngine options shared by all engines
    gen_args: dict[str, Any]  # VLLMEngine.generate options shared by all generations
    log: Callable[[str], None]
    batch1: int = 0  # first-turn prompts also served one at a time (batch 1)
    batch1_rounds: int = 1  # batch-1 measurements of every engine, interleaved (eval/batch1.py)
    dist_samples: int = 0  # T > 0: samples a side of the distribution check (eval/stats.py; 0 = off)
    dist_seed: int = 0  # the first seed of the check's samples

    @property
    def greedy(self) -> bool:
        return not self.gen_args.get("temperature")


@dataclass
class _Baseline:
    """The target alone: every job (prompt index, 0-based turn), its prompt ids and new tokens."""

    jobs: list[tuple[int, int]]
    ids: list[list[int]]
    tokens: list[list[int]]
    seconds: float
    batch1: list[dict[str, Any]] = field(default_factory=list)  # the first prompts one at a time, each
    # measurement (eval/batch1.py; empty: not run)
    samples: list[list[list[int]]] | None = None  # the distribution check's samples of the target alone
    new_tokens: int = field(init=False)
    tokens_per_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.new_tokens = sum(len(t) for t in self.tokens)
        self.tokens_per_s = self.new_tokens / self.seconds if self.seconds else 0.0


def _check_arguments(
    export_dir: str | Sequence[str], prompts: Any, turns: int, k: int, max_new_tokens: int,
    reference: Sequence[str] | None, batch1_rounds: int = 1,
) -> list[str]:  # fmt: skip
    """The export directories; every argument error at once, before any engine is built."""
    exports = [str(export_dir)] if isinstance(export_dir, (str, Path)) else [str(e) for e in export_dir]
    errors = []
    if not exports:
        errors.append("no export directories given")
    if len(set(exports)) != len(exports):
        errors.append(f"an export directory is given twice: {exports}")
    if turns not in (1, 2):
        errors.append(f"turns must be 1 or 2, not {turns}")
    if k < 1 or max_new_tokens < 1:
        errors.append(f"k and max_new_tokens must be >= 1 (got {k}, {max_new_tokens})")
    if batch1_rounds < 1:
        errors.append(f"batch1_rounds must be >= 1, not {batch1_rounds}")
    if reference is not None and len(reference) != len(exports):
        errors.append(f"{len(reference)} reference drafts for {len(exports)} exports: give one per export")
    if reference is not None and not isinstance(prompts, (str, Path)):
        errors.append("the reference decoder reads prompts from `mtbench` or a file: pass that, not a list")
    if errors:
        raise ValueError("evaluate_vllm: " + "; ".join(errors))
    return exports


def _plan(target: str, prompts: Any, max_prompts: int, turns: int,
          trust_remote_code: bool) -> tuple[str, Any, tuple[int, ...], list[Prompt]]:  # fmt: skip
    """The target's directory and tokenizer, its stop ids and the prompts."""
    from specdraft.targets import load_tokenizer, resolve_target_dir

    local = resolve_target_dir(target, convert=True)
    target_dir = str(local) if local is not None else target
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    stops = stop_ids(tok, read_generation_config(target_dir))
    plist = collect_prompts(prompts, max_prompts)
    if turns == 2 and any(p.token_ids is not None or p.messages is not None for p in plist):
        raise ValueError("turns=2 needs prompts given as user turns (mtbench, a file or strings)")
    return target_dir, tok, stops, plist


def _run_baseline(run: _Run, turns: int) -> _Baseline:
    """The target alone on every first turn, then (turns=2) on the second turns that follow its answers."""
    tok, plist = run.tokenizer, run.prompts
    jobs1 = [(i, 0) for i in range(len(plist))]
    ids1 = run.first_ids
    jobs2: list[tuple[int, int]] = []
    ids2: list[list[int]] = []
    with _engine(run, None) as eng:
        run.log(f"target alone loaded in {eng.load_seconds:.1f}s")
        eng.generate([ids1[0][:8]], 4, **run.gen_args)  # warm-up
        base = eng.generate(ids1, run.max_new_tokens, **run.gen_args)
        tokens, seconds = list(base.tokens), base.seconds
        if turns == 2:  # the turn-2 prompts are only known after the baseline's first answers
            for i, _ in jobs1:
                if len(plist[i].turns) > 1:
                    answer = tok.decode(base.tokens[i], skip_special_tokens=True)
                    jobs2.append((i, 1))
                    ids2.append(render_turn(tok, plist[i], 1, [answer]))
            if ids2:
                if max(len(p) for p in ids2) + run.max_new_tokens + run.k + 1 > run.max_len:
                    raise ValueError("a turn-2 prompt is longer than planned; lower max_new_tokens")
                b2 = eng.generate(ids2, run.max_new_tokens, **run.gen_args)
                tokens += b2.tokens
                seconds += b2.seconds
        b1 = [_measure(eng, run, base.tokens)] if run.batch1 else []
        samples = _samples(eng, run, side=0)
    out = _Baseline(jobs1 + jobs2, ids1 + ids2, tokens, seconds, b1, samples)
    run.log(f"target alone: {out.new_tokens} tokens, {out.tokens_per_s:.1f} tok/s")
    return out


def _engine(run: _Run, name: str | None) -> VLLMEngine:
    """The target alone (``name`` None) or with the draft exported at ``name``, built the run's way."""
    if name is None:
        return VLLMEngine(run.target_dir, None, run.k, max_model_len=run.max_len, **run.engine_args)
    method, k = served_method(name, run.k)
    return VLLMEngine(run.target_dir, name, k, method=method, max_model_len=run.max_len, **run.engine_args)


def _samples(eng: VLLMEngine, run: _Run, side: int) -> list[list[list[int]]] | None:
    """The distribution check's samples from ``eng`` (None: no check): ``run.dist_samples`` of each of the
    shortest first turns, seeds apart for each side (0: the target alone, 1: with a draft)."""
    if not run.dist_samples:
        return None
    n = run.dist_samples
    idx = figures.shortest_prompts(run.first_ids, figures.DIST_PROMPTS)
    args = {**run.gen_args, "sequential": False, "seed": run.dist_seed + side * 10**6}
    g = eng.generate([run.first_ids[i] for i in idx for _ in range(n)], figures.DIST_TOKENS, **args)
    return [g.tokens[j * n : (j + 1) * n] for j in range(len(idx))]


def _measure(eng: VLLMEngine, run: _Run, reference: list[list[int]]) -> dict[str, Any]:
    return batch1.measure(eng, run.first_ids, run.batch1, run.max_new_tokens, run.gen_args, reference)


def _batch1_rounds(run: _Run, base: _Baseline, drafts: dict[str, dict], first: dict[str, dict]) -> None:
    """The batch-1 rounds after each engine's first (interleaved: eval/batch1.py), then each draft's figures."""

    def once(name: str | None) -> dict[str, Any]:
        with _engine(run, name) as eng:
            eng.generate([run.first_ids[0][:8]], 4, **run.gen_args)  # warm-up
            return _measure(eng, run, base.tokens)

    measured = {name: [m] for name, m in first.items()}
    batch1.interleave(run.batch1_rounds, lambda: once(None), {n: (lambda n=n: once(n)) for n in measured},
                      base.batch1, measured, run.log)  # fmt: skip
    for name, ms in measured.items():
        d = drafts[name]
        d["batch1"] = batch1.costs(ms, base.batch1, d["k"])
        if run.greedy:  # sampled outputs depend on how requests are batched: equal tokens are not asked there
            d["lossless"]["ok"] = d["lossless"]["ok"] and d["batch1"]["same_tokens_as_batched"]


def _run_draft(
    run: _Run, name: str, fmt: str, base: _Baseline, records: list[dict]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The target with draft ``name``: its report entry (each record gets the draft's line) and its first batch-1
    measurement (None: not run)."""
    method, k = served_method(name, run.k)
    with _engine(run, name) as eng:
        run.log(f"{name} ({fmt}, {method}, k {k}) loaded in {eng.load_seconds:.1f}s")
        eng.generate([base.ids[0][:8]], 4, **run.gen_args)  # warm-up
        spec = eng.generate(base.ids, run.max_new_tokens, **run.gen_args)
        b1 = _measure(eng, run, base.tokens) if base.batch1 else None
        served = _served_config(eng, run)
        samples = _samples(eng, run, side=1)
    stats = counter_stats(spec.counters, k)
    divergences = []
    for j, (rec, (i, t), st, bt) in enumerate(zip(records, base.jobs, spec.tokens, base.tokens)):
        dv = divergence(st, bt, prompt=i, id=run.prompts[i].id, turn=t + 1) if run.greedy else None
        if dv is not None:
            divergences.append(dv)
        rec["drafts"][name] = {"new_tokens": len(st), "diverges_at": None if dv is None else dv["position"],
                               "accepted": None if spec.rounds is None else spec.rounds[j]}  # fmt: skip
    new = sum(len(t) for t in spec.tokens)
    tps = new / spec.seconds if spec.seconds else 0.0
    entry: dict[str, Any] = {
        "format": fmt,
        "method": method,
        "k": k,
        "load_seconds": round(eng.load_seconds, 2),
        **stats,
        "counters": spec.counters,
        "new_tokens": new,
        "seconds": round(spec.seconds, 3),
        "tokens_per_s": round(tps, 3),
        "speedup": round(tps / base.tokens_per_s, 4) if base.tokens_per_s else None,
        "vocab_coverage": vocab_coverage(name, base.tokens),
        "speculative_config": served,
        "engine_repairs": eng.repairs,  # what specdraft repaired in vLLM's kernels first (engine/vllm_kernels.py)
        # T > 0: outputs are samples, equal tokens are not asked (the distribution check is)
        "lossless": {
            "checked": run.greedy,
            "ok": not divergences if run.greedy else None,
            "divergences": divergences,
        },
    }
    if samples is not None:
        entry["distribution"] = figures.compare_distributions(samples, base.samples, figures.DIST_TOKENS)
    if spec.rounds is not None:
        flat = [a for r in spec.rounds for a in r]
        entry["per_request_consistent"] = bool(
            len(flat) == stats["rounds"] and sum(flat) == stats["accepted_tokens"]
        )
    ll = entry["lossless"]
    run.log(f"{name}: tau {stats['tau']:.3f}, {tps:.1f} tok/s, lossless "
            + ("n/a (T>0)" if not ll["checked"] else "yes" if ll["ok"] else "NO"))  # fmt: skip
    return entry, b1


def _served_config(eng: VLLMEngine, run: _Run) -> dict[str, Any]:
    """The speculative config ``eng`` runs with, read back; refuses block verification the runner lacks."""
    served = eng.speculative_settings()
    if served.get("rejection_sample_method") == "block" and served.get("model_runner") != "v2":
        raise RuntimeError(
            "vLLM accepted rejection_sample_method='block' but runs its V1 model runner, which verifies token by "
            "token: block verification needs Model Runner V2 (a GPU with Triton); rerun without --verify block"
        )
    return served


def _add_reference(
    report: dict, exports: list[str], reference: list[str], target: str, prompts: str, turns: int,
    max_prompts: int, max_new_tokens: int, k: int, out: str, progress: bool,
) -> None:  # fmt: skip
    """Run the reference decoder on the same prompts and k; put its figures next to vLLM's."""
    import tempfile

    from specdraft.eval.reference import evaluate_report

    with tempfile.TemporaryDirectory(prefix="specdraft_ref_") as tmp:
        ref = evaluate_report(list(dict.fromkeys(reference)), target=target, prompts=prompts, turns=turns, max_prompts=max_prompts,
                              max_new_tokens=max_new_tokens, k=k, temperature=0.0,
                              out=str(Path(out) / "reference") if out else tmp, progress=progress)  # fmt: skip
    for name, ref_name in zip(exports, reference):
        rname = str(Path(ref_name))
        report["drafts"][name]["reference"] = compare_with_reference(report, name, ref, rname)


# ---------------------------------------------------------------------------------------------------------
# the evaluation
# ---------------------------------------------------------------------------------------------------------


def evaluate_vllm(
    export_dir: str | Sequence[str],
    target: str = EMBEDDED_DEFAULT,
    prompts: str | Sequence[Any] = "mtbench",
    k: int = 5,
    max_new_tokens: int = 128,
    turns: int = 1,
    max_prompts: int = 0,
    dtype: str = "",
    ignore_eos: bool = False,
    sequential: bool = False,
    batch1_prompts: int = 0,
    batch1_rounds: int = 1,
    max_num_seqs: int = 16,
    seed: int = 0,
    reference: Sequence[str] | None = None,
    out: str = "",
    trust_remote_code: bool = False,
    engine_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    temperature: float = 0.0,
    top_p: float = 1.0,
    draft_sample: str = "greedy",
    verify: str = "standard",
    dist_samples: int = 0,
) -> dict:
    """Serve the target with each exported draft in vLLM, and alone; the report as a dict (module doc).

    Args:
        export_dir: one or more `specdraft export` directories (speculators or eagle3 format).
        target: the target the drafts were trained for (HF dir or id, or the embedded default).
        prompts: ``mtbench`` / a jsonl path, or a list of token-id lists, user messages or chats.
        k: speculative tokens per round.
        max_new_tokens: tokens generated per prompt and turn.
        turns: 1 = first turns; 2 = also second turns, after the target-only first answer (as the
            reference evaluation does).
        max_prompts: use only the first N prompts (0 = all).
        dtype: ``float32`` or ``bfloat16`` (empty: float32 on CPU, bfloat16 on GPU).
        ignore_eos: always generate ``max_new_tokens`` (the reference decoder stops at EOS; keep False
            to compare with it).
        sequential: one prompt per ``LLM.generate`` call (single-stream speed) instead of one batch.
        batch1_prompts: also serve the first N first turns one at a time with each engine (batch 1: latency),
            reported as ``batch1`` next to the batched figures (0 = not).
        batch1_rounds: batch-1 measurements of every engine, interleaved with the target alone's (A D A D ... A,
            each in a fresh engine: :mod:`specdraft.eval.batch1`); the speed-up is the median over the rounds.
            1 measures each engine once, in its main run. Raise it on a shared or noisy machine: each round
            loads every engine again.
        max_num_seqs: sequences vLLM decodes together.
        seed: engine seed.
        reference: training outputs / saved drafts, one per export, to run the reference decoder
            (:func:`specdraft.eval.reference.evaluate_report`) on the same prompts and k and put its figures
            next to vLLM's (``drafts[name]["reference"]``).
        out: write ``report_vllm.json`` and ``acceptance_per_position.png`` there (empty: write nothing).
        trust_remote_code: allow the target's custom code.
        engine_kwargs: more ``vllm.LLM`` options (unchecked).
        progress: print a line per engine.
        temperature: 0 = greedy (lossless: equal tokens); > 0 samples, each request seeded (``seed`` + its index).
        top_p: nucleus sampling's mass at T > 0 (1 = off).
        draft_sample: ``greedy`` or ``probabilistic`` drafting (SpeculativeConfig ``draft_sample_method``).
        verify: ``standard`` or ``block`` verification (``rejection_sample_method``; block needs Model Runner V2).
        dist_samples: T > 0: samples a side of the distribution check (:mod:`specdraft.eval.stats`, on the
            ``stats.DIST_PROMPTS`` shortest first turns, ``stats.DIST_TOKENS`` tokens each); 0 = off.

    Raises:
        ValueError: bad arguments, or a reference list that does not pair with the exports.
        FileNotFoundError: an export directory without config.json.
    """
    exports = _check_arguments(export_dir, prompts, turns, k, max_new_tokens, reference, batch1_rounds)
    if not (temperature >= 0 and 0 < top_p <= 1 and dist_samples >= 0) or (dist_samples and not temperature):
        raise ValueError(f"evaluate_vllm: temperature {temperature} (>= 0), top_p {top_p} (in (0, 1]) and "
                         f"dist_samples {dist_samples} (>= 0, at T > 0 only) are out of range")  # fmt: skip
    formats = {e: export_format(e) for e in exports}
    dtype = dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    target_dir, tok, stops, plist = _plan(target, prompts, max_prompts, turns, trust_remote_code)
    ids1 = [render_turn(tok, p, 0, []) for p in plist]
    max_k = max(served_method(e, k)[1] for e in exports)
    max_len = max(len(p) for p in ids1) + max_new_tokens + max_k + 1
    if turns == 2:  # the turn-2 prompts are only known after the baseline's first answers
        max_len += 2 * max_new_tokens + 64
    run = _Run(target_dir, tok, plist, ids1, k, max_new_tokens, max_len,
               engine_args=dict(dtype=dtype, max_num_seqs=max_num_seqs, seed=seed,
                                trust_remote_code=trust_remote_code, engine_kwargs=engine_kwargs,
                                draft_sample=draft_sample, verify=verify),
               gen_args=dict(stop_ids=stops, ignore_eos=ignore_eos, sequential=sequential, temperature=temperature,
                             top_p=top_p, seed=seed if temperature else None),
               log=lambda msg: print(f"eval[vllm]: {msg}", flush=True) if progress else None,
               batch1=batch1_prompts, batch1_rounds=batch1_rounds, dist_samples=dist_samples,
               dist_seed=10**7 + seed)  # fmt: skip

    settings = dict(k=k, max_new_tokens=max_new_tokens, turns=turns, prompts=len(plist), temperature=temperature,
                    top_p=top_p, draft_sample=draft_sample, verify=verify, dist_samples=dist_samples,
                    dtype=dtype, ignore_eos=ignore_eos, stop_ids=list(stops), sequential=sequential,
                    batch1_prompts=min(batch1_prompts, len(plist)), batch1_rounds=batch1_rounds,
                    max_num_seqs=max_num_seqs, seed=seed, device="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip

    base = _run_baseline(run, turns)
    records = [{"id": plist[i].id, "category": plist[i].category, "turn": t + 1, "prompt_tokens": len(ids),
                "baseline": {"new_tokens": len(bt)}, "drafts": {}}
               for (i, t), ids, bt in zip(base.jobs, base.ids, base.tokens)]  # fmt: skip
    drafts, first = {}, {}
    for name in exports:
        drafts[name], b1 = _run_draft(run, name, formats[name], base, records)
        if b1 is not None:
            first[name] = b1
    if base.batch1:
        _batch1_rounds(run, base, drafts, first)
    report = {"engine": "vllm", "vllm_version": engines.installed_version("vllm") or "not installed", "target": target_dir, "settings": settings,
              "baseline": {"new_tokens": base.new_tokens, "seconds": round(base.seconds, 3),
                           "tokens_per_s": round(base.tokens_per_s, 3), **({"batch1": batch1.baseline(base.batch1)} if base.batch1 else {})},
              "drafts": drafts, "records": records}  # fmt: skip
    if reference is not None:
        _add_reference(report, exports, list(reference), target, str(prompts), turns, max_prompts,
                       max_new_tokens, k, out, progress)  # fmt: skip
    if out:
        o = Path(out)
        o.mkdir(parents=True, exist_ok=True)
        report["plots"] = [str(p) for p in write_plots(report, o)]  # acceptance per position, as --engine hf
        (o / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return report

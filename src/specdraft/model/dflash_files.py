"""A DFlash draft's files: specdraft's own (save/load, resumable) and the two served formats.

specdraft's own: `config.json` ({"format": "specdraft.dflash", "dflash": DFlashConfig fields, ...extra}) and
`model.safetensors` (the whole state, the frozen embedding and head included).

Served formats (`served_files`), learned from the engines' public code (vLLM 0.32 `speculators/algos.py`
and `qwen3_dflash.py`, SGLang `models/dflash.py` and `speculative/dflash_utils.py`):

  speculators  vLLM (`vllm serve TARGET --speculative-config '{"model": OUT, ...}'` or `vllm serve OUT`):
               config.json with `speculators_model_type: dflash`, `aux_hidden_state_layer_ids` (hidden
               states ENTERING those target layers, our ids; vLLM derives the DFlash `target_layer_ids` as
               id - 1), `mask_token_id`, `draft_vocab_size`, `target_hidden_size`, `block_size`, the draft's
               Qwen3-style layers as `transformer_layer_config`, `speculators_config` with
               `speculative_tokens` = block_size - 1 and the verifier. Weights `fc`, `hidden_norm`,
               `layers.i.*`, `norm`, `lm_head` (+ `d2t` when the draft vocabulary is smaller than the
               target's); a trained mask embedding goes to `mask_embedding.pt`, which vLLM reads.
  sglang       SGLang (`--speculative-algorithm DFLASH --speculative-draft-model-path OUT`), the z-lab layout:
               a Qwen3 config with `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`,
               `dflash_config: {target_layer_ids (= our ids - 1), mask_token_id}`. SGLang uses the target's
               embedding and LM head, so weights are `fc`, `hidden_norm`, `layers.i.*`, `norm` only, and only
               a draft with the full vocabulary and the untrained (target) mask embedding can be served.

Both engines read target layer ids as outputs of layers (id - 1): an aux id of 0 (the embeddings) has no
served form and is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.model.dflash import FORMAT, DFlashConfig, DFlashDraft

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MASK_FILE = "mask_embedding.pt"
SERVED_FORMATS = ("speculators", "sglang")


def is_dflash_dir(path: str | Path) -> bool:
    """`path` holds a saved DFlash draft (specdraft's own files)."""
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_dflash(draft: DFlashDraft, path: str | Path, extra: dict | None = None) -> Path:
    """Write config.json + model.safetensors of `draft` into `path` (created)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(
        json.dumps({"format": FORMAT, "dflash": draft.cfg.to_dict(), **(extra or {})})
    )
    return path


def load_dflash(path: str | Path) -> DFlashDraft:
    """The draft saved in `path` by `save_dflash`."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / CONFIG_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a saved DFlash draft (format {meta.get('format')!r}, not {FORMAT!r})"
        )
    draft = DFlashDraft(DFlashConfig(**meta["dflash"]))
    draft.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    return draft


def layer_config(cfg: DFlashConfig) -> dict:
    """The draft's layers as a transformers Qwen3 config dict (what both engines build their layers from)."""
    rope = dict(cfg.rope_parameters)
    return {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_parameters": rope,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "hidden_act": cfg.hidden_act, "attention_bias": False, "tie_word_embeddings": False,
    }  # fmt: skip


def served_problems(cfg: DFlashConfig, fmt: str) -> list[str]:
    """Why `cfg` cannot be written in served format `fmt` (empty: it can)."""
    out = []
    if fmt not in SERVED_FORMATS:
        out.append(f"format must be one of {SERVED_FORMATS}, not {fmt!r}")
    if cfg.aux_layer_ids and cfg.aux_layer_ids[0] < 1:
        out.append(
            f"aux layer id 0 (the embeddings) has no served form (engines read id - 1): {cfg.aux_layer_ids}"
        )
    if fmt == "sglang":
        if cfg.draft_vocab_size != cfg.vocab_size:
            out.append(f"SGLang's DFlash uses the target's full LM head: the draft vocabulary ({cfg.draft_vocab_size}) "
                       f"must be the target's ({cfg.vocab_size}); export --format speculators for vLLM instead")  # fmt: skip
        if cfg.train_mask_embedding:
            out.append("SGLang's DFlash embeds mask slots with the target's embedding of mask_token_id: a draft "
                       "trained with its own mask embedding serves in vLLM only (--format speculators)")  # fmt: skip
        if cfg.hidden_act != "silu":
            out.append(f"SGLang's DFlash supports the silu activation only, not {cfg.hidden_act}")
    return out


def served_files(
    draft: DFlashDraft, fmt: str, verifier: str, verifier_archs: list[str] | None = None, dtype=torch.bfloat16
) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor | None]:
    """(config.json, weights, mask embedding or None) of `draft` in served format `fmt`."""
    cfg = draft.cfg
    problems = served_problems(cfg, fmt)
    if problems:
        raise ValueError("export: " + "; ".join(problems))
    skip = ("embed_tokens.", "mask_embedding", "t2d", "d2t") + (("lm_head.",) if fmt == "sglang" else ())
    state = {
        k: v.detach().to("cpu", dtype).contiguous()
        for k, v in draft.state_dict().items()
        if not k.startswith(skip)
    }
    if fmt == "speculators" and cfg.draft_vocab_size < cfg.vocab_size:
        state["d2t"] = draft.d2t.detach().cpu().long()
    mask = draft.mask_embedding.detach().cpu().to(dtype) if cfg.train_mask_embedding else None
    layers = layer_config(cfg)
    if fmt == "sglang":
        config = {**layers, "architectures": ["DFlashDraftModel"], "block_size": cfg.block_size,
                  "num_target_layers": cfg.target_num_layers,
                  "dflash_config": {"target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                                    "mask_token_id": cfg.mask_token_id}}  # fmt: skip
        return config, state, None
    config = {
        "architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash", "speculators_version": "0.3.0",
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size, "transformer_layer_config": layers,
        # how the draft was trained, written rather than left to vLLM's defaults: the anchor is the bonus token
        # (only mask slots predict) and the block attends to itself non-causally
        "sample_from_anchor": False, "sliding_window_non_causal": True,
        "speculators_config": {
            "algorithm": "dflash", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_archs or [])},
        },
    }  # fmt: skip
    return config, state, mask


def mask_embedding_file(cfg: DFlashConfig, mask: torch.Tensor) -> dict:
    """What `mask_embedding.pt` holds (vLLM checks its mask_token_id against the config's)."""
    return {"mask_token_id": cfg.mask_token_id, "embedding": mask}


def write_served(
    out: str | Path, config: dict, state: dict[str, torch.Tensor], mask_file: dict | None
) -> list[str]:
    """Write a served export into `out` (must be new or empty); returns the file names written."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export: {out} is not empty; give a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    names = [CONFIG_FILE, WEIGHTS_FILE]
    if mask_file is not None:
        torch.save(mask_file, out / MASK_FILE)
        names.append(MASK_FILE)
    return names

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
import re
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


def write_dflash(draft: DFlashDraft, path: Path, extra: dict | None = None) -> None:
    """Write model.safetensors then config.json of `draft` into the existing directory `path` (not atomic by
    itself: `save_dflash`, or a checkpoint's writer, gives it a private temporary directory)."""
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(
        json.dumps({"format": FORMAT, "dflash": draft.cfg.to_dict(), **(extra or {})})
    )


def save_dflash(draft: DFlashDraft, path: str | Path, extra: dict | None = None, at=None) -> Path:
    """Write config.json + model.safetensors of `draft` as the directory `path`, whole: into a private
    temporary renamed over `path` when complete (`fileio.atomic_dir`; `at`: its test hook)."""
    from specdraft.fileio import atomic_dir

    path = Path(path)
    with atomic_dir(path, at) as tmp:
        write_dflash(draft, tmp, extra)
    return path


#: what to do about a saved draft that cannot be read
UNREADABLE_FIX = ("a checkpoints/step_N: delete it to resume from the checkpoint before it; a final/: rerun the "
                  "train command with --resume to write it again; else save or download the draft again")  # fmt: skip


def read_dflash_config(path: str | Path, fix: str = UNREADABLE_FIX) -> dict:
    """The config.json of the saved draft in `path`, checked: a JSON object of format FORMAT with a `dflash`
    object of DFlashConfig's fields; anything else is one line naming the file, with `fix`."""
    from dataclasses import fields

    from specdraft.fileio import read_state

    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing: {fix}")
    meta = read_state(f, fix, keys=("format", "dflash"))
    if meta["format"] != FORMAT:
        raise ValueError(
            f"{Path(path)} is not a saved DFlash draft (format {meta['format']!r}, not {FORMAT!r})"
        )
    known = {x.name for x in fields(DFlashConfig)}
    if not isinstance(meta["dflash"], dict) or set(meta["dflash"]) - known:
        raise ValueError(f"{f} cannot be read (its 'dflash' is not an object of DFlash settings): {fix}")
    return meta


def load_dflash(path: str | Path, fix: str = UNREADABLE_FIX) -> DFlashDraft:
    """The draft saved in `path` by `save_dflash`; a missing, empty or damaged file is one line naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_dflash_config(path, fix)
    try:
        draft = DFlashDraft(DFlashConfig(**meta["dflash"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / CONFIG_FILE} cannot be read ({e}): {fix}") from None
    w = path / WEIGHTS_FILE
    if not w.is_file():
        raise FileNotFoundError(f"{w} is missing: {fix}")
    try:
        draft.load_state_dict(load_file(str(w)))
    except Exception as e:  # a corrupted header or truncated file (SafetensorError), other tensors
        raise ValueError(
            f"{w} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}): {fix}"
        ) from None
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


#: a checkpoint directory's exact name (a user's step_best, step_3_backup or step_03 is not one)
STEP_DIR = re.compile(r"step_(0|[1-9][0-9]*)")
OPTIMIZER_FILE = "optimizer.pt"


def checkpoints(out: Path) -> list[Path]:
    """OUT/checkpoints/step_N directories (that exact name), oldest first: complete or not (`is_ours`)."""
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoint_step(ckpt: Path) -> int | None:
    """The step of a checkpoint a DFlash run wrote whole (its marker: config.json of a DFlash draft recording
    `train.step` = N of its name step_N, beside the weights and optimizer.pt); None for anything else."""
    m = STEP_DIR.fullmatch(ckpt.name)
    try:
        meta = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        return None
    train = meta.get("train") if isinstance(meta, dict) else None
    ok = m and meta.get("format") == FORMAT and isinstance(train, dict) and train.get("step") == int(m[1])
    ok = ok and (ckpt / WEIGHTS_FILE).is_file() and (ckpt / OPTIMIZER_FILE).is_file()
    return int(m[1]) if ok else None


def complete_checkpoints(out: Path) -> list[Path]:
    """The checkpoints a DFlash run wrote whole (`checkpoint_step`), oldest first: what --resume and pruning
    consider; a user's directory, or a partial one of an older specdraft, is left alone."""
    return [p for p in checkpoints(out) if checkpoint_step(p) is not None]


def newest_checkpoint(out: str | Path) -> Path | None:
    """The newest checkpoint a DFlash run under `out` wrote whole, or None."""
    done = complete_checkpoints(Path(out))
    return done[-1] if done else None

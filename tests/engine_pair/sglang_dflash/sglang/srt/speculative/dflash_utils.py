"""Stand-in for SGLang's DFlash draft-config parser: every key is read through small helpers that take the
config (a dict or an object) and a key, as SGLang's are (written for specdraft's tests, not SGLang's text)."""

from dataclasses import dataclass

FALLBACK_MASK = "<mask>"


def _read(cfg, name, fallback=None):
    if isinstance(cfg, dict):
        return cfg.get(name, fallback)
    return getattr(cfg, name, fallback)


def _inner(cfg):
    if isinstance(cfg, dict):
        return cfg.get("text_config", cfg)
    inner = getattr(cfg, "text_config", None)
    return inner if inner is not None else cfg


def _block_section(cfg):
    section = cfg.get("dflash_config") if isinstance(cfg, dict) else getattr(cfg, "dflash_config", None)
    if section is None:
        return {}
    return section


def pick_layers(n_target, n_draft):
    step = max(1, n_target // (n_draft + 1))
    return [step * (i + 1) for i in range(n_draft)]


@dataclass
class BlockDraftSettings:
    num_hidden_layers: int
    block_size: int
    target_layer_ids: list
    mask_token: str
    mask_token_id: int


def parse_dflash_draft_config(*, draft_hf_config):
    section = _block_section(draft_hf_config)
    text = _inner(draft_hf_config)
    layers = _read(text, "num_hidden_layers", None)
    block = section.get("block_size", _read(draft_hf_config, "block_size", None))
    ids = section.get("target_layer_ids", _read(draft_hf_config, "target_layer_ids", None))
    if ids is not None and not isinstance(ids, list):
        raise ValueError("target_layer_ids must be a list")
    mask = section.get("mask_token", _read(draft_hf_config, "mask_token", None)) or FALLBACK_MASK
    mask_id = section.get("mask_token_id", _read(draft_hf_config, "mask_token_id", None))
    return BlockDraftSettings(layers, block, ids, mask, mask_id)

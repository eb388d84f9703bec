"""Published EAGLE-3 drafts read as our own: the speculators format (what vLLM serves natively) and the
original EAGLE-3 layout (`LlamaForCausalLMEagle3`, SGLang's and vLLM's), the two `export.py` writes.

A published draft carries its layer config, `fc`, the decoder layer (`layers.0.` in speculators, `midlayer.`
in EAGLE-3's layout: ours is `midlayer.`), `norm`, `lm_head` and, when its vocabulary is reduced, the map
`d2t` (int64 offsets: draft id i is target id i + d2t[i]) and `t2d` (bool, one per target id), the same
convention as ours. It carries no embeddings (the engines use the target's): `adopt` copies the target's,
and fills in the aux layer ids (EAGLE-3's default (2, L//2, L-3)) when the draft does not record them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.model.draft import CONFIG_FILE, DraftConfig

KINDS = ("speculators", "eagle3")


def published_kind(meta: dict, path: str | Path | None = None) -> str | None:
    """`speculators` or `eagle3` for a published EAGLE-3 draft's config.json, else None. With the draft's
    directory `path`, a config that names another architecture (the EAGLE repository's own drafts say
    `LlamaForCausalLM`) is EAGLE-3's layout when its weights are (`fc`, `midlayer.*`)."""
    if meta.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in (
        meta.get("architectures") or []
    ):
        return "speculators"
    if "LlamaForCausalLMEagle3" in (meta.get("architectures") or []):
        return "eagle3"
    if path is not None and "hidden_size" in meta and _eagle3_weights(Path(path)):
        return "eagle3"
    return None


def _weight_names(d: Path) -> set[str]:
    """The weight names of a draft directory, from the safetensors headers (or a pytorch_model.bin)."""
    from safetensors import safe_open

    names: set[str] = set()
    try:
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                names |= set(st.keys())
        if not names and (d / "pytorch_model.bin").is_file():
            names = set(torch.load(d / "pytorch_model.bin", map_location="meta", weights_only=True))
    except Exception:  # unreadable weights: not recognised here (loading them says why)
        return set()
    return {n.removeprefix("model.") for n in names}


def _eagle3_weights(d: Path) -> bool:
    """Whether a directory's weights are an EAGLE-3 draft's: fc over the aux states and one midlayer."""
    names = _weight_names(d)
    return "fc.weight" in names and any(n.startswith(("midlayer.", "layers.0.")) for n in names)


def _rope(layer: dict) -> dict:
    rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    if "rope_theta" in layer:
        rope.setdefault("rope_theta", layer["rope_theta"])
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def published_config(meta: dict, kind: str) -> DraftConfig:
    """The DraftConfig of a published draft's config.json (`kind`: see `published_kind`)."""
    layer = meta.get("transformer_layer_config", meta) if kind == "speculators" else meta
    aux = meta.get("eagle_aux_hidden_state_layer_ids") or layer.get("eagle_aux_hidden_state_layer_ids")
    if not aux and isinstance(meta.get("eagle_config"), dict):
        # EAGLE-3 / SGLang ids count one lower than vLLM's and ours (SGLang captures the state entering k + 1)
        sglang = meta["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        aux = [k + 1 for k in sglang] if sglang else None
    verifier = (meta.get("speculators_config") or {}).get("verifier") or {}
    vocab = int(layer["vocab_size"])
    try:
        return DraftConfig(
            hidden_size=int(layer["hidden_size"]),
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=int(layer["num_attention_heads"]),
            num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
            vocab_size=vocab,
            draft_vocab_size=int(meta.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
            head_dim=int(layer.get("head_dim") or 0),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_parameters=_rope(layer),
            max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
            target_hidden_size=int(meta.get("target_hidden_size") or layer.get("target_hidden_size") or 0),
            aux_layer_ids=sorted(aux or []),
            norm_before_residual=bool(
                meta.get("norm_before_residual", layer.get("norm_before_residual", False))
            ),
            num_hidden_layers=int(layer.get("num_hidden_layers") or 1),
            fc_norm=bool(meta.get("fc_norm", layer.get("fc_norm", False))),
            norm_output=bool(meta.get("norm_output", layer.get("norm_output", False))),
            hidden_act=layer.get("hidden_act", "silu"),
            attention_bias=bool(layer.get("attention_bias", False)),
            mlp_bias=bool(layer.get("mlp_bias", False)),
            target_name=str(verifier.get("name_or_path") or ""),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"a published {kind} draft's config.json lacks {e} (or holds a bad value)") from None


def published_state(path: str | Path, cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """The weights of a published draft under our names (safetensors, one file or several, or
    pytorch_model.bin); an identity vocabulary map when the draft's vocabulary is the target's."""
    from safetensors.torch import load_file

    d = Path(path)
    files = sorted(d.glob("*.safetensors"))
    if files:
        raw = {k: v for f in files for k, v in load_file(str(f)).items()}
    elif (d / "pytorch_model.bin").is_file():
        raw = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{d} holds a published draft's {CONFIG_FILE} but no weights (*.safetensors or "
                                "pytorch_model.bin)")  # fmt: skip
    state = {}
    for name, t in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        elif name.startswith("layers."):  # a deeper draft's layer j >= 1
            j, rest = name.removeprefix("layers.").split(".", 1)
            name = f"later_layers.{int(j) - 1}.{rest}"
        state[name] = t
    if "d2t" not in state:  # the full vocabulary: the identity map
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    floats = {k: v.float() for k, v in state.items() if v.is_floating_point()}
    return {**state, **floats}


def is_published(path: str | Path) -> bool:
    p = Path(path) / CONFIG_FILE
    try:
        return p.is_file() and published_kind(json.loads(p.read_text()), p.parent) is not None
    except (OSError, ValueError):
        return False


def adopt(draft, target) -> None:
    """Fit a published draft to `target` (a loaded Target or FrozenParts): its embeddings when the draft has
    none, and EAGLE-3's default aux layer ids when it records none; refuses a target of other sizes."""
    from specdraft.targets import default_aux_layer_ids

    cfg = draft.cfg
    if (cfg.target_hidden_size, cfg.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ValueError(f"the published draft is for a target of hidden size {cfg.target_hidden_size} and "
                         f"vocabulary {cfg.vocab_size}, not this one's ({target.hidden_size}, {target.vocab_size})")  # fmt: skip
    if not cfg.aux_layer_ids:
        cfg.aux_layer_ids = default_aux_layer_ids(target.num_layers)
    cfg.target_num_layers = cfg.target_num_layers or target.num_layers
    emb = draft.embed_tokens.weight
    if torch.isnan(emb).any():
        with torch.no_grad():
            emb.copy_(target.embed_tokens.weight.detach().to(emb.device, emb.dtype))

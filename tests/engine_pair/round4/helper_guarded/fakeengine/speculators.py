"""Reads a speculators-style export (the helper, called only for another kind)."""


def _check_vocab(vocab: int) -> None:
    if vocab > 4096:
        raise ValueError(f"draft vocabularies above 4096 are unsupported, got {vocab}")


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    if kind == "medusa":
        _check_vocab(config_dict["draft_vocab_size"])
    return {"kind": kind, "steps": steps, "layers": layers, "vocab": config_dict.get("draft_vocab_size")}

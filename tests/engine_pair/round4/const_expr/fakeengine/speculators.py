"""Reads a speculators-style export (a bound written as a shift)."""

MAX_DRAFT_VOCAB = 1 << 12


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    if config_dict["draft_vocab_size"] > MAX_DRAFT_VOCAB:
        raise ValueError(f"draft vocabularies above {MAX_DRAFT_VOCAB} are unsupported")
    return {"kind": kind, "steps": steps, "layers": layers, "vocab": config_dict.get("draft_vocab_size")}

"""Reads a speculators-style export (`all(...)`: even aux layer ids only)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if not all(i % 2 == 0 for i in config_dict["eagle_aux_hidden_state_layer_ids"]):
        raise ValueError("even aux layers only")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

"""Reads a speculators-style export (`any(...)`: every aux layer id within 0..64, which ours are)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if any(i < 0 or i > 64 for i in config_dict["eagle_aux_hidden_state_layer_ids"]):
        raise ValueError("aux layer out of range")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

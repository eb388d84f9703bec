"""Reads a speculators-style export (item 1: the length of a list that may be missing, too short)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    if len(layers or []) < 4:
        raise ValueError(f"four aux layers wanted, {len(layers or [])} given")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

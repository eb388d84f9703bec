"""Reads a speculators-style export (item 1, mirror: the same list, too long only above 8)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    if len(layers or []) > 8:
        raise ValueError("at most eight aux layers")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

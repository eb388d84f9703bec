"""Reads a speculators-style export (a method __post_init__ runs refuses our k)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    return {"kind": kind, "steps": steps, "layers": layers, "vocab": config_dict.get("draft_vocab_size")}

"""Reads a speculators-style export (a loop over the proposal methods our k passes)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    for i, method in enumerate(spec["proposal_methods"]):
        if method.get("speculative_tokens", 1) > 8:
            raise ValueError(f"proposal method {i}: at most 8 tokens")
    return {"kind": kind, "steps": steps, "layers": layers, "vocab": config_dict.get("draft_vocab_size")}

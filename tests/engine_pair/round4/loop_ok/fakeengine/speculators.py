"""Reads a speculators-style export (a loop every aux layer id of ours passes)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    for layer in config_dict["eagle_aux_hidden_state_layer_ids"]:
        if layer >= 64:
            raise ValueError(f"aux layer {layer} is not below 64")
    return {"kind": kind, "steps": steps, "layers": layers, "vocab": config_dict.get("draft_vocab_size")}

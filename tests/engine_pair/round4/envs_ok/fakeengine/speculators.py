"""Reads a speculators-style export (a refusal the engine's envs module turns on, which our layers pass)."""

from fakeengine import envs


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    if envs.FAKE_STRICT_LAYERS and len(layers) > 8:
        raise ValueError("FAKE_STRICT_LAYERS: at most 8 aux layers")
    return {"kind": kind, "steps": steps, "layers": layers, "vocab": config_dict.get("draft_vocab_size")}

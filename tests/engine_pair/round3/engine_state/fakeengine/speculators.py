"""Reads a speculators-style export (an operand of the engine's own: cannot be told)."""


def _device_limit():
    return None


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if (_device_limit() or 0) < config_dict["draft_vocab_size"]:
        raise ValueError("the device cannot hold this vocabulary")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

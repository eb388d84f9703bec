"""Reads a speculators-style export (`dict.get` with a default: a key our export does not write defaults to on)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if config_dict.get("fc_norm", True):
        raise ValueError("fc_norm is not implemented")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

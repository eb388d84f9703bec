"""Reads a speculators-style export (`not x`, passing: a hidden size must be given)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if not config_dict.get("target_hidden_size"):
        raise ValueError("target_hidden_size is missing")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

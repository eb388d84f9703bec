"""Reads a speculators-style export (a chained comparison: one to two steps)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if not 0 < steps <= 2:
        raise ValueError("one or two steps")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

"""Reads a speculators-style export (`x is None or y`: one or two steps only)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if steps is None or steps > 2:
        raise ValueError(f"{steps} steps: one or two only")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

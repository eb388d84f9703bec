"""Reads a speculators-style export (`not x`: the residual must be normed first)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if not config_dict.get("norm_before_residual"):
        raise ValueError("this build needs norm_before_residual")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

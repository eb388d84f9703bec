"""Reads a speculators-style export (item 1, mirror: a lower bound written with `or`, which our value clears)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if (config_dict.get("draft_vocab_size") or 0) < 2:
        raise ValueError("a draft vocabulary needs two tokens at least")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

"""Reads a speculators-style export (`isinstance`: the vocabulary size is an int, which ours is)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if not isinstance(config_dict.get("draft_vocab_size"), int):
        raise TypeError("draft_vocab_size must be an int")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

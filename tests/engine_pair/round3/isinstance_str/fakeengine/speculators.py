"""Reads a speculators-style export (`isinstance`: the verifier given as a dict is refused)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if isinstance(spec["verifier"], dict):
        raise TypeError("name the verifier with a string")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

"""Reads a speculators-style export (`x in {...}`: legacy kinds refused, ours is not one)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if kind in {"eagle", "medusa"}:
        raise ValueError(f"legacy kind {kind}")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

"""Reads a speculators-style export (`x in {...}`: EAGLE-3 drafts are retired, ours is one)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if kind in {"eagle3", "eagle"}:
        raise ValueError(f"{kind} drafts are retired: serve a DFlash draft")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

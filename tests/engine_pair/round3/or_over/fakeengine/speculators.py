"""Reads a speculators-style export (item 1: an upper bound written with `or`)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    if (config_dict.get("draft_vocab_size") or 0) > 4096:
        raise ValueError(
            f"draft vocabularies above 4096 are unsupported, got {config_dict['draft_vocab_size']}"
        )
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

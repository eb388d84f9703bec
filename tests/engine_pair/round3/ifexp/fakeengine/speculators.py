"""Reads a speculators-style export (a conditional expression picks the bound)."""


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    cap = 4096 if kind == "eagle3" else 65536
    if config_dict["draft_vocab_size"] > cap:
        raise ValueError(f"vocabulary over {cap}")
    return {"kind": kind, "steps": steps, "vocab": config_dict.get("draft_vocab_size")}

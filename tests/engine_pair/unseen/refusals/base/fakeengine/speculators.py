"""Reading a speculators-format export config (base release), shaped like vLLM's."""

SUPPORTED = {"eagle3": "Eagle3Speculator"}


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported {kind}")
    spec = config_dict["speculators_config"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    return {"tokens": tokens, "hidden": config_dict.get("target_hidden_size")}

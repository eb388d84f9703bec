"""Reading a speculators-format export config (value_check): the reader now checks a value we write."""

SUPPORTED = {"eagle3": "Eagle3Speculator"}


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported {kind}")
    spec = config_dict["speculators_config"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    hidden = config_dict["target_hidden_size"]
    if hidden % 128:
        raise ValueError(f"target_hidden_size {hidden} is not a multiple of 128")
    return {"tokens": tokens, "hidden": hidden}

"""Reading a speculators-format export config (v1), shaped like vLLM's."""

SUPPORTED = {}


def register(name):
    def decorator(fn):
        SUPPORTED[name] = fn
        return fn

    return decorator


@register("eagle3")
def update_eagle3(config_dict: dict, layer: dict) -> None:
    layer["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    layer["norm_before_residual"] = config_dict.get("norm_before_residual", True)
    if config_dict.get("target_hidden_size") is not None:
        layer["target_hidden_size"] = config_dict["target_hidden_size"]


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported {kind}")
    spec = config_dict["speculators_config"]
    _ = spec["verifier"]["name_or_path"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    layer = dict(config_dict.get("transformer_layer_config", {}))
    SUPPORTED[kind](config_dict, layer)
    return {"tokens": tokens, **layer}

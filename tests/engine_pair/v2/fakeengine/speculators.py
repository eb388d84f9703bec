"""Reading a speculators-format export config (v2): a new required key, a refused value, a field dropped."""

SUPPORTED = {}


def register(name):
    def decorator(fn):
        SUPPORTED[name] = fn
        return fn

    return decorator


@register("eagle3")
def update_eagle3(config_dict: dict, layer: dict) -> None:
    layer["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    layer["fc_norm"] = config_dict.get("fc_norm", False)
    if config_dict.get("target_hidden_size") is not None:
        layer["target_hidden_size"] = config_dict["target_hidden_size"]
    arch_map = {"qwen3": "Eagle3Qwen3"}
    model_type = layer.get("model_type", "llama")
    if model_type not in arch_map:
        raise ValueError(f"unsupported model_type {model_type}")


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported {kind}")
    spec = config_dict["speculators_config"]
    _ = spec["verifier"]["name_or_path"]
    _ = spec["verifier"]["revision"]
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    layer = dict(config_dict.get("transformer_layer_config", {}))
    SUPPORTED[kind](config_dict, layer)
    return {"tokens": tokens, **layer}

def maybe_override_with_speculators(model, tokenizer, config_dict):
    speculators_config = config_dict.get("speculators_config")
    if speculators_config is None:
        return model, tokenizer, None
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    spec = SpeculatorsConfig.build_vllm_speculative_config(config_dict=config_dict)
    return config_dict["speculators_config"]["verifier"]["name_or_path"], tokenizer, spec

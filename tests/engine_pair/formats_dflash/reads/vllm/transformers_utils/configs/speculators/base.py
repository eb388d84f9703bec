from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES


class SpeculatorsConfig:
    @classmethod
    def extract_transformers_pre_trained_config(cls, config_dict):
        speculators_model_type = config_dict.get("speculators_model_type")
        if speculators_model_type not in SUPPORTED_SPECULATORS_TYPES:
            raise ValueError("not a speculators model")
        pre_trained_config = config_dict.get("transformer_layer_config", {})
        SUPPORTED_SPECULATORS_TYPES[speculators_model_type](config_dict, pre_trained_config)
        return pre_trained_config

    @classmethod
    def validate_speculators_config(cls, config_dict):
        try:
            spec_config = config_dict["speculators_config"]
            _ = spec_config["proposal_methods"][0]["speculative_tokens"]
            _ = spec_config["verifier"]["name_or_path"]
            _ = config_dict["speculators_model_type"]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError("Invalid speculators config structure") from e
        if "transformer_layer_config" not in config_dict:
            raise ValueError("Must provide transformer_layer_config")

    @classmethod
    def build_vllm_speculative_config(cls, config_dict):
        spec_config = config_dict["speculators_config"]
        first_method = spec_config.get("proposal_methods")[0]
        return {"num_speculative_tokens": first_method.get("speculative_tokens")}

class DFlashQwen3Model:
    def __init__(self, vllm_config):
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        self.vocab_size = self.config.vocab_size
        drafter_config = getattr(self.config, "eagle_config", {})
        drafter_config.update(getattr(self.config, "dflash_config", {}))
        self.mask_token_id = drafter_config.get("mask_token_id", getattr(self.config, "mask_token_id", None))
        self.fc_in = len(drafter_config["target_layer_ids"]) * getattr(
            self.config, "target_hidden_size", self.config.hidden_size
        )
        self.layers = [self.config.num_attention_heads for _ in range(self.config.num_hidden_layers)]


class DFlashQwen3ForCausalLM:
    def load_weights(self, weights):
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = getattr(self.config, "vocab_size", None)
        return self.config.draft_vocab_size

"""The EAGLE-3 draft model class: the config fields it reads and the weight names it loads."""

from fakesgl.models.llama import LlamaForCausalLM


class LlamaModel:
    def __init__(self, config):
        if hasattr(config, "target_hidden_size"):
            self.hidden_size_in = config.target_hidden_size
        else:
            self.hidden_size_in = config.hidden_size
        self.embed_tokens = (config.vocab_size, config.hidden_size)
        self.fc = (self.hidden_size_in * 3, config.hidden_size)
        self.layers = [(config.hidden_size, config.hidden_act)]
        if config.hidden_act not in ("gelu",):
            raise ValueError(config.hidden_act)
        self.norm = config.rms_norm_eps
        rope = getattr(config, "rope_parameters", None)
        self.rope_theta = rope.get("rope_theta", 10000) if rope is not None else 10000


class LlamaForCausalLMEagle3(LlamaForCausalLM):
    def __init__(self, config):
        self.config = config
        if self.config.num_hidden_layers != 1:
            raise ValueError("EAGLE3 currently only supports 1 layer")
        self.model = LlamaModel(config)
        if self.config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = (config.vocab_size, config.hidden_size)
        self.hot_token_id = None

    def load_weights(self, weights):
        params = {}
        for name, w in weights:
            if "d2t" in name:
                self.hot_token_id = w
                continue
            if "t2d" in name:
                continue
            params[name] = w
        return params


EntryClass = [LlamaForCausalLMEagle3]

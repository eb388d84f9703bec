class LlamaDecoderLayer:
    def __init__(self, config):
        self.norm_before_residual = config.norm_before_residual
        self.hidden_size = config.hidden_size
        self.target_hidden_size = getattr(config, "target_hidden_size", config.hidden_size)
        self.draft_vocab_size = config.draft_vocab_size

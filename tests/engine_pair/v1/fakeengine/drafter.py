"""The draft model: reads its settings from the model config built by the speculators updater."""


class Drafter:
    def __init__(self, config):
        self.config = config
        self.norm_first = getattr(config, "norm_before_residual", False)
        self.vocab = getattr(config, "draft_vocab_size", None)

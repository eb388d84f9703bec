"""Stand-in for SGLang's DFlash draft model: the layers' fields read off the config object, the DFlash ones
through the parser; weights it has no parameter for are skipped without a word."""

from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config


class DFlashDraftModel:
    def __init__(self, config):
        self.config = config
        width = config.hidden_size
        eps = getattr(config, "rms_norm_eps", 1e-6)
        settings = parse_dflash_draft_config(draft_hf_config=config)
        self.block_size = settings.block_size or 16
        self.layers = [(width, eps) for _ in range(config.num_hidden_layers)]
        self.fc = (len(settings.target_layer_ids or [0]) * width, width)
        self.hidden_norm = width
        self.norm = width

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name not in params:
                continue  # not one of ours: dropped
            params[name].copy_(tensor)


EntryClass = [DFlashDraftModel]

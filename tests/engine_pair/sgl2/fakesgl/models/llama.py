"""The target's model class: where the aux layer ids become capture points."""


class LlamaModel:
    def __init__(self, config):
        self.layers_to_capture = []
        self.norm = config.rms_norm_eps


class LlamaForCausalLM:
    def __init__(self, config):
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = None

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        if layer_ids is None:
            self.model.layers_to_capture = [2, 4, 6]
        else:
            self.model.layers_to_capture = list(layer_ids)


EntryClass = [LlamaForCausalLM]

"""Stand-in for SGLang's Qwen3 target: DFlash's layer ids name a layer's output, captured before the next."""


class Qwen3ForCausalLM:
    def set_dflash_layers_to_capture(self, layer_ids):
        if layer_ids is None:
            raise ValueError("DFlash needs layer ids")
        self.capture = [val + 1 for val in layer_ids]


EntryClass = Qwen3ForCausalLM

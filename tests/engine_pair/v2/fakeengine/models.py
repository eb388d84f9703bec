"""Decoder models (v2: `get_input_embeddings` renamed `embed_input_ids` on every class).

Built by name at run time (`build_model`): a caller cannot know which class it gets.
"""


class DecoderBase:
    """What every decoder model has: its layers, the slice this rank runs, the final norm."""

    def __init__(self, n_layers: int):
        self.layers = [object() for _ in range(n_layers)]
        self.start_layer = 0
        self.end_layer = n_layers
        self.norm = object()


class TinyModel(DecoderBase):
    def embed_input_ids(self, input_ids):
        return input_ids


class SmallModel(DecoderBase):
    def embed_input_ids(self, input_ids):
        return input_ids


class WideModel:
    """A decoder that does not derive from DecoderBase."""

    def __init__(self):
        self.layers = []
        self.start_layer = self.end_layer = 0
        self.norm = None

    def embed_input_ids(self, input_ids):
        return input_ids


MODELS = {"tiny": TinyModel, "small": SmallModel}


def build_model(arch):
    return MODELS[arch](2)

"""Model (v2): get_input_embeddings renamed to embed_input_ids."""


class Model:
    def embed_input_ids(self, input_ids):
        return input_ids

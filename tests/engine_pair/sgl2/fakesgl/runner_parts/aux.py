"""The target runner: reads the aux layer ids from the draft's config."""


def aux_layer_ids(draft_model_config):
    try:
        eagle_config = getattr(draft_model_config.hf_config, "eagle_config", None)
        ids = eagle_config["eagle_aux_hidden_state_layer_ids"]
    except Exception:
        ids = None
    return ids

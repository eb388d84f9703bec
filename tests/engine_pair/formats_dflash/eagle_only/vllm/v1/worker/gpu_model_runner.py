def aux_layers(hf_config):
    return getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)

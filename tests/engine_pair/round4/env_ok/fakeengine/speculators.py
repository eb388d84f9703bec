"""Reads a speculators-style export (a refusal FAKE_STRICT_VOCAB=1 turns on, which our vocabulary passes)."""

import os


def load(config_dict: dict) -> dict:
    kind = config_dict.get("speculators_model_type")
    spec = config_dict["speculators_config"]
    steps = spec["proposal_methods"][0]["speculative_tokens"]
    layers = config_dict.get("eagle_aux_hidden_state_layer_ids")
    if os.environ.get("FAKE_STRICT_VOCAB", "0") == "1" and config_dict["draft_vocab_size"] > 65536:
        raise ValueError("FAKE_STRICT_VOCAB=1: draft vocabularies above 65536 are refused")
    return {"kind": kind, "steps": steps, "layers": layers, "vocab": config_dict.get("draft_vocab_size")}

"""specdraft: train EAGLE-3 speculative-decoding drafts for any Hugging Face causal LM."""

__version__ = "0.1.0"

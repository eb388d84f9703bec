"""A tiny stand-in for SGLang's readers of an EAGLE-3 draft (version 1: loads our eagle3 export as written)."""

__version__ = "1.0"

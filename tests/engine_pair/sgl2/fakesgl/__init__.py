"""A tiny stand-in for SGLang's readers of an EAGLE-3 draft (version 2: refuses, drops and shifts what our export writes)."""

__version__ = "2.0"

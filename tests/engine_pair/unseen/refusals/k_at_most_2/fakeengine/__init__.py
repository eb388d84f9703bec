"""A fake engine for doctor's refusal checks (k_at_most_2): lazy re-exports like vLLM's top-level package."""

from importlib import import_module
from typing import Any

__version__ = "2.0"

MODULE_ATTRS = {"LLM": ".entrypoints:LLM"}


def __getattr__(name: str) -> Any:
    if name in MODULE_ATTRS:
        module, attr = MODULE_ATTRS[name].split(":")
        return getattr(import_module(module, __package__), attr)
    raise AttributeError(name)

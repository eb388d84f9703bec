"""A fake engine for doctor's **kwargs collision check (issue 37 item 1), release `popped`."""

from .llm import LLM

__all__ = ["LLM"]

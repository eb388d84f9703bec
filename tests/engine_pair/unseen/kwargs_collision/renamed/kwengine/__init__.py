"""A fake engine for doctor's **kwargs collision check (issue 37 item 1), release `renamed`."""

from .llm import LLM

__all__ = ["LLM"]

"""Offline entry point (k_at_most_2)."""

from .config import SpeculativeConfig


class LLM:
    """The engine."""

    def __init__(
        self, model: str, *, dtype: str = "auto", seed: int = 0, speculative_config: dict | None = None
    ):
        if seed < 0:
            raise ValueError("seed must be >= 0")
        self.model = model
        self.spec = SpeculativeConfig(**speculative_config) if speculative_config else None

"""Offline entry point (entry_assert): a new assert on an argument we pass, a reworded seed check."""

from .config import SpeculativeConfig


class LLM:
    """The engine."""

    def __init__(
        self, model: str, *, dtype: str = "auto", seed: int = 0, speculative_config: dict | None = None
    ):
        assert dtype in ("auto", "bfloat16"), f"dtype {dtype} is not supported"
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.model = model
        self.spec = SpeculativeConfig(**speculative_config) if speculative_config else None

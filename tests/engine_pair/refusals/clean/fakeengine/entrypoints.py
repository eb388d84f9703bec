"""Offline entry point (clean): the same refusals on what we pass, moved; new ones on what we do not pass."""

import os

from .config import SpeculativeConfig


def _platform_supported() -> bool:
    return os.name == "posix"


class LLM:
    """The engine."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        seed: int = 0,
        speculative_config: dict | None = None,
        kv_cache_specs: dict | None = None,
    ):
        if not _platform_supported():
            raise RuntimeError("this platform is not supported")
        if kv_cache_specs is not None and not kv_cache_specs:
            raise ValueError("kv_cache_specs is empty")
        # the same check as before, further down
        if seed < 0:
            raise ValueError("seed must be >= 0")
        self.model = model
        self.spec = SpeculativeConfig(**speculative_config) if speculative_config else None

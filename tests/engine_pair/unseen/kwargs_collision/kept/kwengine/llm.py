"""Offline entry point (kept): `LLM.__init__` takes `kv_cache_memory_bytes` by name, as `EngineArgs` does."""

from .args import EngineArgs


class LLM:
    def __init__(
        self, model: str, *, dtype: str = "auto", kv_cache_memory_bytes: int | None = None, **kwargs
    ):
        self.args = EngineArgs(
            model=model, dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes, **kwargs
        )

"""Offline entry point (popped): renamed as in `renamed`, but the old name is taken out of `**kwargs` first."""

from .args import EngineArgs


class LLM:
    def __init__(self, model: str, *, dtype: str = "auto", kv_cache_bytes: int | None = None, **kwargs):
        kv_cache_bytes = kwargs.pop("kv_cache_memory_bytes", kv_cache_bytes)
        self.args = EngineArgs(model=model, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, **kwargs)

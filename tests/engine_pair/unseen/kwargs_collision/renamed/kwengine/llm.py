"""Offline entry point (renamed): `kv_cache_memory_bytes` renamed `kv_cache_bytes` here only.

`EngineArgs` still has the old name, so a caller's `kv_cache_memory_bytes=` now lands in `**kwargs` and
collides with the explicit keyword below: `got multiple values for keyword argument`.
"""

from .args import EngineArgs


class LLM:
    def __init__(self, model: str, *, dtype: str = "auto", kv_cache_bytes: int | None = None, **kwargs):
        self.args = EngineArgs(model=model, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, **kwargs)

"""The engine's arguments: every release keeps `kv_cache_memory_bytes` here."""

from dataclasses import dataclass


@dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    seed: int = 0

"""Offline entry point (v1)."""


class LLM:
    """The engine."""

    def __init__(self, model: str, *, dtype: str = "auto", kv_cache_specs: dict | None = None, seed: int = 0):
        self.model = model

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), unique_reply_rank=None
    ):
        """v1: always a list of replies, one per worker."""
        return [None]

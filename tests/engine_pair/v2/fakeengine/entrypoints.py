"""Offline entry point (v2): `kv_cache_specs` is gone; collective_rpc may return ONE reply."""


class LLM:
    """The engine."""

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0):
        self.model = model

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), unique_reply_rank=None
    ):
        """v2: a single reply when unique_reply_rank is given (a changed return shape)."""
        return None if unique_reply_rank is not None else [None]

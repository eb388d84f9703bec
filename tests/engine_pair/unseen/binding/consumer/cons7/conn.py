"""A connector whose every call binds as Python binds it: a staticmethod through `self` or the class, a
classmethod either way, a name read under `isinstance(x, OwnSubclass)`, members of either base. No break."""

from eng7.base import KVConnectorBase, KVConnectorMetadata, SupportsHMA
from eng7.config import KVCacheConfig, VllmConfig


class MyMeta(KVConnectorMetadata):
    def __init__(self):
        self.pending_saves = []


class Conn(KVConnectorBase, SupportsHMA):
    @staticmethod
    def _block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, gid: int) -> int:
        if kv_cache_config is None:
            return vllm_config.block_size
        return kv_cache_config.kv_cache_groups[gid]

    @classmethod
    def _groups(cls, kv_cache_config: KVCacheConfig | None, vllm_config: VllmConfig):
        return kv_cache_config.kv_cache_groups, vllm_config.block_size

    def start(self, vllm_config: VllmConfig, kv: KVCacheConfig):
        a = self._block_size(vllm_config, kv, 0)
        b = Conn._block_size(vllm_config, kv, 1)
        c = self._groups(kv, vllm_config)
        d = Conn._groups(kv, vllm_config)
        return a, b, c, d

    def finished(self):
        meta = self._get_connector_metadata()
        if isinstance(meta, MyMeta):
            for p in meta.pending_saves:
                print(p)
        self.request_finished_all_groups()
        return self._vllm_config

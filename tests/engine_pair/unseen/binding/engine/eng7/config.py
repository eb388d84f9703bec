"""The configs a KV connector is handed."""


class VllmConfig:
    def __init__(self):
        self.block_size = 16


class KVCacheConfig:
    def __init__(self):
        self.kv_cache_groups = []

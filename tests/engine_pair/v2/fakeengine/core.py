"""Scheduler (v2): a new required parameter `block_size`."""


class Scheduler:
    def __init__(self, config, block_size: int, cache_config=None):
        self.config = config

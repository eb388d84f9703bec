"""Scheduler (v1)."""


class Scheduler:
    def __init__(self, config, cache_config=None):
        self.config = config

"""Config classes (v1): a dataclass_transform decorator, an inherited __init__, an InitVar."""

from dataclasses import InitVar, dataclass
from typing import dataclass_transform


@dataclass_transform()
def config(cls=None, **kwargs):
    """Like vLLM's @config: makes a dataclass; type checkers see it through dataclass_transform."""

    def wrap(c):
        return dataclass(c, **kwargs)

    return wrap(cls) if cls is not None else wrap


@config
class SchedulerConfig:
    max_num_seqs: int = 128


class BaseConfig:
    def __init__(self, *, block_size: int = 16, swap_space: int = 4):
        self.block_size = block_size


class CacheConfig(BaseConfig):
    """Inherits BaseConfig.__init__."""


@dataclass
class LoadConfig:
    load_format: str = "auto"
    download_dir: InitVar[str | None] = None

    def __post_init__(self, download_dir):
        self.dir = download_dir

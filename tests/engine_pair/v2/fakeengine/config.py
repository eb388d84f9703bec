"""Config classes (v2): each gains a new required field/parameter."""

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
    is_encoder_decoder: bool
    max_num_seqs: int = 128


class BaseConfig:
    def __init__(self, *, cache_dtype: str, block_size: int = 16, swap_space: int = 4):
        self.block_size = block_size


class CacheConfig(BaseConfig):
    """Inherits BaseConfig.__init__, which now requires cache_dtype."""


@dataclass
class LoadConfig:
    seed: InitVar[int]
    load_format: str = "auto"
    download_dir: InitVar[str | None] = None

    def __post_init__(self, seed, download_dir):
        self.dir = download_dir

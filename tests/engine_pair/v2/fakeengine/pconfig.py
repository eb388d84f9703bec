"""A pydantic dataclass config (v2): new required field `world_rank`."""

from pydantic.dataclasses import dataclass


@dataclass
class ParallelConfig:
    world_rank: int
    tensor_parallel_size: int = 1

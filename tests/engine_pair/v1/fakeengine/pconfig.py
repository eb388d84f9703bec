"""A pydantic dataclass config (v1)."""

from pydantic.dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1

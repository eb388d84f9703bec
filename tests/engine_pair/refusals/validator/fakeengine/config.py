"""The speculative-decoding config (validator): a new pydantic validator on the method we pass."""

from pydantic import field_validator
from pydantic.dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    method: str = "draft_model"
    num_speculative_tokens: int = 1

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"unknown speculative method {method!r}")
        return method

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be positive")

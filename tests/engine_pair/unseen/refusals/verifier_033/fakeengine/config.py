"""The speculative-decoding config (verifier_033): a pydantic dataclass, as vLLM's."""

from pydantic.dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    method: str = "draft_model"
    num_speculative_tokens: int = 1

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be positive")

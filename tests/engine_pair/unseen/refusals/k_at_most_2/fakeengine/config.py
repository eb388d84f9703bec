"""The speculative-decoding config (k_at_most_2): refuses more than 2 speculative tokens (issue 37 item 2)."""

from pydantic.dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    method: str = "draft_model"
    num_speculative_tokens: int = 1

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be positive")
        if self.num_speculative_tokens > 2:
            raise ValueError("at most 2 speculative tokens")

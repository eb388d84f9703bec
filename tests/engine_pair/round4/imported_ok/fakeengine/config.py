"""The engine's speculative config (an imported function every layer id of ours passes)."""

from dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        self._verify_args()
        if self.uses_eagle:
            self.num_lookahead_slots = self.num_speculative_tokens

    def _verify_args(self) -> None:
        pass

    @property
    def uses_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")

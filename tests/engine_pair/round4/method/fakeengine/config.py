"""The engine's speculative config (a method __post_init__ runs refuses our k)."""

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
        if self.method == "eagle3" and (self.num_speculative_tokens or 1) > 2:
            raise ValueError(f"eagle3 runs at most 2 speculative tokens, got {self.num_speculative_tokens}")

    @property
    def uses_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")

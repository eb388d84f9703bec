"""Checks the engine shares between its readers (a refusal FAKE_STRICT_VOCAB=1 turns on)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

"""Checks the engine shares between its readers (a loop over the proposal methods our k passes)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

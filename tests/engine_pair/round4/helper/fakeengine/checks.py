"""Checks the engine shares between its readers (a helper refuses our vocabulary)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

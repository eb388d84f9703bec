"""Checks the engine shares between its readers (the release installed here: no check of its own)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

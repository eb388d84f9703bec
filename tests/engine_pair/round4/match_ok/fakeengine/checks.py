"""Checks the engine shares between its readers (a case refuses another kind)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

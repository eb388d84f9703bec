"""Checks the engine shares between its readers (a method __post_init__ runs refuses our k)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

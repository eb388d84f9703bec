"""Checks the engine shares between its readers (a property __post_init__ reads refuses our method)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

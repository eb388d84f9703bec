"""Checks the engine shares between its readers (a loop every aux layer id of ours passes)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

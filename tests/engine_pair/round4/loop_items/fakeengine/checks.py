"""Checks the engine shares between its readers (a loop over the proposal methods refuses our k)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

"""Checks the engine shares between its readers (a name bound with := on one side of `and`)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

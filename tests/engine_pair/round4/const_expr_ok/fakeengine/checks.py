"""Checks the engine shares between its readers (a bound written as a product)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

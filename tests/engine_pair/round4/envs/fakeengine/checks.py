"""Checks the engine shares between its readers (a refusal the engine's envs module turns on)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    pass

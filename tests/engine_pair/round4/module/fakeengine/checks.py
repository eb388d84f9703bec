"""Checks the engine shares between its readers (another module refuses our hidden size)."""


def validate_hidden(cfg: dict) -> None:
    if cfg["target_hidden_size"] % 128:
        raise ValueError("the hidden size must be a multiple of 128")


def validate_layers(ids: list) -> None:
    pass

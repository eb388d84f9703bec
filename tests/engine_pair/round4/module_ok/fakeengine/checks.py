"""Checks the engine shares between its readers (another module's check our hidden size passes)."""


def validate_hidden(cfg: dict) -> None:
    if cfg["target_hidden_size"] % 32:
        raise ValueError("the hidden size must be a multiple of 32")


def validate_layers(ids: list) -> None:
    pass

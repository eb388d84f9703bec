"""Checks the engine shares between its readers (an imported function every layer id of ours passes)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    for i in ids:
        if i >= 64:
            raise ValueError(f"aux layer {i} is past the 64th")

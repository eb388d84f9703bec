"""Checks the engine shares between its readers (an imported function refuses a layer id of ours)."""


def validate_hidden(cfg: dict) -> None:
    pass


def validate_layers(ids: list) -> None:
    for i in ids:
        if i >= 8:
            raise ValueError(f"aux layer {i} is past the eighth")

"""The command line: every option has a help, shows its default and, where it has them, its choices; a mistaken
option names the right one; train's messages name options train has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from specdraft.cli import COMMANDS, build_parser, main

SRC = Path(__file__).resolve().parents[1] / "src" / "specdraft"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from importlib import import_module

    fns = {}
    for name, target in COMMANDS.items():
        mod, fn = target.split(":")
        fns[name] = getattr(import_module(mod), fn)
    parser, _ = build_parser(fns)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_has_a_help_and_its_default():
    missing = []
    for cmd, p in _parsers().items():
        for a in p._actions:
            if a.dest in ("help", "config", "print_config") or not a.option_strings:
                continue
            if not a.help or not a.help.split("(default:")[0].strip() or "(default: " not in a.help:
                missing.append(f"{cmd} {a.option_strings[0]}: {a.help!r}")
    assert not missing, missing


def test_choices_are_listed_and_checked(capsys):
    train = _parsers()["train"]
    opt = {a.dest: a for a in train._actions}
    assert opt["schedule"].choices == ("cosine", "linear", "constant", "wsd")
    assert opt["recipe"].choices == ("auto", "on", "off") and opt["dtype"].choices == (
        "auto",
        "float32",
        "bfloat16",
    )
    assert "wandb" in opt["report_to"].help  # its comment wraps inside parentheses in the source
    assert "(default: off)" in opt["fsdp"].help and "(default: on)" in opt["progress"].help
    assert any(g.title == "train settings" for g in train._action_groups)
    others = {cmd: {a.dest: a.choices for a in p._actions} for cmd, p in _parsers().items()}
    assert others["export"]["format"] == ("speculators", "eagle3", "sglang") and others["eval"]["engine"] == (
        "hf",
        "vllm",
    )
    assert others["extract"]["backend"] == ("hf", "vllm") and others["quickstart"]["budget"] == (
        "tiny",
        "default",
        "large",
    )
    assert others["regenerate"]["turns"] == ("first", "all") and "auto" in others["extract"]["dtype"]
    with pytest.raises(SystemExit):
        main(["train", "a", "b", "--schedule", "cosin"])
    assert "invalid choice: 'cosin'" in capsys.readouterr().err


@pytest.mark.parametrize(("typed", "said"), [("--learning-rate", "specdraft train calls it --lr"),
                                             ("--num-epochs", "specdraft train calls it --epochs"),
                                             ("--ttt-length", "specdraft train calls it --ttt-steps"),
                                             ("--warmup-ration", "did you mean --warmup-ratio?")])  # fmt: skip
def test_a_mistaken_option_names_the_right_one(typed, said, capsys):
    with pytest.raises(SystemExit):
        main(["train", "a", "b", typed, "1"])
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and said in err


def test_trains_messages_name_only_options_train_or_extract_has():
    """A refusal from train tells the user what to type: --out is an option of neither (OUT is positional)."""
    have = {s for cmd in ("train", "extract") for a in _parsers()[cmd]._actions for s in a.option_strings}
    named = set()
    for f in (SRC / "train").glob("*.py"):
        named |= set(re.findall(r"(--[a-z][a-z0-9-]+)", f.read_text()))
    others = {
        "--backend-store-uri",
        "--force-reinstall",
        "--flag",
    }  # mlflow's and pip's; `--flag / --no-flag`
    assert {n for n in named if n not in have and not n.startswith("--no-")} - others == set()

"""The command line: every option has a help, shows its default and, where it has them, its choices; a mistaken
option names the right one; train's messages name options train has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from specdraft.cli import COMMANDS, command_parser, main

SRC = Path(__file__).resolve().parents[1] / "src" / "specdraft"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from importlib import import_module

    out = {}
    for name, target in COMMANDS.items():
        mod, fn = target.split(":")
        out[name] = command_parser(name, getattr(import_module(mod), fn))
    return out


def test_every_option_has_a_help_and_its_default():
    missing = []
    for cmd, p in _parsers().items():
        for a in p._actions:
            if not a.option_strings or a.option_strings[0] in ("-h", "--config", "--print-config"):
                continue
            if not a.help or not a.help.split("(default:")[0].strip() or "(default: " not in a.help:
                missing.append(f"{cmd} {a.option_strings[0]}: {a.help!r}")
    assert not missing, missing


def test_choices_are_listed_and_checked(capsys):
    train = _parsers()["train"]
    opt = {a.option_strings[0][2:].replace("-", "_"): a for a in train._actions if a.option_strings}
    assert opt["schedule"].choices == ("cosine", "linear", "constant", "wsd")
    assert opt["recipe"].choices == ("auto", "on", "off") and opt["dtype"].choices == (
        "auto",
        "float32",
        "bfloat16",
    )
    assert "wandb" in opt["report_to"].help  # its comment wraps inside parentheses in the source
    assert "(default: False)" in opt["fsdp"].help and "(default: True)" in opt["progress"].help
    assert opt["recipe"].help.startswith("the small-run recipe")  # a docstring under the field
    assert any(g.title == "train options" for g in train._action_groups)
    others = {
        cmd: {a.option_strings[0][2:].replace("-", "_"): a.choices for a in p._actions if a.option_strings}
        for cmd, p in _parsers().items()
    }
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
    assert "invalid choice 'cosin'" in capsys.readouterr().err


@pytest.mark.parametrize(("typed", "said"), [("--learning-rate", "specdraft train calls it --lr"),
                                             ("--num-epochs", "specdraft train calls it --epochs"),
                                             ("--ttt-length", "specdraft train calls it --ttt-steps"),
                                             ("--warmup-ration", "did you mean --warmup-ratio?")])  # fmt: skip
def test_a_mistaken_option_names_the_right_one(typed, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "a", "b", typed, "1"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and "nrecognized" in err
        and said in err
        and (typed != "--warmup-ration" or "--warmup-ratio" in err)
    )


def test_a_mistaken_command_names_the_right_one(capsys):
    assert main(["trian"]) == 2 and "did you mean 'train'?" in capsys.readouterr().err
    assert main([]) == 0 and "quickstart" in capsys.readouterr().out


def test_trains_messages_name_only_options_train_or_extract_has():
    """A refusal from train tells the user what to type: --out is an option of neither (OUT is positional)."""
    have = {s for cmd in ("train", "extract") for a in _parsers()[cmd]._actions for s in a.option_strings}
    named = set()
    for f in (SRC / "train").rglob("*.py"):
        named |= set(re.findall(r"(--[a-z][a-z0-9-]+)", f.read_text()))
    others = {
        "--backend-store-uri",
        "--force-reinstall",
        "--flag",
        "--logdir",
        "--nproc",
    }  # mlflow's, pip's, tensorboard's, torchrun's (--nproc_per_node); `--flag / --no-flag`
    assert {n for n in named if n not in have and not n.startswith("--no-")} - others == set()


def test_an_optional_list_reads_as_its_items():
    """`--layers` (list[int] | None) reads `INT [INT ...]` where tyro would write `{[INT [INT ...]]}`, and still
    parses a list."""
    parsers = _parsers()
    for cmd in ("eval", "extract", "doctor"):
        (layers,) = [a for a in parsers[cmd]._actions if "--layers" in a.option_strings]
        assert layers.metavar == "INT [INT ...]", (cmd, layers.metavar)
    from specdraft.cli import _optional_list_metavar

    assert _optional_list_metavar(list[str] | None) == "STR [STR ...]"
    assert _optional_list_metavar(list[int]) is None and _optional_list_metavar(int | None) is None

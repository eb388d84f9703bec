"""Runs that describe themselves: each command writes the settings it ran with beside its output, the trained
draft carries them, `--config FILE` reads them back, `--resume` takes them unless told otherwise."""

from __future__ import annotations

import json

import pytest
from conftest import conversations, write_jsonl
from test_train_rough_edges import shards  # noqa: F401  (the module's fixture)

from specdraft.cli import main

SMALL = ["--draft-vocab-size", "64", "--ttt-steps", "2", "--max-length", "96", "--val-fraction", "0",
         "--no-progress", "--no-tensorboard", "--checkpoint-every", "1"]  # fmt: skip


def settings(path) -> dict:
    return json.loads(path.read_text())["settings"]


def test_train_records_its_settings_and_resume_takes_them(tmp_path, shards, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(["train", str(shards), str(out), *SMALL, "--max-steps", "1", "--lr", "3e-4"]) == 0
    first = settings(out / "train_settings.json")
    assert first["shards"] == str(shards) and first["lr"] == 3e-4 and first["draft_vocab_size"] == 64
    assert first["max_tokens"] == 512 and first["decay"] == 0.5  # the recipe filled what --lr left
    assert "command line: --lr 0.0003" in capsys.readouterr().out
    # final/ carries them: beside the weights, and in its config.json
    assert settings(out / "final" / "train_settings.json") == first
    assert json.loads((out / "final" / "config.json").read_text())["train"]["settings"] == first

    # --resume with no other setting: the recorded ones (today's defaults would be refused as changed)
    assert main(["train", str(shards), str(out), "--resume", "--max-steps", "2"]) == 0
    err = capsys.readouterr().err
    assert (
        f"the settings recorded in {out / 'train_settings.json'}, with the command line's --max-steps over"
        in err
    )
    again = settings(out / "train_settings.json")
    assert again == {**first, "max_steps": 2} and "resume" not in again  # the file starts or resumes a run
    assert json.loads((out / "final" / "config.json").read_text())["train"]["steps"] == 2


def test_the_written_settings_file_is_a_valid_config(tmp_path, shards, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(["train", str(shards), str(out), *SMALL, "--max-steps", "1"]) == 0
    written = out / "train_settings.json"
    capsys.readouterr()
    # its OUT holds the run's checkpoints: --print-config refuses what the run would refuse (issue 61)
    assert main(["train", "--config", str(written), "--print-config", "--lr", "0.5"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert main(["train", "--config", str(written), "--print-config", "--lr", "0.5", "--resume"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["command"] == "train" and shown["settings"] == {
        **settings(written),
        "lr": 0.5,
        "resume": True,
    }
    # a new run from the file alone (its OUT given anew on the command line)
    assert main(["train", "--config", str(written), str(shards), str(tmp_path / "again")]) == 0
    assert settings(tmp_path / "again" / "train_settings.json") == {
        **settings(written),
        "out": str(tmp_path / "again"),
    }


def test_an_unknown_config_setting_names_the_nearest(tmp_path, capsys):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"learning_rate": 1e-3}))
    assert main(["train", "a", "b", "--config", str(f)]) == 2
    assert "has no setting 'learning_rate'" in capsys.readouterr().err
    f.write_text(json.dumps({"command": "eval", "settings": {}}))
    assert main(["train", "a", "b", "--config", str(f)]) == 2
    assert "holds the settings of `specdraft eval`, not train" in capsys.readouterr().err


def test_other_commands_write_their_settings_beside_their_output(tmp_path, tiny_llama_dir):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(4, seed=2))
    ds = tmp_path / "ds"
    assert main(["prepare", str(src), str(ds), "--target", str(tiny_llama_dir), "--max-length", "96"]) == 0
    written = settings(ds / "prepare_settings.json")
    assert written["data"] == [str(src)] and written["max_length"] == 96
    hs = tmp_path / "hs"
    assert main(["extract", str(ds), str(hs), "--skip-doctor", "--samples-per-shard", "4"]) == 0
    doc = json.loads((hs / "extract_settings.json").read_text())
    assert doc["settings"]["device"] == "auto" and doc["resolved"] == {"device": "cpu", "dtype": "float32"}
    # read back: the same extraction, resumed (already complete)
    assert main(["extract", "--config", str(hs / "extract_settings.json")]) == 0


@pytest.mark.parametrize(
    "cmd", ["extract", "eval", "export", "prepare", "regenerate", "quickstart", "doctor"]
)
def test_every_command_takes_a_config_file_and_prints_its_settings(cmd, capsys):
    assert main([cmd, "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["command"] == cmd


def test_a_dflash_run_records_its_settings_too(tmp_path, shards):  # noqa: F811
    out = tmp_path / "dflash"
    argv = ["train", str(shards), str(out), "--draft", "dflash", "--draft-vocab-size", "64", "--block-size", "4",
            "--anchors", "8", "--max-length", "96", "--max-steps", "1", "--val-fraction", "0", "--no-progress",
            "--no-tensorboard"]  # fmt: skip
    assert main(argv) == 0
    written = settings(out / "train_settings.json")
    assert written["draft"] == "dflash" and written["block_size"] == 4 and "resume" not in written

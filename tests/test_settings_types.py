"""Settings files are held to what the command line accepts (issue 48 item 3, issue 49 items 6 and 7): a wrong
type is one line naming every bad value, never a traceback; a recorded settings file read by --resume is named
as such, not as a --config."""

from __future__ import annotations

import json

import pytest

from specdraft import cli


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"lr": "fast"}, "--lr must be a number, not 'fast'"),
        ({"max_steps": 4.7}, "--max-steps must be a whole number, not 4.7"),
        ({"online": "yes"}, "--online must be true or false, not 'yes'"),
        ({"schedule": "weird"}, "--schedule must be one of cosine, linear, constant, wsd, not 'weird'"),
        ({"layers": [2, "x"]}, "--layers must be a whole number, not 'x'"),
        (
            {"lr": "fast", "epochs": True},
            "--lr must be a number, not 'fast'; --epochs must be a whole number",
        ),
    ],
)
def test_a_wrong_type_in_a_settings_file_is_one_line(tmp_path, capsys, bad, says):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(bad))
    for extra in (["--print-config"], []):
        rc = cli.main(["train", str(tmp_path / "hs"), str(tmp_path / "out"), "--config", str(f), *extra])
        err = capsys.readouterr().err
        assert rc != 0 and says in err and "Traceback" not in err, err


def test_good_types_pass(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(
        json.dumps({"lr": 1, "max_steps": 3, "online": True, "layers": [2, 5, 7], "schedule": "wsd"})
    )  # --online: --layers applies (--print-config refuses what the run refuses, issue 61)
    assert cli.main(["train", "hs", "out", "--config", str(f), "--print-config"]) in (0, None)
    assert json.loads(capsys.readouterr().out)["settings"]["lr"] == 1


@pytest.mark.parametrize("content", ["{}", ""])
def test_an_empty_recorded_settings_file_is_named_as_the_runs(tmp_path, capsys, content):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "train_settings.json").write_text(content)
    rc = cli.main(["train", str(tmp_path / "hs"), str(out), "--resume"])
    err = capsys.readouterr().err
    assert rc != 0 and "--config" not in err, err
    if content == "":
        assert "the settings the run recorded, read by --resume" in err and "not JSON" in err, err

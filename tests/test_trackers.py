"""train --report-to: every metrics record reaches each named tracker (wandb, trackio, mlflow: stand-ins of their
APIs, as the libraries are optional extras not installed here) at its step, the run's settings once, and each
tracker is closed at the end; unknown or missing trackers are refused before anything runs."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import types

import pytest
from test_train_rough_edges import cfg, shards  # noqa: F401  (the module's fixture)

from specdraft.train.loop import train
from specdraft.train.report.metrics import TRACKERS, scalars


class Calls(list):
    def __call__(self, *args, **kwargs):
        self.append((args, kwargs))


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


@pytest.fixture
def fakes(monkeypatch):
    """Stand-ins of the three libraries' calls, recording them."""
    rec: dict[str, Calls] = {k: Calls() for k in ("wandb.init", "wandb.log", "wandb.finish", "trackio.init",
                                                  "trackio.log", "trackio.finish", "mlflow.log_params",
                                                  "mlflow.log_metrics", "mlflow.end_run", "mlflow.uri", "mlflow.experiment",
                                                  "mlflow.start_run")}  # fmt: skip
    run = types.SimpleNamespace(log=rec["wandb.log"], finish=rec["wandb.finish"])
    wandb = _module("wandb", init=lambda **kw: rec["wandb.init"](**kw) or run)
    trackio = _module(
        "trackio", init=rec["trackio.init"], log=rec["trackio.log"], finish=rec["trackio.finish"]
    )
    mlflow = _module("mlflow", set_tracking_uri=lambda uri: rec["mlflow.uri"](uri, os.environ.get("MLFLOW_ALLOW_FILE_STORE")), set_experiment=rec["mlflow.experiment"],
                     start_run=rec["mlflow.start_run"], log_params=rec["mlflow.log_params"],
                     log_metrics=rec["mlflow.log_metrics"], end_run=rec["mlflow.end_run"])  # fmt: skip
    for m in (wandb, trackio, mlflow):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for v in (
        "WANDB_MODE",
        "WANDB_DIR",
        "WANDB_PROJECT",
        "WANDB_NAME",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(v, raising=False)
    return rec


def test_every_record_reaches_every_tracker_at_its_step(tmp_path, shards, fakes):  # noqa: F811
    out = tmp_path / "run"
    train(str(shards), str(out), cfg(max_steps=3, report_to="wandb,trackio,mlflow"))
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = [(scalars(r), r["step"]) for r in recs]
    assert len(want) == 3 and "train/loss" in want[0][0] and "train/acc_1" in want[0][0]
    assert [(a[0], kw["step"]) for a, kw in fakes["wandb.log"]] == want
    assert [(a[0], kw["step"]) for a, kw in fakes["trackio.log"]] == want
    assert [(a[0], kw["step"]) for a, kw in fakes["mlflow.log_metrics"]] == want
    init = fakes["wandb.init"][0][1]
    assert init["mode"] == "offline" and init["dir"] == str(out) and init["config"]["max_steps"] == 3
    assert fakes["trackio.init"][0][1]["config"]["report_to"] == "wandb,trackio,mlflow"
    # MLflow 3 refuses a file store without the opt-out (found with mlflow-skinny 3.17.2)
    assert fakes["mlflow.uri"][0][0] == ((out / "mlruns").resolve().as_uri(), "true")
    assert fakes["mlflow.log_params"][0][0][0]["lr"] == str(3e-3)
    assert len(fakes["wandb.finish"]) == len(fakes["trackio.finish"]) == len(fakes["mlflow.end_run"]) == 1


def test_trackers_name_the_run_after_out_and_honour_the_users_variables(
    tmp_path,
    shards,  # noqa: F811
    fakes,
    monkeypatch,
    capsys,
):
    """A project and run name for every tracker (OUT's parent's name and OUT's, or --project / --run-name), and
    the library's own variables the user set win over the offline/local modes (WANDB_MODE, MLFLOW_TRACKING_URI)."""
    out = tmp_path / "llama8b" / "draft-a"
    train(str(shards), str(out), cfg(max_steps=1, report_to="wandb,trackio,mlflow"))
    w, t = fakes["wandb.init"][-1][1], fakes["trackio.init"][-1][1]
    assert (w["project"], w["name"], w["mode"]) == ("llama8b", "draft-a", "offline")
    assert (t["project"], t["name"]) == ("llama8b", "draft-a")
    assert fakes["mlflow.experiment"][-1][0] == ("llama8b",) and fakes["mlflow.start_run"][-1][1] == {
        "run_name": "draft-a"
    }
    assert "--report-to wandb: project 'llama8b', run 'draft-a', mode offline" in capsys.readouterr().out

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_PROJECT", "team")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-exp")
    train(str(shards), str(tmp_path / "b"), cfg(max_steps=1, report_to="wandb,mlflow"))
    w = fakes["wandb.init"][-1][1]
    assert (w["project"], w["name"], w["mode"]) == ("team", "b", "online")
    assert fakes["mlflow.uri"][-1][0][0] == "http://mlflow.example:5000"
    assert fakes["mlflow.experiment"][-1][0] == ("team-exp",)

    # the options win over the variables
    train(
        str(shards),
        str(tmp_path / "c"),
        cfg(max_steps=1, report_to="wandb,trackio,mlflow", project="p", run_name="r"),
    )
    w, t = fakes["wandb.init"][-1][1], fakes["trackio.init"][-1][1]
    assert (w["project"], w["name"], t["project"], t["name"]) == ("p", "r", "p", "r")
    assert fakes["mlflow.experiment"][-1][0] == ("p",) and fakes["mlflow.start_run"][-1][1] == {
        "run_name": "r"
    }


def test_unknown_or_missing_trackers_are_refused_before_the_run(tmp_path, shards, monkeypatch):  # noqa: F811
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    with pytest.raises(ValueError) as e:
        train(str(shards), str(tmp_path / "run"), cfg(report_to="wandb,neptune"))
    assert "pip install wandb" in str(e.value) and "unknown tracker 'neptune'" in str(e.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_broken_tracker_stops_the_run_and_closes_the_others(tmp_path, shards, fakes, monkeypatch):  # noqa: F811
    """Found with the real libraries: trackio installed without its gradio_client imports with an error."""

    def broken(**kw):
        raise ModuleNotFoundError("No module named 'gradio_client'")

    monkeypatch.setattr(sys.modules["trackio"], "init", broken)
    with pytest.raises(RuntimeError) as e:
        train(str(shards), str(tmp_path / "run"), cfg(max_steps=2, report_to="wandb,trackio,mlflow"))
    assert "--report-to trackio" in str(e.value) and "gradio_client" in str(e.value)
    # wandb was open and is closed; mlflow was never opened
    assert len(fakes["wandb.finish"]) == 1 and not fakes["mlflow.log_params"]
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def _read_back(name: str, out) -> int:
    """How many train/loss values (or, for W&B's binary log, bytes) the real library wrote under OUT."""
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(
            str(next(p for p in (out / "tb").rglob("*") if p.is_dir() and any(p.glob("events*"))))
        )
        acc.Reload()
        return len(acc.Scalars("train/loss"))
    if name == "mlflow":
        (path,) = out.glob("mlruns/*/*/metrics/train/loss")
        return len(path.read_text().splitlines())
    if name == "trackio":
        import sqlite3

        (db,) = out.glob("trackio/*.db")
        return sqlite3.connect(db).execute("select count(*) from metrics").fetchone()[0]
    (log,) = out.glob("wandb/offline-run-*/*.wandb")
    return log.stat().st_size


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio", "mlflow"])
def test_the_real_library_receives_the_run_where_installed(tmp_path, shards, name, monkeypatch):  # noqa: F811
    """The stand-ins above, checked against the libraries themselves (skipped where the extra is not installed:
    `pip install specdraft[tracking]`). Run by hand with tensorboard 2.21.0, wandb 0.31.0, trackio 0.43.0 and
    mlflow-skinny 3.17.2, which found MLflow 3's refusal of its file store."""
    if (
        importlib.util.find_spec(TRACKERS[name]) is None
    ):  # not imported here: trackio reads its directory then
        pytest.skip(f"{TRACKERS[name]} is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("TRACKIO_DIR", raising=False)
    out = tmp_path / "run"
    train(str(shards), str(out), cfg(max_steps=3, report_to=name))
    assert _read_back(name, out) >= (3 if name != "wandb" else 1)

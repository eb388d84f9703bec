"""The run's record: OUT/metrics.jsonl, one JSON record a line (+ the trackers of --report-to); rank 0 writes.

Experiment trackers a run also reports to (`train --report-to`), each in its own offline or local mode unless
the user's own variables of that library say otherwise (W&B's `WANDB_MODE`/`WANDB_DIR`, MLflow's
`MLFLOW_TRACKING_URI`, Trackio's `TRACKIO_DIR`/`TRACKIO_SPACE_ID`: a user who set one asked for it). Every tracker
gets a project (`--project`; default: the name of OUT's parent directory, where sibling runs sit) and a run name
(`--run-name`; default: OUT's name); a name set in the library's own variable (`WANDB_PROJECT`, `WANDB_NAME`,
`MLFLOW_EXPERIMENT_NAME`) is used when the option is not given.

Every tracker is an optional extra (`pip install specdraft[tracking]`, or the one library), imported only
when named, and writes under OUT so a run keeps its record with it:

| name | library's mode | where |
| --- | --- | --- |
| tensorboard | `torch.utils.tensorboard.SummaryWriter`, the run named by its directory | OUT/tb/PROJECT/RUN |
| wandb | `wandb.init(mode="offline")` (`WANDB_MODE` wins); `wandb sync OUT/wandb/offline-run-*` uploads it later | OUT/wandb |
| trackio | local SQLite store (`TRACKIO_DIR`), `trackio show` reads it | OUT/trackio |
| mlflow | a file store (`file:` tracking URI unless `MLFLOW_TRACKING_URI` is set; MLflow 3 needs `MLFLOW_ALLOW_FILE_STORE=true`, set when unset), `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri OUT/mlruns` | OUT/mlruns |

Each receives the scalars of every metrics record as `split/name` (lists as `split/name_i`) at the record's
step, and the run's settings once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from specdraft.fileio import atomic_write_text

METRICS_FILE = "metrics.jsonl"


TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "trackio": "trackio",
    "mlflow": "mlflow",
}  # name: module


def tracker_names(report_to: str) -> list[str]:
    """The trackers named in `--report-to` (comma-separated), in order, without repeats."""
    return list(dict.fromkeys(n.strip() for n in report_to.split(",") if n.strip()))


def tracker_problems(report_to: str) -> list[str]:
    """User errors of `--report-to`: unknown names, and libraries not installed (with the install line)."""
    errs = []
    for n in tracker_names(report_to):
        if n not in TRACKERS:
            errs.append(f"--report-to: unknown tracker {n!r}; choose among {', '.join(TRACKERS)}")
        elif importlib.util.find_spec(TRACKERS[n]) is None:
            errs.append(
                f"--report-to {n}: the {TRACKERS[n]} package is not installed: pip install {TRACKERS[n]}"
            )
    return errs


def scalars(rec: dict) -> dict[str, float]:
    """A metrics record's numbers as tracker scalars: `split/name`, list entries as `split/name_i`."""
    split, out = rec.get("split", "train"), {}
    for k, v in rec.items():
        if isinstance(v, bool) or k in ("step", "split"):
            continue
        if isinstance(v, (int, float)):
            out[f"{split}/{k}"] = float(v)
        elif isinstance(v, list):
            out.update({f"{split}/{k}_{i}": float(x) for i, x in enumerate(v) if isinstance(x, (int, float))})
    return out


def default_names(out_dir: Path) -> tuple[str, str]:
    """The project and run name a run reports under when not told: OUT's parent directory's name and OUT's."""
    out = out_dir.resolve()
    return (out.parent.name or "specdraft"), out.name


def _pick(given: str, variable: str, default: str) -> str:
    """An option the user gave, else the library's own environment variable, else the default from OUT."""
    return given or os.environ.get(variable, "") or default


class _TensorBoard:
    """TensorBoard names a run by its directory: OUT/tb/PROJECT/RUN (`tensorboard --logdir OUT/tb` lists it as
    PROJECT/RUN); the settings go in once as a text entry."""

    def __init__(self, out_dir: Path, project: str, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        proj, run = default_names(out_dir)
        log_dir = out_dir / "tb" / (project or proj) / (name or run)
        self.where = f"run {(project or proj) + '/' + (name or run)!r} in {log_dir}"
        self.w = SummaryWriter(str(log_dir))
        self.w.add_text("settings", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _Wandb:
    def __init__(self, out_dir: Path, project: str, name: str, config: dict):
        import wandb

        proj, run = default_names(out_dir)
        project, name = _pick(project, "WANDB_PROJECT", proj), _pick(name, "WANDB_NAME", run)
        mode = os.environ.get("WANDB_MODE") or "offline"  # the user's WANDB_MODE (online, disabled...) wins
        self.where = f"project {project!r}, run {name!r}, mode {mode}"
        self.run = wandb.init(project=project, name=name, dir=os.environ.get("WANDB_DIR") or str(out_dir),
                              config=config, mode=mode)  # fmt: skip

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, out_dir: Path, project: str, name: str, config: dict):
        if "trackio" in sys.modules:  # it read TRACKIO_DIR when it was imported, before this run
            print(f"train: --report-to trackio: trackio was imported before this run, so it logs to its own "
                  f"store ({os.environ.get('TRACKIO_DIR', 'its default directory')}), not {out_dir / 'trackio'}")  # fmt: skip
        os.environ.setdefault("TRACKIO_DIR", str(out_dir / "trackio"))  # read when trackio is imported
        import trackio

        self.t = trackio
        proj, run = default_names(out_dir)
        self.where = f"project {project or proj!r}, run {name or run!r}"
        # space_id is left to trackio: it reads the user's TRACKIO_SPACE_ID itself (local store without it)
        self.t.init(project=project or proj, name=name or run, config=config)

    def log(self, values: dict[str, float], step: int) -> None:
        self.t.log(values, step=step)

    def close(self) -> None:
        self.t.finish()


class _Mlflow:
    def __init__(self, out_dir: Path, project: str, name: str, config: dict):
        import mlflow

        self.m = mlflow
        # MLflow 3 refuses its file store ("maintenance mode") unless this is set; a user's own setting wins
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri()
        mlflow.set_tracking_uri(uri)  # the user's server or store when they set one
        proj, run = default_names(out_dir)
        experiment = _pick(project, "MLFLOW_EXPERIMENT_NAME", proj)
        self.where = f"experiment {experiment!r}, run {name or run!r}, tracking URI {uri}"
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=name or run)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def log(self, values: dict[str, float], step: int) -> None:
        self.m.log_metrics(values, step=step)

    def close(self) -> None:
        self.m.end_run()


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio, "mlflow": _Mlflow}


def open_trackers(
    names: list[str], out_dir: Path, config: dict[str, Any], project: str = "", run_name: str = ""
) -> list:
    """One open tracker per name (checked by `tracker_problems` before the run), in `project` as `run_name` (empty:
    the library's own variable, else :func:`default_names` of OUT); where each reports is said in a line. A
    library that is installed but fails to import or start (a missing dependency of its own) closes the ones
    already open and stops the run before its first step, naming the library and the cause."""
    opened: list = []
    for n in names:
        try:
            opened.append(_CLASSES[n](out_dir, project, run_name, config))
            if getattr(opened[-1], "where", ""):
                print(f"train: --report-to {n}: {opened[-1].where}", flush=True)
        except Exception as e:
            for t in opened:
                t.close()
            raise RuntimeError(f"--report-to {n}: {TRACKERS[n]} is installed but could not start "
                               f"({type(e).__name__}: {e}): repair it (pip install --force-reinstall "
                               f"{TRACKERS[n]}) or leave it out of --report-to") from e  # fmt: skip
    return opened


class MetricsLog:
    """Append records to OUT/metrics.jsonl (and to the trackers of --report-to); a no-op on ranks other than 0.

    A fresh run starts an empty file; a resumed one drops the records past its checkpoint (they are redone).
    `tensorboard` (the default) adds TensorBoard when it is installed and not named already.
    """

    def __init__(self, out_dir: Path, rank: int, resume: bool, start: int, tensorboard: bool,
                 report_to: str = "", config: dict | None = None, project: str = "", run_name: str = ""):  # fmt: skip
        self.path = out_dir / METRICS_FILE
        self.rank = rank
        self.trackers: list = []
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():  # drop records past the checkpoint: they will be redone
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
            atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))
        elif not resume:
            self.path.write_text("")
        names = tracker_names(report_to)
        if tensorboard and "tensorboard" not in names and importlib.util.find_spec("tensorboard") is not None:
            names.append("tensorboard")
        self.trackers = open_trackers(names, out_dir, config or {}, project, run_name)

    def has(self, split: str, step: int) -> bool:
        """Whether the log already holds the `split` record of `step` (a run killed after its final validation,
        before final/, resumes at its last step: that record is not written twice). False off rank 0."""
        try:
            lines = self.path.read_text().splitlines() if self.rank == 0 else []
        except OSError:
            return False
        for ln in lines:
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("split") == split and rec.get("step") == step:
                return True
        return False

    def __call__(self, rec: dict) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        values = scalars(rec)
        for t in self.trackers:
            t.log(values, rec["step"])

    def close(self) -> None:
        for t in self.trackers:
            t.close()

"""Nothing lost, nothing mixed (issue 28): export never deletes what it did not write; every command's
resume hint is the right one (Ctrl-C, SIGTERM, a full disk); SIGTERM stops a command as Ctrl-C does; a
rerun of a finished quickstart keeps the timings of the run that did the work."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import build_tiny_model, conversations, write_jsonl

from specdraft import cli
from specdraft.export import MARKER_FILE, export
from specdraft.model.checkpoint import latest_checkpoint, save_draft
from specdraft.model.draft import build_draft
from specdraft.targets import wrap_model

# ---------------------------------------------------------------------------------------------------------
# export: a new or empty directory, or a previous export; anything else refused, untouched
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_and_target(tmp_path_factory) -> tuple[Path, Path]:
    """(a saved draft dir, its target saved as an HF dir): what export reads, made in a second."""
    d = tmp_path_factory.mktemp("export-src")
    target = wrap_model(build_tiny_model("llama"), name="tiny")
    target.model.save_pretrained(d / "target")
    counts = np.arange(target.vocab_size)[::-1].copy()
    save_draft(build_draft(target, counts, [2, 4, 5], draft_vocab_size=64), d / "draft")
    return d / "draft", d / "target"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (directories by their files)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_export(draft_and_target, out: Path, **kw) -> int:
    draft, target = draft_and_target
    return export(str(kw.pop("checkpoint", draft)), str(out), target=str(target), check_vllm=False, **kw)


def test_export_refuses_a_directory_holding_a_user_file(tmp_path, draft_and_target):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ValueError) as e:
        run_export(draft_and_target, out)
    msg = str(e.value)
    assert f"refusing to write into {out}" in msg and "notes.txt" in msg and "\n" not in msg
    assert "choose a new or empty output directory, or remove it yourself" in msg
    assert snapshot(out) == {"notes.txt": b"my notes"}


@pytest.mark.parametrize("into", ["run", "parent of runs"])
def test_export_refuses_a_training_run_and_a_parent_of_runs(tmp_path, draft_and_target, into):
    """`specdraft export trcopy/final trcopy` (or the directory holding runs) used to delete the run."""
    runs = tmp_path / "runs"
    run = runs / "trcopy"
    final = run / "final"  # a run's final/ is a saved draft
    final.mkdir(parents=True)
    for f in draft_and_target[0].iterdir():
        (final / f.name).write_bytes(f.read_bytes())
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "train_state.pt").write_bytes(b"optimizer state")
    (run / "metrics.jsonl").write_text('{"step": 10}\n')
    before = snapshot(runs)
    out = run if into == "run" else runs
    with pytest.raises(ValueError, match=r"refusing to write into .*not a specdraft export"):
        run_export(draft_and_target, out, checkpoint=final)
    assert snapshot(runs) == before


def test_export_into_an_empty_directory_then_over_the_previous_export(tmp_path, draft_and_target):
    out = tmp_path / "export"
    out.mkdir()
    assert run_export(draft_and_target, out, format="speculators") == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER_FILE, "config.json", "model.safetensors"])
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["format"] == "speculators" and marker["source"] == str(draft_and_target[0])
    # a previous export is replaced, whole
    assert run_export(draft_and_target, out, format="eagle3") == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert json.loads((out / MARKER_FILE).read_text())["format"] == "eagle3"
    # an export from before the marker (config.json naming specdraft + the weights, nothing else) too
    (out / MARKER_FILE).unlink()
    assert run_export(draft_and_target, out, format="speculators") == 0
    assert "speculators_model_type" in json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary left beside it
    # a previous export the user added a file to is no longer only ours
    (out / "README.md").write_text("my model card")
    with pytest.raises(ValueError, match=r"README\.md"):
        run_export(draft_and_target, out)
    assert (out / "README.md").read_text() == "my model card"


def test_export_refuses_a_file_in_place_of_the_directory(tmp_path, draft_and_target):
    out = tmp_path / "out"
    out.write_text("a file")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        run_export(draft_and_target, out)
    assert out.read_text() == "a file"


# ---------------------------------------------------------------------------------------------------------
# the resume hint of each command, and SIGTERM as Ctrl-C
# ---------------------------------------------------------------------------------------------------------


def test_every_command_has_a_resume_hint_and_trains_says_resume(monkeypatch, capsys, tmp_path):
    """`specdraft train` refuses an existing output without --resume: "rerun the same command" was wrong."""
    import specdraft.train.loop as loop

    sigterm_before = signal.getsignal(signal.SIGTERM)

    def interrupted(shards, out_dir, cfg):
        raise KeyboardInterrupt

    def disk_full(shards, out_dir, cfg):
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "checkpoints"))

    argv = ["train", str(tmp_path / "shards"), str(tmp_path / "out")]
    for fn, rc, said in ((interrupted, 130, "interrupted; "), (disk_full, 2, "error: no space left")):
        monkeypatch.setattr(loop, "train_loop", fn)
        monkeypatch.setattr(loop, "refuse_early", lambda *a: None)  # no data here: the hint alone is tested
        assert cli.main(argv) == rc
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"specdraft train: {said}") and "\n" not in err
        assert "no checkpoint was written yet: rerun `specdraft train " in err and "--resume" not in err
    assert signal.getsignal(signal.SIGTERM) is sigterm_before  # the handler lives only while a command runs
    assert set(cli.RESUME_HINTS) == set(cli.COMMANDS)  # one hint per command
    assert err.endswith(f"rerun `specdraft {' '.join(argv)}` to start over")  # the exact command (issue 40)
    assert "without --fresh" in cli.RESUME_HINTS["quickstart"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_llama_dir) -> Path:
    """An extraction of 48 tiny conversations by the real prepare + extract on the tiny Llama."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("sigterm-data")
    src = write_jsonl(d / "c.jsonl", conversations(48, seed=1))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=128)
    return extract(str(ds), str(d / "shards"), target=str(tiny_llama_dir), samples_per_shard=16,
                   max_tokens_per_batch=512, skip_doctor=True, store_dtype="float32")  # fmt: skip


def test_sigterm_stops_train_like_ctrl_c_with_its_resume_hint(tmp_path, shards):
    """A real `specdraft train` process, sent SIGTERM once it has checkpointed: the one-line hint, exit 143,
    and a newest checkpoint that --resume continues from (it used to die silently)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "specdraft.cli", "train", str(shards), str(out), "--draft-vocab-size", "128",
           "--ttt-steps", "2", "--max-tokens", "512", "--max-length", "128", "--epochs", "100000",
           "--checkpoint-every", "2", "--val-fraction", "0", "--no-progress", "--no-tensorboard"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 240
        while latest_checkpoint(out) is None and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert latest_checkpoint(out) is not None, "no checkpoint within 240 s"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert (
        err.strip().splitlines()[-1]
        == f"specdraft train: terminated (SIGTERM); resume with `specdraft {' '.join(cmd[3:])} --resume`"
    )
    assert "Traceback" not in err
    from specdraft.model.checkpoint import load_draft

    load_draft(latest_checkpoint(out))  # the newest checkpoint is whole


# ---------------------------------------------------------------------------------------------------------
# quickstart: a rerun that skips finished stages keeps the timings of the run that did the work
# ---------------------------------------------------------------------------------------------------------


def test_a_quickstart_rerun_keeps_the_timings_of_the_runs_that_did_the_work(tmp_path, monkeypatch):
    """Stages stubbed (files as the real ones write them; train takes 0.2 s, then 0.3 s after an interrupt):
    the train time is the sum of the runs that trained, and a rerun that skips everything changes nothing."""
    import specdraft.capture.extract as X
    import specdraft.data.prepare as P
    import specdraft.data.regenerate as G
    import specdraft.eval.reference as R
    import specdraft.eval.report as ER
    import specdraft.export as E
    import specdraft.train.loop as L
    from specdraft import quickstart as Q

    root = tmp_path / "qs"
    calls: list[str] = []

    def write(path: Path, obj: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj))

    def regenerate(data, out, **kw):
        calls.append("regenerate")
        write(Path(out) / G.SETTINGS_FILE, {"done": True})
        return Path(out) / G.OUTPUT_FILE

    def prepare(data, out, **kw):
        calls.append("prepare")
        write(Path(out) / P.MANIFEST_FILE, {"num_samples": 4, "num_tokens": 40, "num_loss_tokens": 20})

    def extract(ds, out, **kw):
        calls.append("extract")
        write(
            Path(out) / "manifest-00000-of-00001.json", {"complete": True, "tokens_per_second_last_run": 9.0}
        )

    def train(hs, out, cfg):
        calls.append("train")
        if calls.count("train") == 1:
            time.sleep(0.2)
            raise KeyboardInterrupt  # the first run is stopped while training
        time.sleep(0.3)
        write(Path(out) / "final" / "config.json", {"train": {"steps": 3, "val": {}}})

    def evaluate_report(drafts, out, **kw):
        calls.append("eval")
        d = {"tau": 1.5, "acceptance_rate_per_position": [0.5], "speedup": 1.1, "tokens_per_s": 3.0,
             "lossless": {"checked": True, "ok": True}}  # fmt: skip
        report = {"drafts": {dn: d for dn in drafts}, "baseline": {"tokens_per_s": 2.0}}
        write(Path(out) / R.REPORT_FILE, report)
        return report

    def export(checkpoint, out, **kw):
        calls.append("export")
        write(Path(out) / "config.json", {})

    for mod, name, fn in ((G, "regenerate", regenerate), (P, "prepare", prepare), (X, "extract", extract),
                          (L, "train", train), (R, "evaluate_report", evaluate_report), (E, "export", export),
                          (Q, "_serve", lambda *a: None), (ER, "summary_lines", lambda r: [])):  # fmt: skip
        monkeypatch.setattr(mod, name, fn)

    with pytest.raises(KeyboardInterrupt):
        Q.quickstart(out=str(root), budget="tiny")
    assert Q.quickstart(out=str(root), budget="tiny") == 0
    first = json.loads((root / "summary.json").read_text())["seconds"]
    assert 0.5 <= first["train"] < 5 and first["total"] >= first["train"]
    del calls[:]
    assert Q.quickstart(out=str(root), budget="tiny") == 0  # everything done: skipped
    assert "train" not in calls and "eval" not in calls and "export" not in calls
    assert json.loads((root / "summary.json").read_text())["seconds"] == first

"""Nothing lost, round four (issue 49), DFlash's side: a command removes only what it wrote (a user's
directories under checkpoints/ survive pruning, resume and the Ctrl-C hint); a DFlash checkpoint and final/
become visible only whole (kill -9 at every write window, then resume: bit-identical weights, one validation
record per step); train_settings.json records what ran; --resume compares the settings as EAGLE-3's does and a
refused command writes nothing; state files are checked and named; block settings are checked before the
target loads. Tiny random Llama, hf backend."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import conversations, write_jsonl

from specdraft.model.dflash_files import load_dflash
from specdraft.train.block import setup as block_setup
from specdraft.train.block.run import train_dflash
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

CFG = TrainConfig(draft="dflash", draft_vocab_size=64, block_size=4, anchors=4, max_tokens=600, max_length=64,
                  epochs=1, max_steps=3, lr=3e-3, val_fraction=0.1, checkpoint_every=2, keep_checkpoints=1,
                  progress=False, tensorboard=False)  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_llama_dir) -> tuple[Path, Path]:
    """(a prepared dataset, its extraction at the default layers: EAGLE-3 and DFlash both train on it)."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("lost4")
    src = write_jsonl(d / "c.jsonl", conversations(24, seed=2))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=64)
    x = extract(str(ds), str(d / "x"), target=str(tiny_llama_dir), samples_per_shard=12, skip_doctor=True, store_dtype="float32")  # fmt: skip
    return ds, x


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def tree(d: Path) -> dict[str, str]:
    """Every file under `d` (relative path -> sha256 of its content), the directory lock's excepted."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".specdraft.lock"}  # fmt: skip


def same_weights(a: Path, b: Path) -> None:
    x, y = load_dflash(a).state_dict(), load_dflash(b).state_dict()
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


def vals(out: Path) -> list[int]:
    return [
        r["step"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "val"
    ]


# --- 4: kill -9 at every write window of a checkpoint and of final/, then resume -------------------------------


@pytest.fixture(scope="module")
def killed(data, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(an uninterrupted run's OUT, {window: OUT as a kill -9 at that window leaves it}): every window of
    checkpoint step_2, of step_3 (with the pruning of step_2) and of final/ is copied as the run passes it (a
    file being written there is cut in half), its temporaries renamed to a dead process's."""
    root = tmp_path_factory.mktemp("killed")
    out, snaps, dead = root / "run", {}, dead_pid()
    real = block_setup._window

    def snapshot(window: str, path: Path) -> None:
        name = f"{len(snaps):02d}-{path.name.split('.specdraft')[0].lstrip('.')}-{window}"
        snap = root / name
        shutil.copytree(out, snap)
        for p in sorted(snap.rglob(f"*specdraft-{os.getpid()}*"), key=lambda p: -len(p.parts)):
            p.rename(p.with_name(p.name.replace(f"specdraft-{os.getpid()}", f"specdraft-{dead}")))
        cut = {"weights": "model.safetensors", "filled": "optimizer.pt"}.get(window)
        for f in snap.rglob(cut) if cut else ():
            if f".specdraft-{dead}" in str(f.parent):  # the file being written when killed: half of it
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        snaps[name] = snap

    block_setup._window = snapshot
    try:
        train(str(data[1]), str(out), CFG)
    finally:
        block_setup._window = real
    return out, snaps


WINDOWS = ["00-step_2-created", "01-step_2-weights", "02-step_2-filled", "03-step_2-renamed", "04-step_2-written",
           "05-step_3-created", "06-step_3-weights", "07-step_3-filled", "08-step_3-renamed", "09-step_3-written",
           "10-step_2-pruned", "11-final-created", "12-final-filled", "13-final-renamed"]  # fmt: skip


def test_the_windows_are_every_write_of_a_checkpoint_and_of_final(killed):
    out, snaps = killed
    assert list(snaps) == WINDOWS
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3"]  # pruned: step_2


@pytest.mark.parametrize("window", WINDOWS)
def test_kill_9_at_any_write_window_then_resume_gives_the_same_draft(killed, window):
    """What the tool says after the kill (the resume hint), run: the same final weights bit for bit, one
    validation record per step, no temporary left, train_settings.json in OUT and final/."""
    from specdraft.train.loop import resume_hint

    out, snaps = killed
    snap = snaps[window]
    hint = resume_hint(["train", "x", str(snap), "--draft", "dflash"], str(snap))
    resume = hint.startswith("resume with")
    assert resume == bool(block_setup.complete_checkpoints(snap)), hint
    if not (snap / "final" / "config.json").exists():
        assert not (snap / "final").exists()  # never a partial final/
    train(str(_shards(out)), str(snap), replace(CFG, resume=resume))
    same_weights(out / "final", snap / "final")
    assert vals(snap) == vals(out) == [0, 3]
    assert not [p for p in snap.rglob("*") if ".specdraft-" in p.name and p.suffix == ".tmp"]
    assert json.loads((snap / "final" / "train_settings.json").read_text())["settings"]["block_size"] == 4


def _shards(out: Path) -> Path:
    return Path(json.loads((out / "train_settings.json").read_text())["settings"]["shards"])


@pytest.fixture(scope="module")
def stopped(data, tmp_path_factory) -> Path:
    """A run stopped after its checkpoint of step 2 (of 3)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    train_dflash(str(data[1]), out, CFG, _stop_at=2)
    return out


def test_a_damaged_optimizer_weights_or_config_file_is_named_with_the_fix(data, stopped, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    ck = run / "checkpoints" / "step_2"
    opt = ck / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:100])
    with pytest.raises(ValueError) as e:
        train_dflash(str(data[1]), run, replace(CFG, resume=True))
    assert str(e.value).startswith(f"{opt} cannot be read (")
    assert str(e.value).endswith(f": delete {ck} to resume from the checkpoint before it (or start in a new OUT "
                                 "directory)")  # fmt: skip
    w = ck / "model.safetensors"
    w.write_bytes(b"\xff" * 8 + w.read_bytes()[8:])  # a corrupted header
    with pytest.raises(
        ValueError, match=rf"^{w} cannot be read \(SafetensorError: .*\): delete {ck} to resume"
    ):
        train_dflash(str(data[1]), run, replace(CFG, resume=True))
    (ck / "config.json").write_text("")
    with pytest.raises(ValueError) as e:
        load_dflash(ck)
    assert str(e.value).startswith(f"{ck / 'config.json'} cannot be read (not JSON: Expecting value")


def test_an_unfinished_dflash_run_is_named_by_export_and_resumed_by_the_hint(stopped, tmp_path):
    """A DFlash OUT without final/ is what it is: export names its newest checkpoint to pass (not "neither a
    saved draft nor a train output"), and the stop's hint says --resume."""
    from specdraft.export import export
    from specdraft.model.checkpoint import draft_dir
    from specdraft.train.loop import resume_hint

    newest = stopped / "checkpoints" / "step_2"
    assert draft_dir(stopped) == newest
    with pytest.raises(ValueError, match=f"has no final/.*its newest checkpoint is {newest}"):
        export(str(stopped), str(tmp_path / "exp"))
    assert not (tmp_path / "exp").exists()
    assert "--resume" in resume_hint(["train", "hs", str(stopped), "--draft", "dflash"], str(stopped))


def test_resume_with_other_settings_is_refused_and_writes_nothing(data, stopped, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    before = tree(run)
    with pytest.raises(ValueError) as e:
        train(str(data[1]), str(run), replace(CFG, resume=True, lr=0.005, anchors=8, seed=5))
    assert (
        "was written with other settings (lr 0.003 there, 0.005 now, seed 0 there, 5 now, anchors 4 there, "
        "8 now): resume with the settings it was written with (--lr 0.003 --seed 0 --anchors 4)"
        in str(e.value)
    )
    assert tree(run) == before
    train(str(data[1]), str(run), replace(CFG, resume=True, max_steps=2))  # --max-steps is free to change


# --- 2: a user's directories under checkpoints/ -------------------------------------------------------------


def user_dirs(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "README").write_text("mine")


def test_users_directories_under_checkpoints_survive_dflash_pruning_resume_and_the_hint(data, tmp_path):
    from specdraft.train.loop import resume_hint

    out = tmp_path / "run"
    mine = ["step_best", "step_old", "step_2_mybackup", "step_02", "step_9"]  # step_9: a user's, no marker
    user_dirs(out / "checkpoints", mine)
    argv = ["train", str(data[1]), str(out), "--draft", "dflash"]
    assert resume_hint(argv, str(out)).startswith("no checkpoint was written yet")  # none of them is one
    with pytest.raises(ValueError, match="it holds files train did not write"):  # a user's OUT (issue 60)
        train(str(data[1]), str(out), CFG)
    shutil.rmtree(out)
    train_dflash(str(data[1]), out, CFG, _stop_at=1)  # a run's OUT: the user's directories beside its own
    shutil.rmtree(out / "checkpoints" / "step_1")
    user_dirs(out / "checkpoints", mine)
    with pytest.raises(ValueError, match="--resume: no checkpoint under"):  # step_9 is named like one, is not
        train(str(data[1]), str(out), replace(CFG, resume=True))
    train(str(data[1]), str(out), CFG)  # checkpoints 2 and 3, keep 1: step_2 pruned
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted([*mine, "step_3"])
    assert all((out / "checkpoints" / n / "README").read_text() == "mine" for n in mine)
    assert resume_hint(argv, str(out)).endswith("--resume`")
    train(str(data[1]), str(out), replace(CFG, resume=True))  # the finished run, resumed: final/ again
    assert block_setup.dflash_dir(str(out)) == out / "final"
    shutil.rmtree(out / "final")
    assert block_setup.dflash_dir(str(out)) == out / "checkpoints" / "step_3"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted([*mine, "step_3"])


def test_a_partial_checkpoint_of_an_older_version_is_skipped_and_only_its_own_files_replaced(
    data, killed, tmp_path
):
    """A step_N without config.json (kill -9 under the older writer): resume from the checkpoint before it."""
    out, c = tmp_path / "run", replace(CFG, keep_checkpoints=5, checkpoint_every=1)
    train_dflash(str(data[1]), out, c, _stop_at=2)
    ck = out / "checkpoints" / "step_2"
    (ck / "config.json").unlink()
    (ck / "optimizer.pt").write_bytes(b"")
    train(str(data[1]), str(out), replace(c, resume=True))
    same_weights(killed[0] / "final", out / "final")  # the same run as one not stopped
    (out / "checkpoints" / "step_3" / "config.json").unlink()
    (out / "checkpoints" / "step_3" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"step_3 is in the way of the checkpoint of step 3 and holds files "
                                         r"specdraft did not write \(notes.txt\): move it out of"):  # fmt: skip
        train(str(data[1]), str(out), replace(c, resume=True))
    assert (out / "checkpoints" / "step_3" / "notes.txt").read_text() == "mine"


def test_eagle3_pruning_keeps_a_users_copy_of_a_checkpoint(data, tmp_path):
    ecfg = TrainConfig(draft_vocab_size=64, ttt_steps=2, epochs=1, max_steps=2, max_tokens=512, checkpoint_every=1,
                       keep_checkpoints=1, val_fraction=0.0, val_every=0, progress=False, prefetch=False,
                       tensorboard=False)  # fmt: skip
    out = tmp_path / "run"
    train(str(data[1]), str(out), replace(ecfg, max_steps=1))
    root = out / "checkpoints"
    shutil.copytree(root / "step_00000001", root / "step_00000001_mybackup")
    (root / "step_00000001_mybackup" / "README").write_text("mine")
    user_dirs(root, ["step_best"])
    train(str(data[1]), str(out), replace(ecfg, resume=True))
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_00000001_mybackup", "step_00000002", "step_best"], names
    assert (root / "step_00000001_mybackup" / "README").read_text() == "mine"


def test_eagle3_killed_after_its_final_validation_resumes_with_one_record_of_it(data, tmp_path):
    """EAGLE-3 as DFlash: a run killed between its final validation and final/ (its last checkpoint and that
    record written) resumes at its last step and writes final/, without a second validation record."""
    ecfg = TrainConfig(draft_vocab_size=64, ttt_steps=2, epochs=1, max_steps=2, max_tokens=512, checkpoint_every=1,
                       val_fraction=0.2, val_every=0, progress=False, prefetch=False, tensorboard=False)  # fmt: skip
    out = tmp_path / "run"
    train(str(data[1]), str(out), ecfg)
    assert vals(out) == [0, 2]
    shutil.rmtree(out / "final")  # what a kill -9 before final/'s rename leaves
    train(str(data[1]), str(out), replace(ecfg, resume=True))
    assert vals(out) == [0, 2] and (out / "final" / "config.json").is_file()


# --- 5 and 6: the settings file records what ran; --resume compares them; a refusal writes nothing -----------


def test_the_settings_file_records_the_recipe_and_resume_compares_them(data, tmp_path, capsys):
    from specdraft.cli import main

    out = tmp_path / "run"
    argv = ["train", str(data[1]), str(out), "--draft", "dflash", "--max-steps", "1", "--draft-vocab-size", "64",
            "--max-length", "64", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    ran = json.loads((out / "train_settings.json").read_text())["settings"]
    want = {"lr": 1e-3, "block_size": 4, "anchors": 16, "max_tokens": 512, "schedule": "constant"}
    assert {k: ran[k] for k in want} == want
    assert json.loads((out / "final" / "train_settings.json").read_text())["settings"] == ran
    assert main([*argv, "--resume"]) == 0  # the finished run resumes (not refused as another block size)
    again = tmp_path / "again"
    assert main(["train", str(data[1]), str(again), "--config", str(out / "train_settings.json")]) == 0
    assert load_dflash(again / "final").cfg.block_size == 4
    same_weights(out / "final", again / "final")

    before = tree(out)
    capsys.readouterr()
    assert main([*argv, "--resume", "--lr", "0.005", "--anchors", "8", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "was written with other settings (" in err and "lr 0.001 there, 0.005 now" in err, err
    assert "anchors 16 there, 8 now" in err and "seed 0 there, 5 now" in err
    fix = err.split("resume with the settings it was written with (")[1].split(")")[0]
    assert sorted(fix.split(" --")) == sorted(["--lr 0.001", "anchors 16", "seed 0"]), fix
    assert tree(out) == before  # the refused command wrote nothing
    with pytest.raises(ValueError, match="lr 0.001 there, 0.005 now"):
        train_dflash(str(data[1]), out, replace(CFG, **{**want, "lr": 0.005}, max_steps=2, resume=True))
    assert tree(out) == before


# --- 7: state files checked and named --------------------------------------------------------------------------


def test_a_sidecar_or_dataset_manifest_without_its_keys_is_named_with_the_fix(data, tmp_path, tiny_llama_dir):
    from specdraft.capture.extract import extract
    from specdraft.data.store import ShardSet, verify

    x = tmp_path / "x"
    shutil.copytree(data[1], x)
    side = sorted(x.glob("shard-*.json"))[0]
    side.write_text("{}")
    problems = verify([str(x)])
    assert problems and problems[0].startswith(f"{side.name}: sidecar unreadable (it lacks 'extraction', "), (
        problems
    )
    with pytest.raises(ValueError) as e:
        ShardSet.open(x)
    assert str(e.value).startswith(f"{side}: sidecar unreadable (it lacks ")
    assert f"delete {side.with_suffix('.safetensors')} and {side}, then rerun `specdraft extract`" in str(
        e.value
    )
    with pytest.raises(ValueError, match="sidecar unreadable"):
        train(str(x), str(tmp_path / "t"), CFG)

    ds = tmp_path / "ds"
    shutil.copytree(data[0], ds)
    (ds / "manifest.json").write_text("{}")
    with pytest.raises(ValueError) as e:
        extract(str(ds), str(tmp_path / "x2"), skip_doctor=True)
    assert str(e.value) == (f"{ds / 'manifest.json'} cannot be read (it lacks 'target', the model the data was "
                            f"prepared for): rerun `specdraft prepare` into {ds}")  # fmt: skip
    assert not (tmp_path / "x2").exists()


# --- 9: block settings checked before the target loads ----------------------------------------------------------


def test_block_settings_are_checked_before_the_target_loads(data, tmp_path, monkeypatch):
    import specdraft.model.frozen as frozen

    monkeypatch.setattr(
        frozen, "load_frozen", lambda *a, **k: pytest.fail("the target loaded before the check")
    )
    out = tmp_path / "run"
    for kw, said in (
        ({"block_size": 300, "max_length": 256}, "--block-size 300 must be below --max-length 256: "),
        ({"block_size": 100000, "max_length": 200000}, "--block-size 100000 is longer than any sample can fill: "
                                                       "the longest sample used has "),
        ({"mask_token_id": -5}, "--mask-token-id must be a token id of the target (0 .. vocabulary - 1), or -1 for "
                                "its last row, not -5"),
        ({"mask_token_id": 10**6}, "--mask-token-id 1000000 is outside the target's vocabulary of "),
    ):  # fmt: skip
        with pytest.raises(ValueError) as e:
            train(str(data[1]), str(out), replace(CFG, **kw))
        assert said in str(e.value)
        assert not [p for p in out.rglob("*") if p.name != ".specdraft.lock"]
    from specdraft.train.block.setup import BlockData, data_problems

    huge = BlockData(None, [1], {0: 300_000}, [0], [], "t", "", 0, 1000)
    got = data_problems(replace(CFG, block_size=100_000, max_length=400_000, anchors=64), huge, "cpu")
    assert (
        len(got) == 1
        and "--block-size 100000 with --anchors 64: one chunk of 64 blocks needs at least " in got[0]
    )


# --- 3 (prepare's side) and 10: prepare writes under the directory's lock, a killed one's temporaries go -------


def test_prepare_writes_under_the_lock_and_removes_a_killed_prepares_temporaries(tmp_path, tiny_llama_dir):
    from specdraft.data.prepare import prepare
    from specdraft.fileio import DirectoryInUse, DirLock

    src = write_jsonl(tmp_path / "c.jsonl", conversations(4, seed=1))
    ds = tmp_path / "ds"
    with DirLock(ds, "dataset"), pytest.raises(DirectoryInUse, match=f"{ds} is in use by another specdraft"):
        prepare(str(src), str(ds), target=str(tiny_llama_dir), max_length=64)  # another writer holds it
    assert [p.name for p in ds.iterdir()] == [".specdraft.lock"]
    left = ds / f".data.parquet.specdraft-{dead_pid()}.tmp"  # a prepare killed mid-write
    left.write_bytes(b"partial")
    (ds / ".mine.tmp").write_text("mine")
    prepare(str(src), str(ds), target=str(tiny_llama_dir), max_length=64)
    assert not left.exists() and (ds / ".mine.tmp").read_text() == "mine"
    assert not [p for p in ds.iterdir() if ".specdraft-" in p.name]

"""fileio: atomic writes with private temporaries, and the one-writer lock on an output directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from specdraft import cli, fileio
from specdraft.fileio import LOCK_FILE, DirectoryInUse, DirLock, atomic_write_text

_HOLD = """
import sys, time
from specdraft.fileio import DirLock
with DirLock(sys.argv[1], "test"):
    print("locked", flush=True)
    time.sleep(120)
"""


def _holder(directory) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_temporaries_are_private_to_the_writer(tmp_path):
    target = tmp_path / "manifest.json"
    assert fileio.tmp_path(target).name == f".manifest.json.specdraft-{os.getpid()}.tmp"
    atomic_write_text(target, "x")
    assert target.read_text() == "x" and not list(tmp_path.glob(".*.tmp"))


def test_a_second_process_is_refused_at_once_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "out"
    p = _holder(out)
    try:
        with pytest.raises(DirectoryInUse, match=rf"in use by another specdraft process \(pid {p.pid}"):
            with DirLock(out, "extraction"):
                pass
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (out / LOCK_FILE).exists()  # the file stays behind, the lock died with its process
    with DirLock(out, "extraction"):
        pass


def test_an_output_path_that_is_a_file_is_refused_in_one_line(tmp_path):
    f = tmp_path / "runs.txt"
    f.write_text("notes")
    for out in (f, f / "hs"):
        with pytest.raises(ValueError) as e:
            with DirLock(out, "extraction"):
                pass
        under = "" if out == f else f"{out}: "  # the user's path, and the file in its way
        assert str(e.value) == (
            f"{under}{f} is a file, not a directory: choose a directory path for this extraction's output"
        )
    assert f.read_text() == "notes"


def test_taking_the_lock_cleans_leftovers_of_killed_writers(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a specdraft writer that died: its pid is no longer alive
    (tmp_path / f".shard-00000-00001.safetensors.specdraft-{p.pid}.tmp").write_bytes(b"partial")
    (tmp_path / f".step_00000020.specdraft-{p.pid}.tmp").mkdir()
    (tmp_path / "shard-00000-00000.safetensors").write_bytes(b"whole")
    with DirLock(tmp_path, "extraction"):
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "shard-00000-00000.safetensors"]


def test_cli_reports_ctrl_c_and_a_full_disk_in_one_line(monkeypatch, capsys):
    def interrupted(paths: list[str], quick: bool = False) -> int:
        raise KeyboardInterrupt

    def full(paths: list[str], quick: bool = False) -> int:
        raise OSError(28, "No space left on device", "/runs/hs/shard-00000-00003.safetensors")

    for fn, rc, msg in (
        (
            interrupted,
            130,
            "specdraft verify: interrupted; rerun the same command (verify only reads: nothing to resume)",
        ),
        (full, 2, "no space left on the device writing /runs/hs/shard-00000-00003.safetensors"),
    ):
        monkeypatch.setitem(cli.COMMANDS, "verify", "tests_fake:fn")
        monkeypatch.setattr(cli, "import_module", lambda mod, fn=fn: type("M", (), {"fn": staticmethod(fn)}))
        assert cli.main(["verify", "x"]) == rc
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err


def test_weights_fingerprint_sees_other_weights_not_other_names(tmp_path):
    from safetensors.torch import save_file

    from specdraft.fileio import weights_fingerprint

    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    torch.manual_seed(0)
    w = {"layers.0.weight": torch.randn(512, 512), "lm_head.weight": torch.randn(1000, 64)}
    save_file(w, str(a / "model.safetensors"))
    save_file(w, str(b / "model.safetensors"))
    (b / "config.json").write_text("{}")  # not a weight file
    save_file({**w, "lm_head.weight": torch.randn(1000, 64)}, str(c / "model.safetensors"))
    assert weights_fingerprint(a) == weights_fingerprint(b) != weights_fingerprint(c)
    with pytest.raises(FileNotFoundError, match="no weight files"):
        weights_fingerprint(tmp_path)


def test_cli_names_a_full_disk_reported_by_a_library_and_train_checks_space_first(
    monkeypatch, capsys, tmp_path
):
    from specdraft.train import loop

    class SafetensorError(Exception):  # safetensors reports ENOSPC as its own exception type
        pass

    def full(paths: list[str], quick: bool = False) -> int:
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, message: "No space left on device" })'
        )

    monkeypatch.setitem(cli.COMMANDS, "verify", "tests_fake:fn")
    monkeypatch.setattr(cli, "import_module", lambda mod: type("M", (), {"fn": staticmethod(full)}))
    assert cli.main(["verify", "x"]) == 2
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "Traceback" not in err
    with pytest.raises(OSError, match=r"only 1 MiB are free: free space, choose another OUT directory"):
        monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
        loop._check_disk(tmp_path, 10_000_000, keep=2)
    monkeypatch.undo()
    loop._check_disk(tmp_path, 1000, keep=2)  # fits

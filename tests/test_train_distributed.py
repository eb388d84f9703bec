"""torchrun on CPU (gloo): 2 processes give the loss trajectory and weights of 1 process with the same global batch."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from specdraft.model.checkpoint import load_draft

BASE = dict(draft_vocab_size=128, ttt_steps=3, max_tokens=1024, max_length=128, epochs=1, max_steps=5, lr=3e-3,
            warmup_ratio=0.1, val_fraction=0.1, checkpoint_every=2, progress=False, tensorboard=False)  # fmt: skip
SCRIPT = f"BASE = {BASE!r}\n" + textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from specdraft.train.config import TrainConfig
    from specdraft.train.loop import train

    shards, out, fsdp, over = sys.argv[1], sys.argv[2], sys.argv[3] == "1", json.loads(sys.argv[4])
    cfg = TrainConfig(**{**BASE, "fsdp": fsdp, **over})
    train(shards, out, cfg)
    # the run left the process group it joined: a process exiting with gloo's threads running may abort (SIGABRT)
    assert not dist.is_initialized(), "train left its process group joined"
    # and freed its model first: FSDP2's cyclic state left to the interpreter's teardown aborted rank 1 in CI
    import gc
    assert not [o for o in gc.get_objects() if type(o).__name__ == "FSDPParamGroup"], "FSDP state outlived train"
    """
)


def run(tmp_path: Path, shards: Path, out: Path, nproc: int, fsdp: bool = False, **over) -> str:
    """torchrun SCRIPT on `nproc` CPU processes with BASE's settings and `over`; its stdout."""
    script = tmp_path / "run_train.py"
    script.write_text(SCRIPT)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {
        **os.environ,
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           str(shards), str(out), "1" if fsdp else "0", json.dumps(over)]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def records(out: Path, split: str) -> list[dict]:
    return [
        r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split
    ]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_llama_dir):
    from conftest import conversations, write_jsonl

    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("dist-data")
    src = write_jsonl(d / "c.jsonl", conversations(48, seed=1))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=128)
    return extract(
        str(ds), str(d / "shards"), target=str(tiny_llama_dir), samples_per_shard=16, skip_doctor=True
    )


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_processes_match_one(tmp_path, shards, fsdp):
    one, two = tmp_path / "one", tmp_path / "two"
    run(tmp_path, shards, one, 1)
    run(tmp_path, shards, two, 2, fsdp=fsdp)
    a, b = records(one, "train"), records(two, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # the same global batches
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-4, abs=1e-6)
    for x, y in zip(a, b):
        assert y["acc"] == pytest.approx(x["acc"], abs=1e-6)
    va, vb = records(one, "val"), records(two, "val")
    assert [r["loss"] for r in vb] == pytest.approx([r["loss"] for r in va], rel=1e-4)
    wa, wb = load_draft(one / "final").state_dict(), load_draft(two / "final").state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=2e-5, rtol=1e-4, msg=k)
    # only rank 0 wrote: one metrics file, one final draft, one set of checkpoints
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == [
        "latest",
        "step_00000004",
        "step_00000005",
    ]


def test_one_validation_sample_is_validated_by_two_fsdp_ranks(tmp_path, shards):
    """One held-out sample cannot give each of 2 ranks a row: the rank without one runs a zero-weight
    stand-in (FSDP gathers weights in every forward), and the result is the one-process validation."""
    from specdraft.train.config import TrainConfig
    from specdraft.train.loop import train

    over = dict(val_fraction=0.01, max_steps=2)  # 48 samples: 1 held out
    one, two = tmp_path / "one", tmp_path / "two"
    train(str(shards), str(one), TrainConfig(**{**BASE, **over}))
    stdout = run(tmp_path, shards, two, 2, fsdp=True, **over)
    assert "47 train / 1 val samples" in stdout
    va, vb = records(one, "val"), records(two, "val")
    assert [r["step"] for r in vb] == [r["step"] for r in va] == [0, 2]
    assert [r["tokens"] for r in vb] == [r["tokens"] for r in va] and va[0]["tokens"] > 0
    assert [r["loss"] for r in vb] == pytest.approx([r["loss"] for r in va], rel=1e-4)
    for x, y in zip(va, vb):
        assert y["acc"] == pytest.approx(x["acc"], abs=1e-6)
    val = json.loads((two / "final" / "config.json").read_text())["train"]["val"]
    assert val is not None and val["loss"] == pytest.approx(vb[-1]["loss"])


def _env() -> dict:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {
        **os.environ,
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }


def _torchrun(words: list[str], **kw) -> subprocess.CompletedProcess:
    """A README torchrun line (`torchrun ...`, its words after `torchrun`) on CPU: standalone rendezvous."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, **kw)


CLI_SMALL = ["--draft-vocab-size", "128", "--ttt-steps", "3", "--max-tokens", "1024", "--max-length", "128",
             "--no-progress", "--no-tensorboard"]  # fmt: skip


def ctrl_c_resume_line(cmd: list[str], out: Path, env: dict, cwd: Path | None = None) -> tuple[str, str]:
    """Start the torchrun `cmd` (training into `out`), press Ctrl-C (SIGINT to its process group, as a terminal
    does) once its step-2 checkpoint is written; (the one line that says how to resume, checked said once; its
    stdout)."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    deadline = time.time() + 600
    while (
        not (out / "checkpoints" / "step_00000002").is_dir() and p.poll() is None and time.time() < deadline
    ):
        time.sleep(0.2)
    assert p.poll() is None, p.communicate()
    os.killpg(p.pid, signal.SIGINT)  # Ctrl-C
    stdout, stderr = p.communicate(timeout=120)
    said = [ln for ln in stderr.splitlines() if "resume with `" in ln]
    assert len(said) == 1, stderr[-5000:]
    return said[0].split("resume with `", 1)[1].split("`", 1)[0], stdout


def test_ctrl_c_under_torchrun_says_once_the_torchrun_line_that_resumes_it(tmp_path, shards):
    """Issue 61 item 1: Ctrl-C stops every rank; rank 0 alone prints the line that resumes, the torchrun line the
    run started with, and that line, run as printed, finishes the run."""
    out = tmp_path / "run"
    args = ["train", str(shards), str(out), *CLI_SMALL, "--checkpoint-every", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "specdraft.cli", *args]  # fmt: skip
    line, _ = ctrl_c_resume_line(cmd, out, _env())
    assert line.startswith("torchrun --nproc_per_node 2 -m specdraft.cli train ") and line.endswith(
        " --resume"
    )
    r = _torchrun(shlex.split(line)[1:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert r.stdout.count("train: resuming from ") == 1  # said by rank 0
    total = int(r.stdout.split("train: resuming from ", 1)[1].split("\n")[0].split("/")[-1])
    assert total > 2 and json.loads((out / "final" / "config.json").read_text())["train"]["steps"] == total


def test_print_config_under_torchrun_is_one_valid_config_and_a_refusal_is_one_line(tmp_path, shards):
    """Issue 61 items 2 and 4: --print-config under torchrun prints one settings file (rank 0's), a valid --config;
    a refusal (--optimizer muon --fsdp) is said once, and torchrun's failure report names it as the root cause."""
    base = [
        "--nproc_per_node",
        "2",
        "-m",
        "specdraft.cli",
        "train",
        str(shards),
        str(tmp_path / "o"),
        *CLI_SMALL,
    ]
    r = _torchrun([*base, "--print-config"])
    assert r.returncode == 0, r.stderr[-5000:]
    doc = json.loads(r.stdout)  # one JSON document, not one per rank
    (tmp_path / "c.json").write_text(r.stdout)
    assert doc["settings"]["max_tokens"] == 1024 and doc["from"]["max_tokens"] == "command line"
    r = _torchrun([*base, "--optimizer", "muon", "--fsdp"])
    assert r.returncode != 0
    refusal = "--optimizer muon with --fsdp is not supported"
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("specdraft train: error:")]
    assert len(said) == 1 and refusal in said[0], r.stderr[-5000:]
    assert (
        "To enable traceback see" not in r.stderr and r.stderr.count(refusal) == 3
    )  # the line, and each rank's in torchrun's report

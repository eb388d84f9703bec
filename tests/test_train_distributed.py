"""torchrun on CPU (gloo): 2 processes give the loss trajectory and weights of 1 process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
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

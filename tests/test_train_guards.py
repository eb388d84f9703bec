"""train refuses what would silently go wrong: another target's weights, a second writer, corrupt shards;
and its checkpoints hold only what training changes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import conversations, write_jsonl
from safetensors import safe_open

from specdraft.capture.extract import extract
from specdraft.data.prepare import prepare
from specdraft.fileio import DirectoryInUse
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

CFG = TrainConfig(draft_vocab_size=64, ttt_steps=2, epochs=1, max_steps=2, max_tokens=512, checkpoint_every=1,
                  val_fraction=0.0, val_every=0, progress=False, prefetch=False)  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("guards")
    ds = prepare(str(write_jsonl(d / "c.jsonl", conversations(12, seed=4))), str(d / "ds"),
                 target=str(tiny_llama_dir), max_length=96)  # fmt: skip
    return extract(str(ds), str(d / "hs"), target=str(tiny_llama_dir), samples_per_shard=4, skip_doctor=True)


def test_a_target_with_the_same_config_but_other_weights_is_refused(shards, tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    w = load_file(str(other / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] + 0.5  # same config.json, another teacher head
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match="weights fingerprint .* is not the one the shards were extracted from"
    ):
        train(str(shards), str(tmp_path / "out"), replace(CFG, target=str(other)))


_HOLD = """
import sys, time
from specdraft.fileio import DirLock
with DirLock(sys.argv[1], "training run"):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_second_training_run_on_one_directory_fails_at_once(shards, tmp_path):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryInUse, match=rf"pid {p.pid}"):
            train(str(shards), str(out), CFG)
        assert not (out / "checkpoints").exists()
    finally:
        p.kill()
        p.wait()


def test_checkpoints_reference_the_frozen_embedding_and_resume_from_it(shards, tmp_path):
    out = train(str(shards), str(tmp_path / "a"), CFG)
    ck = sorted((tmp_path / "a" / "checkpoints").glob("step_*"))[-1]
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" not in names and "fc.weight" in names
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the finished draft stands alone
        assert "embed_tokens.weight" in set(f.keys())
    more = train(str(shards), str(tmp_path / "a"), replace(CFG, max_steps=3, resume=True))
    with safe_open(str(more / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("embed_tokens.weight")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        torch.testing.assert_close(emb, f.get_tensor("embed_tokens.weight"), rtol=0, atol=0)

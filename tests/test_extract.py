"""extract: shards equal transformers' own hidden states of each sample run alone, exact resume after
SIGKILL, scale-out, verify, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import conversations, write_jsonl

from specdraft.capture.extract import extract
from specdraft.data.batching import token_batches
from specdraft.data.prepare import prepare
from specdraft.data.store import ShardSet, verify


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("ds")
    src = write_jsonl(d / "c.jsonl", conversations(60))
    return prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=256)


def load_all(path) -> dict:
    ss = ShardSet.open(path)
    return {s: ss.load(s) for s in ss.sample_ids()}


def hf_hidden_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """The oracle: transformers' own `output_hidden_states` of one sample run ALONE (no padding, no batch).

    hidden_states[k] is the input of decoder layer k for k < L; our final id L is the last layer's output
    BEFORE the final norm, which HF's hidden_states[L] is not (it is after the norm), so that one is taken
    by a forward hook on the last decoder layer. Returns (T, len(layer_ids), H).
    """
    L = model.config.num_hidden_layers
    last = {}

    def hook(mod, args, out):
        last["out"] = out[0] if isinstance(out, tuple) else out

    handle = model.model.layers[L - 1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    assert len(hs) == L + 1
    with torch.no_grad():  # the hook saw what HF then normalises: the oracle's own convention check
        torch.testing.assert_close(model.model.norm(last["out"]), hs[L], atol=1e-5, rtol=1e-4)
    return torch.stack([hs[k][0] if k < L else last["out"][0] for k in layer_ids], dim=1)


def test_extract_matches_transformers_hidden_states_and_verifies(
    tmp_path, dataset, tiny_llama_dir, one_thread
):
    from transformers import AutoModelForCausalLM

    from specdraft.data.prepare import load_dataset

    out = extract(str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir), samples_per_shard=16,
                  max_tokens_per_batch=512)  # fmt: skip
    assert verify([str(out)]) == []
    ss = ShardSet.open(out)
    man = ss.manifest
    assert man["layer_ids"] == [2, 4, 5, 8]  # (2, L//2, L-3) + final, L = 8
    ds = load_dataset(dataset)
    assert ss.sample_ids() == list(range(len(ds)))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for sid in range(len(ds)):
        s = ss.load(sid)
        assert s["input_ids"].tolist() == ds.input_ids[sid] and s["loss_mask"].tolist() == ds.loss_mask[sid]
        ref = hf_hidden_states(model, ds.input_ids[sid], man["layer_ids"])
        torch.testing.assert_close(
            s["hidden"], ref, atol=1e-5, rtol=1e-4, msg=lambda m, sid=sid: f"{sid}: {m}"
        )
    # a second run finds everything done
    assert extract(str(dataset), str(out), target=str(tiny_llama_dir), samples_per_shard=16) == out


def test_layers_override_and_too_shallow(tmp_path, dataset, tiny_llama_dir):
    out = extract(
        str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir), layers=[1, 3, 4], max_samples=4
    )
    assert ShardSet.open(out).manifest["layer_ids"] == [1, 3, 4, 8]
    with pytest.raises(ValueError, match="in \\[0, 7\\]"):
        extract(
            str(dataset), str(tmp_path / "y"), target=str(tiny_llama_dir), layers=[1, 3, 9], max_samples=4
        )


def test_resume_after_sigkill_is_identical(tmp_path, tiny_llama_dir):
    d = tmp_path / "big"
    d.mkdir()
    src = write_jsonl(d / "c.jsonl", conversations(300, seed=1))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=256)
    args = ["--target", str(tiny_llama_dir), "--samples-per-shard", "1", "--max-tokens-per-batch", "256"]
    ref = extract(
        str(ds),
        str(tmp_path / "ref"),
        target=str(tiny_llama_dir),
        samples_per_shard=1,
        max_tokens_per_batch=256,
    )
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "specdraft.cli", "extract", str(ds), str(out), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("shard-*.json"))) < 5:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)  # a real kill -9, mid-run
    proc.wait()
    n_done = len(list(out.glob("shard-*.json")))
    assert 5 <= n_done < 300, f"the kill landed outside the run ({n_done} shards done)"
    assert not json.loads(next(out.glob("manifest-*.json")).read_text())["complete"]
    # no partial shard is visible to readers: every listed sample loads
    partial = ShardSet.open(out)
    for sid in partial.sample_ids():
        partial.load(sid)
    # resume with the same command
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert verify([str(out)]) == []
    a, b = load_all(ref), load_all(out)
    assert sorted(a) == sorted(b) == list(range(len(a)))
    for sid in a:
        for k in ("input_ids", "loss_mask", "hidden"):
            assert torch.equal(a[sid][k], b[sid][k]), (sid, k)
    assert not list(out.glob(".*.tmp"))


def test_scale_out_and_verify_reports_missing_and_duplicates(tmp_path, dataset, tiny_llama_dir):
    dirs = []
    for i in range(3):  # three "nodes", each with its own output dir
        dirs.append(str(extract(str(dataset), str(tmp_path / f"node{i}"), target=str(tiny_llama_dir), num_shards=3,
                                shard_index=i, samples_per_shard=8)))  # fmt: skip
    assert verify(dirs) == []
    ss = ShardSet.open(dirs)
    n = ss.manifest["num_samples"]
    assert ss.sample_ids() == list(range(n))
    assert any("no output from extraction processes [2]" in p for p in verify(dirs[:2]))
    # a duplicated shard (same process output copied into a second place)
    dup = tmp_path / "dup"
    shutil.copytree(dirs[0], dup)
    probs = verify([*dirs, str(dup)])
    assert any("stored more than once" in p for p in probs)
    # one shard lost
    victim = sorted(Path(dirs[1]).glob("shard-*.json"))[0]
    lost = json.loads(victim.read_text())["samples"]
    victim.unlink()
    probs = verify(dirs)
    assert any(p.startswith(f"{len(lost)} samples missing") for p in probs), probs


def test_corrupted_shard_is_reported_and_others_still_load(tmp_path, dataset, tiny_llama_dir):
    out = extract(str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir), samples_per_shard=8)
    shards = sorted(out.glob("shard-*.safetensors"))
    raw = bytearray(shards[1].read_bytes())
    raw[-100] ^= 0xFF
    shards[1].write_bytes(bytes(raw))
    probs = verify([str(out)])
    assert probs == [f"{shards[1].name}: checksum mismatch (file corrupted or modified)"]
    ss = ShardSet.open(out)
    good = json.loads(shards[0].with_suffix(".json").read_text())["samples"]
    assert all(torch.isfinite(ss.load(s)["hidden"]).all() for s in good)
    # a truncated shard: header unreadable
    shards[2].write_bytes(shards[2].read_bytes()[:50])
    assert any(shards[2].name in p for p in verify([str(out)]))


def test_refuses_when_disk_too_small(tmp_path, dataset, tiny_llama_dir, monkeypatch):
    import specdraft.capture.extract as ex

    monkeypatch.setattr(
        ex.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)
    )
    with pytest.raises(OSError, match="only 0.00 GiB are free.*--store-dtype bfloat16"):
        extract(str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir))


def test_refuses_to_mix_settings_in_one_dir(tmp_path, dataset, tiny_llama_dir):
    out = extract(str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir), max_samples=4)
    with pytest.raises(ValueError, match="other settings \\(num_samples"):
        extract(str(dataset), str(out), target=str(tiny_llama_dir), max_samples=5)


def test_token_batches_respect_budget():
    lengths = {0: 100, 1: 90, 2: 50, 3: 50, 4: 10}
    batches = token_batches([0, 1, 2, 3, 4], lengths, 200)
    assert batches == [[0, 1], [2, 3, 4]]
    assert sorted(s for b in batches for s in b) == [0, 1, 2, 3, 4]

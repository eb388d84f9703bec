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
from specdraft.data.store import ShardError, ShardSet, verify


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
                  max_tokens_per_batch=512, store_dtype="float32")  # fmt: skip
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
    assert (
        extract(
            str(dataset), str(out), target=str(tiny_llama_dir), samples_per_shard=16, store_dtype="float32"
        )
        == out
    )


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
    with pytest.raises(ShardError) as e:
        ShardSet.open(out)
    assert str(e.value).startswith(f"{shards[2]}: size 50 != ")
    assert str(e.value).endswith(
        "(truncated or partly written): rerun `specdraft extract` with the same command to redo it"
    )
    # the fixes the messages give: the rerun redoes the truncated shard, and the one whose sidecar was deleted
    shards[1].with_suffix(".json").unlink()
    extract(str(dataset), str(out), target=str(tiny_llama_dir), samples_per_shard=8)
    assert verify([str(out)]) == []


def test_refuses_when_disk_too_small(tmp_path, dataset, tiny_llama_dir, monkeypatch):
    import specdraft.capture.extract as ex

    monkeypatch.setattr(
        ex.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)
    )
    with pytest.raises(OSError, match=r"only [\d.]+ KiB are free \([\d.]+ MiB short\).*--store-dtype fp8"):
        extract(str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir))


def test_refuses_to_mix_settings_in_one_dir(tmp_path, dataset, tiny_llama_dir):
    out = extract(str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir), max_samples=4)
    with pytest.raises(
        ValueError, match="holds another extraction: num_samples 4 there, 5 now \\(--max-samples"
    ):
        extract(str(dataset), str(out), target=str(tiny_llama_dir), max_samples=5)


def test_token_batches_respect_budget():
    lengths = {0: 100, 1: 90, 2: 50, 3: 50, 4: 10}
    batches = token_batches([0, 1, 2, 3, 4], lengths, 200)
    assert batches == [[0, 1], [2, 3, 4]]
    assert sorted(s for b in batches for s in b) == [0, 1, 2, 3, 4]


# --- nothing silent (issue 14) and storage / TP options (issue 9) ------------------------------------------


@pytest.fixture(scope="module")
def other_weights_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny Llama's architecture and config.json with other (seed 1) weights."""
    from conftest import CHATML, build_tiny_model, build_tokenizer

    d = tmp_path_factory.mktemp("tiny-llama-other")
    tok = build_tokenizer(CHATML)
    model = build_tiny_model("llama", seed=1)
    model.resize_token_embeddings(len(tok))
    model.config.vocab_size = len(tok)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    assert (d / "config.json").read_text() == (tiny_llama_dir / "config.json").read_text()
    return d


def interrupted_run(monkeypatch, after: int, *args, **kwargs) -> None:
    """extract(*args, **kwargs) interrupted (Ctrl-C) once `after` shards are written."""
    import specdraft.capture.extract as ex

    real, written = ex.write_shard, []

    def write_then_stop(*a, **k):
        real(*a, **k)
        written.append(1)
        if len(written) == after:
            raise KeyboardInterrupt

    monkeypatch.setattr(ex, "write_shard", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        extract(*args, **kwargs)
    monkeypatch.setattr(ex, "write_shard", real)


def test_resume_refuses_another_runs_layers_or_weights(
    tmp_path, dataset, tiny_llama_dir, other_weights_dir, monkeypatch
):
    out = tmp_path / "x"
    kw = dict(max_samples=8, samples_per_shard=2, skip_doctor=True)
    interrupted_run(monkeypatch, 2, str(dataset), str(out), target=str(tiny_llama_dir), **kw)
    man = json.loads((out / "manifest-00000-of-00001.json").read_text())
    assert not man["complete"] and len(list(out.glob("shard-*.json"))) == 2
    assert man["identity"]["layer_ids"] == [2, 4, 5, 8] and man["identity"]["dtype"] == "bfloat16"
    fix = "use a new --out directory, or the settings that extraction was started with to resume it"
    with pytest.raises(ValueError) as e:
        extract(str(dataset), str(out), target=str(tiny_llama_dir), layers=[1, 3, 4], **kw)
    assert str(e.value) == (
        f"extract: {out} holds another extraction: layer_ids [2, 4, 5, 8] there, [1, 3, 4, 8] now (--layers): {fix}"
    )
    with pytest.raises(ValueError) as e:
        extract(str(dataset), str(out), target=str(other_weights_dir), **kw)
    assert str(e.value).startswith(f"extract: {out} holds another extraction: target_weights ")
    assert str(e.value).endswith(f"now (--target (other weights)): {fix}")
    assert len(list(out.glob("shard-*.json"))) == 2  # nothing was written by the refused runs
    extract(str(dataset), str(out), target=str(tiny_llama_dir), **kw)  # the same command resumes
    assert verify([str(out)]) == []


def test_one_extract_per_directory(tmp_path, dataset, tiny_llama_dir):
    """Two real processes on one directory: the second is refused in one line while the first holds it."""
    out = tmp_path / "x"
    cmd = [sys.executable, "-m", "specdraft.cli", "extract", str(dataset), str(out), "--target",
           str(tiny_llama_dir), "--samples-per-shard", "1", "--max-samples", "12", "--skip-doctor"]  # fmt: skip
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not list(out.glob("shard-*.json")) and first.poll() is None:
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGSTOP)  # holds the lock, mid-run, for as long as the second one needs
        assert first.poll() is None, "the first extract ended before the second one started"
        second = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait() == 0
    assert second.returncode == 2
    assert second.stderr.startswith(
        f"specdraft extract: error: {out} is in use by another specdraft process (pid {first.pid}: "
    )
    assert second.stderr.endswith("wait for it to finish, or give this extraction another output directory\n")
    assert (out / ".specdraft.lock").exists() and verify([str(out)]) == []
    assert len(ShardSet.open(out).sample_ids()) == 12


def test_wrong_arguments_are_refused_before_anything_runs(tmp_path, dataset, tiny_llama_dir):
    def refused(**kw) -> str:
        with pytest.raises(ValueError) as e:
            extract(str(dataset), str(tmp_path / "x"), target=str(tiny_llama_dir), **kw)
        assert not (tmp_path / "x").exists()
        return str(e.value)

    assert refused(layers=[2, 2, 5]) == (
        "extract: --layers takes distinct aux layer ids (EAGLE-3 fuses exactly 3, `train --draft dflash` any "
        "number), not [2, 2, 5]"
    )
    vllm_only = "--tensor-parallel-size and --engine-args are vLLM options: add --backend vllm, or drop them"
    assert refused(tensor_parallel_size=2) == f"extract: {vllm_only}"
    assert refused(engine_args='{"enable_expert_parallel": true}') == f"extract: {vllm_only}"
    assert refused(engine_args="[1, 2]", backend="vllm") == (
        "extract: --engine-args must be a JSON object like '{\"enable_expert_parallel\": true}', not '[1, 2]'"
    )
    assert refused(engine_args="{oops", backend="vllm").startswith("extract: --engine-args is not valid JSON")
    assert (
        refused(tensor_parallel_size=0, backend="vllm")
        == "extract: --tensor-parallel-size must be >= 1, not 0"
    )
    assert refused(store_dtype="int8").startswith("extract: --store-dtype must be one of ")


def test_full_disk_gives_one_line_and_the_rerun_resumes(
    tmp_path, dataset, tiny_llama_dir, monkeypatch, capsys
):
    """ENOSPC mid-run (a writer that fills the disk at the third shard): the CLI's one-liner, no partial
    file left, and the same command finishes the run."""
    from safetensors import SafetensorError

    import specdraft.data.store as store
    from specdraft.cli import main

    out = tmp_path / "x"
    argv = ["extract", str(dataset), str(out), "--target", str(tiny_llama_dir), "--max-samples", "8",
            "--samples-per-shard", "2", "--skip-doctor"]  # fmt: skip
    real, calls = store.save_file, []

    def disk_fills(tensors, filename):
        calls.append(filename)
        if len(calls) < 3:
            return real(tensors, filename)
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(store, "save_file", disk_fills)
    assert main(argv) == 2
    shard = out / "shard-00000-00002.safetensors"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"specdraft extract: error: no space left on the device writing {shard}: free space or point the "
        "output at a larger disk, then rerun the same command to resume"
    )
    assert len(list(out.glob("shard-*.json"))) == 2 and not list(out.glob(".*.tmp"))
    monkeypatch.setattr(store, "save_file", real)
    assert main(argv) == 0
    assert verify([str(out)]) == []


def test_store_dtype_bf16_by_default_and_fp8(tmp_path, dataset, tiny_llama_dir):
    kw = dict(target=str(tiny_llama_dir), max_samples=6, samples_per_shard=3, skip_doctor=True)
    ref = load_all(extract(str(dataset), str(tmp_path / "f32"), store_dtype="float32", **kw))
    bf = extract(str(dataset), str(tmp_path / "bf16"), **kw)  # compute float32, store bfloat16
    f8 = extract(str(dataset), str(tmp_path / "fp8"), store_dtype="fp8", **kw)
    assert verify([str(bf), str(f8)][:1]) == [] and verify([str(f8)]) == []
    man = ShardSet.open(f8).manifest
    assert man["dtype"] == "fp8" and man["compute_dtype"] == "float32"
    assert man["tensor_parallel_size"] == 1 and man["rows_mapped_by"] is None  # the hf backend maps nothing
    for s, (a, b, c) in enumerate(zip(ref.values(), load_all(bf).values(), load_all(f8).values())):
        assert b["hidden"].dtype == torch.bfloat16 and c["hidden"].dtype == torch.float32
        assert torch.equal(b["hidden"], a["hidden"].bfloat16())
        rel = (c["hidden"] - a["hidden"]).abs() / a["hidden"].abs().amax(-1, keepdim=True)
        assert rel.max() <= 2**-4, s  # e4m3 rounding, relative to each row's max
    f8_bytes = sum(p.stat().st_size for p in f8.glob("shard-*.safetensors"))
    bf_bytes = sum(p.stat().st_size for p in bf.glob("shard-*.safetensors"))
    assert f8_bytes < 0.6 * bf_bytes  # H = 64 here: the scales and ids weigh more than at real widths


def test_extract_runs_the_target_the_dataset_was_prepared_with(dataset, tmp_path, tiny_llama_dir):
    """Without --target, extract ran the embedded default on any dataset: another model's hidden states for
    token ids of another vocabulary. It now runs the dataset's own target."""
    out = extract(str(dataset), str(tmp_path / "hs"), max_samples=2)
    man = json.loads(next(out.glob("manifest-*.json")).read_text())
    assert man["target"]["name"] == str(tiny_llama_dir)


def test_extract_refuses_a_target_with_another_tokenizer(dataset, tmp_path, hybrid_dir):
    with pytest.raises(ValueError) as e:
        extract(str(dataset), str(tmp_path / "hs"), target=str(hybrid_dir), max_samples=2)
    assert "has another tokenizer than the one" in str(e.value)
    assert "drop --target" in str(e.value) and not (tmp_path / "hs").exists()

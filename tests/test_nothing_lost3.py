"""Nothing lost, nothing mixed, round three (issue 40): a command deletes only its own dead temporaries; an
extraction's identity (weights, layers, compute dtype, backend, dataset, split) is compared across every
directory in any order and on resume; mixtures refuse a source given twice; export of an unfinished run
names the checkpoint; --init-from another target is refused before loading; unreadable state files are
named; output paths under a file are named; Ctrl-C in train prints the command to resume. Tiny random
Llama, hf backend."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import conversations, write_jsonl
from safetensors.torch import load_file, save_file

from specdraft.capture.extract import extract
from specdraft.data.prepare import load_dataset, prepare
from specdraft.data.store import ShardSet, verify
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

CFG = TrainConfig(draft_vocab_size=64, ttt_steps=2, epochs=1, max_steps=2, max_tokens=512, checkpoint_every=1,
                  val_fraction=0.0, val_every=0, progress=False, prefetch=False, tensorboard=False)  # fmt: skip


@pytest.fixture(scope="module")
def ds(tmp_path_factory, tiny_llama_dir) -> Path:
    d = tmp_path_factory.mktemp("lost3")
    src = write_jsonl(d / "c.jsonl", conversations(8, seed=3))
    return prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=64)


def run_extract(ds: Path, out: Path, target: Path, **kw) -> Path:
    return extract(str(ds), str(out), target=str(target), samples_per_shard=4, skip_doctor=True, **kw)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- 1: the lock removes only provably ours, dead writers' temporaries ---------------------------------------


def test_the_lock_keeps_user_files_and_removes_only_dead_specdraft_temporaries(tmp_path, ds, tiny_llama_dir):
    x = run_extract(ds, tmp_path / "x", tiny_llama_dir)
    out = tmp_path / "run"
    (out / ".cache.tmp").mkdir(parents=True)
    (out / ".cache.tmp" / "keep").write_text("mine")
    (out / ".draft-notes.tmp").write_text("notes")
    (out / ".shard.4242.tmp").write_text("an old writer's, or anyone's: not provably ours")
    dead = out / f".shard-00000-00001.safetensors.specdraft-{dead_pid()}.tmp"
    dead.write_bytes(b"partial")
    live = out / f".manifest.json.specdraft-{os.getppid()}.tmp"  # a live process's
    live.write_text("{}")
    with pytest.raises(ValueError, match="--resume: no checkpoint"):
        train(str(x), str(out), replace(CFG, resume=True))  # refused after taking the lock
    assert (out / ".cache.tmp" / "keep").read_text() == "mine"
    assert (out / ".draft-notes.tmp").read_text() == "notes"
    assert (out / ".shard.4242.tmp").exists() and live.exists() and not dead.exists()


# --- 2 and 5: an extraction's identity, across directories and on resume -----------------------------------


def test_two_processes_with_other_weights_at_one_path_are_refused_in_any_order(tmp_path, ds, tiny_llama_dir):
    target = tmp_path / "target"
    shutil.copytree(tiny_llama_dir, target)
    p0 = run_extract(ds, tmp_path / "hs0", target, num_shards=2, shard_index=0)
    w = target / "model.safetensors"
    state = load_file(w)
    name = next(k for k in state if "layers.1." in k)
    state[name] = state[name] + 0.01
    save_file(state, str(w), metadata={"format": "pt"})
    p1 = run_extract(ds, tmp_path / "hs1", target, num_shards=2, shard_index=1)
    for dirs in ([p1, p0], [p0, p1]):
        problems = verify([str(d) for d in dirs])
        assert len(problems) == 1 and "target_weights" in problems[0], problems
        first, second = dirs
        assert problems[0].startswith(f"{second} (process {1 if second == p1 else 0}) was extracted with other "
                                      f"settings than {first}: target_weights ")  # fmt: skip
        with pytest.raises(ValueError, match=r"target_weights .* there, .* in "):
            train(",".join(map(str, dirs)), str(tmp_path / "t"), CFG)
    assert not (tmp_path / "t" / "checkpoints").exists()


def test_extract_resumed_with_another_compute_dtype_or_backend_is_refused(tmp_path, ds, tiny_llama_dir):
    out = run_extract(ds, tmp_path / "x", tiny_llama_dir, dtype="float32")
    fix = "use a new --out directory, or the settings that extraction was started with to resume it"
    with pytest.raises(ValueError) as e:
        run_extract(ds, out, tiny_llama_dir, dtype="bfloat16")
    assert str(e.value) == (
        f"extract: {out} holds another extraction: compute_dtype float32 there, bfloat16 now (--dtype): {fix}"
    )
    with pytest.raises(ValueError) as e:  # refused before vLLM is imported or any engine starts
        run_extract(ds, out, tiny_llama_dir, backend="vllm")
    assert (
        str(e.value)
        == f"extract: {out} holds another extraction: backend hf there, vllm now (--backend): {fix}"
    )
    assert run_extract(ds, out, tiny_llama_dir, dtype="float32") == out  # the same command: complete


def test_an_extraction_from_before_the_compute_fields_resumes_and_joins(tmp_path, ds, tiny_llama_dir):
    out = run_extract(ds, tmp_path / "x", tiny_llama_dir)
    man_path = out / "manifest-00000-of-00001.json"
    man = json.loads(man_path.read_text())
    for k in ("compute_dtype", "backend"):
        del man["identity"][k]
    from specdraft.data.store import extraction_id

    man["extraction_id"] = extraction_id(man["identity"])
    man_path.write_text(json.dumps(man))
    for side in out.glob("shard-*.json"):
        s = json.loads(side.read_text())
        side.write_text(json.dumps({**s, "extraction": man["extraction_id"]}))
    assert run_extract(ds, out, tiny_llama_dir) == out  # same settings: still complete, nothing redone
    assert verify([str(out)]) == []
    with pytest.raises(ValueError, match=r"compute_dtype float32 there, bfloat16 now \(--dtype\)"):
        run_extract(ds, out, tiny_llama_dir, dtype="bfloat16")


# --- 7: unreadable state files are named, with what to do -------------------------------------------------


def test_unreadable_state_files_are_named_in_one_line(tmp_path, ds, tiny_llama_dir):
    d = tmp_path / "ds"
    shutil.copytree(ds, d)
    (d / "manifest.json").write_text("")
    with pytest.raises(ValueError) as e:
        load_dataset(d)
    assert str(e.value).startswith(f"{d / 'manifest.json'} cannot be read (not JSON: Expecting value")
    assert str(e.value).endswith(f": rerun `specdraft prepare` into {d}")

    x = run_extract(ds, tmp_path / "x", tiny_llama_dir)
    man = x / "manifest-00000-of-00001.json"
    man.write_text("")
    with pytest.raises(ValueError) as e:
        run_extract(ds, x, tiny_llama_dir)
    assert str(e.value).startswith(f"{man} cannot be read (not JSON: ")
    assert str(e.value).endswith(f": delete {man} and rerun the same command (the shards bound to this "
                                 "extraction are kept)")  # fmt: skip
    with pytest.raises(ValueError, match=rf"^{man} cannot be read \(not JSON: .*\): delete it and rerun"):
        ShardSet.open(x)
    man.unlink()
    assert run_extract(ds, x, tiny_llama_dir) == x and verify([str(x)]) == []  # the fix works

    from specdraft.data.regenerate import SETTINGS_FILE, regenerate

    r = tmp_path / "regen"
    r.mkdir()
    (r / "chunk-00000.jsonl").write_text("{}\n")
    src = write_jsonl(tmp_path / "c.jsonl", conversations(2))
    for text, what in (("", "not JSON: Expecting value"), ('{"done": false}', "it lacks 'settings'")):
        (r / SETTINGS_FILE).write_text(text)
        with pytest.raises(ValueError) as e:
            regenerate(str(src), str(r), target=str(tiny_llama_dir), engine="hf", max_new_tokens=4)
        assert str(e.value).startswith(f"{r / SETTINGS_FILE} cannot be read ({what}")
        assert str(e.value).endswith(f"delete {r / SETTINGS_FILE} and rerun with the settings this run started "
                                     "with (the chunks there are kept), or choose another output directory")  # fmt: skip


# --- 8: output paths under a file ----------------------------------------------------------------------------


def test_outputs_at_or_under_a_file_are_refused_naming_the_path(tmp_path, tiny_llama_dir):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    src = write_jsonl(tmp_path / "c.jsonl", conversations(2))
    with pytest.raises(ValueError) as e:
        prepare(str(src), str(f), target=str(tiny_llama_dir), max_length=64)
    assert (
        str(e.value) == f"{f} is a file, not a directory: choose a directory path for this dataset's output"
    )
    with pytest.raises(ValueError) as e:
        prepare(str(src), str(f / "ds"), target=str(tiny_llama_dir), max_length=64)
    assert str(e.value) == (
        f"{f / 'ds'}: {f} is a file, not a directory: choose a directory path for this dataset's output"
    )
    assert f.read_text() == "mine"

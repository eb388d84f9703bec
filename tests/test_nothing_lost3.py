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
    (out / "train_settings.json").write_text("{}")  # a run's OUT (a user's is refused: issue 60)
    with pytest.raises(ValueError, match="--resume: no checkpoint"):
        train(str(x), str(out), replace(CFG, resume=True))  # refused before taking the lock: nothing removed
    assert dead.exists()
    train(str(x), str(out), replace(CFG, max_steps=1))  # the lock, taken, removes the dead writer's temporary
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
    with pytest.raises(ValueError) as e:
        run_extract(ds, out, tiny_llama_dir, dtype="bfloat16")
    assert str(e.value) == (
        f"extract: {out} holds another extraction: compute_dtype float32 there, bfloat16 now (--dtype): use a new "
        "--out directory, or resume it with --dtype float32"
    )
    with pytest.raises(ValueError) as e:  # refused before vLLM is imported or any engine starts
        run_extract(ds, out, tiny_llama_dir, backend="vllm")
    assert str(e.value) == (
        f"extract: {out} holds another extraction: backend hf there, vllm now (--backend): use a new --out "
        "directory, or resume it with --backend hf"
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


# --- 3: a source given twice ------------------------------------------------------------------------------


def test_a_mixture_refuses_a_source_given_twice(tmp_path, tiny_llama_dir):
    src = write_jsonl(tmp_path / "c.jsonl", conversations(4))
    again = tmp_path / "sub" / ".." / "c.jsonl"  # the same file, spelled otherwise
    (tmp_path / "sub").mkdir()
    for data in ([str(src), str(again)], [f"{src}:0.5", f"{again}:0.5"]):
        with pytest.raises(ValueError) as e:
            prepare(data, str(tmp_path / "ds"), target=str(tiny_llama_dir), max_length=64)
        assert str(e.value) == (
            f"data source {again} is given twice (also as {src}): a mixture takes each source once, else its "
            "conversations are repeated; give it once, with a larger weight (PATH:WEIGHT) for a larger share"
        )
    assert not (tmp_path / "ds").exists()


def test_a_hard_link_or_an_identical_copy_is_the_same_source(tmp_path, tiny_llama_dir):
    import os
    import shutil

    src = write_jsonl(tmp_path / "c.jsonl", conversations(4))
    os.link(src, tmp_path / "link.jsonl")
    shutil.copyfile(src, tmp_path / "copy.jsonl")
    other = write_jsonl(tmp_path / "d.jsonl", conversations(4)[::-1])  # the same size, other content
    for again in ("link.jsonl", "copy.jsonl"):
        with pytest.raises(ValueError, match=f"{again} is given twice \\(also as {src}\\)"):
            prepare([str(src), str(tmp_path / again)], str(tmp_path / "ds"), target=str(tiny_llama_dir),
                    max_length=64)  # fmt: skip
    assert not (tmp_path / "ds").exists()
    assert os.path.getsize(other) == os.path.getsize(src)
    prepare([str(src), str(other)], str(tmp_path / "ds"), target=str(tiny_llama_dir), max_length=64)


# --- 4 and 8: export of an unfinished run; export under a file ----------------------------------------------


@pytest.fixture(scope="module")
def unfinished(tmp_path_factory) -> tuple[Path, Path]:
    """(a train OUT with checkpoints step 2 and 4 but no final/, its target): a run stopped mid-way."""
    import numpy as np
    from conftest import build_tiny_model

    from specdraft.model.checkpoint import STATE_FILE, save_draft
    from specdraft.model.draft import build_draft
    from specdraft.targets import wrap_model

    d = tmp_path_factory.mktemp("unfinished")
    target = wrap_model(build_tiny_model("llama"), name="tiny")
    target.model.save_pretrained(d / "target")
    draft = build_draft(target, np.arange(target.vocab_size)[::-1].copy(), [2, 4, 5], draft_vocab_size=64)
    for step in (2, 4):
        ck = d / "run" / "checkpoints" / f"step_{step:08d}"
        save_draft(draft, ck)
        (ck / STATE_FILE).write_bytes(b"")
    return d / "run", d / "target"


def test_export_of_a_run_without_final_names_the_checkpoint_and_records_the_step(
    tmp_path, unfinished, capsys
):
    from specdraft.export import MARKER_FILE, export

    run, target = unfinished
    ck = run / "checkpoints" / "step_00000004"
    with pytest.raises(ValueError) as e:
        export(str(run), str(tmp_path / "e"), target=str(target), check_vllm=False)
    assert str(e.value) == (
        f"export: {run} has no final/ (its training has not finished; its newest checkpoint is {ck}): pass that "
        f"checkpoint to export it (`specdraft export {ck} OUT`), or finish the training (`specdraft train ... "
        f"--resume`) and export {run}"
    )
    assert not (tmp_path / "e").exists()
    assert export(str(ck), str(tmp_path / "e"), target=str(target), check_vllm=False) == 0
    marker = json.loads((tmp_path / "e" / MARKER_FILE).read_text())
    assert marker["step"] == 4 and marker["source"] == str(ck)
    assert f"of {ck} (step 4) -> {tmp_path / 'e'}" in capsys.readouterr().out


def test_export_under_a_file_names_the_users_path(tmp_path, unfinished):
    from specdraft.export import export

    run, target = unfinished
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    with pytest.raises(ValueError) as e:
        export(str(run / "checkpoints" / "step_00000002"), str(f / "e"), target=str(target), check_vllm=False)
    assert str(e.value) == (
        f"export: {f / 'e'}: {f} is a file, not a directory: choose a directory path for this export's output"
    )
    assert f.read_text() == "mine"


# --- 6: --init-from a draft of another target -----------------------------------------------------------------


def test_init_from_a_draft_of_another_target_is_refused_before_anything_loads(
    tmp_path, ds, tiny_llama_dir, unfinished, monkeypatch
):
    import specdraft.train.loop as loop
    from specdraft.model.checkpoint import load_draft_config

    x = run_extract(ds, tmp_path / "x", tiny_llama_dir)
    ck = unfinished[0] / "checkpoints" / "step_00000004"  # a draft built for another tiny target
    theirs = json.loads((x / "manifest-00000-of-00001.json").read_text())["target"]
    dc = load_draft_config(ck)
    monkeypatch.setattr(loop, "_setup", lambda *a: pytest.fail("data or target loaded before the refusal"))
    with pytest.raises(ValueError) as e:
        train(str(x), str(tmp_path / "t"), replace(CFG, init_from=str(ck)))
    assert str(e.value) == (
        f"train: --init-from {ck} is a draft for another target (tiny, config hash {dc.target_config_hash}) than "
        f"the data's ({theirs['name']}, config hash {theirs['config_hash']}): pass --init-from a draft trained "
        f"for {theirs['name']}, or drop --init-from to start a fresh draft"
    )
    assert dc.target_config_hash != theirs["config_hash"]


# --- 9: after Ctrl-C or SIGTERM, the command that resumes; bars closed before a message -----------------------


def test_a_stopped_train_prints_the_exact_command_that_resumes_it(tmp_path, monkeypatch, capsys):
    import specdraft.train.loop as loop
    from specdraft import cli
    from specdraft.model.checkpoint import STATE_FILE

    out = tmp_path / "my run"
    argv = ["train", str(tmp_path / "hs"), str(out), "--max-steps", "3", "--lr", "2e-4"]
    for exc, rc, said in (
        (KeyboardInterrupt, 130, "interrupted"),
        (cli.Terminated, 143, "terminated (SIGTERM)"),
    ):

        def stopped(shards, out_dir, cfg, exc=exc):
            (out_dir / "checkpoints" / "step_00000002").mkdir(parents=True, exist_ok=True)
            (out_dir / "checkpoints" / "step_00000002" / STATE_FILE).write_bytes(b"")
            raise exc

        monkeypatch.setattr(loop, "train_loop", stopped)
        monkeypatch.setattr(loop, "refuse_early", lambda *a: None)  # no data here: the stop alone is tested
        assert cli.main(argv) == rc
        assert capsys.readouterr().err == (
            f"specdraft train: {said}; resume with `specdraft train {tmp_path / 'hs'} '{out}' --max-steps 3 "
            "--lr 2e-4 --resume`\n"
        )
    assert cli.main([*argv, "--resume"]) == 143  # given again with --resume: the same command, once
    assert capsys.readouterr().err.endswith("--lr 2e-4 --resume`\n")


def test_an_error_message_starts_its_own_line_after_a_progress_bar(tmp_path, monkeypatch, capsys):
    from tqdm import tqdm

    import specdraft.train.loop as loop
    from specdraft import cli

    def fails(shards, out_dir, cfg):
        bar = tqdm(total=10, desc="train")
        bar.update(3)
        raise ValueError("train: something the user can fix")  # the bar is left open, as a stage leaves it

    monkeypatch.setattr(loop, "train_loop", fails)
    monkeypatch.setattr(loop, "refuse_early", lambda *a: None)  # no data here: the message alone is tested
    assert cli.main(["train", str(tmp_path / "hs"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("\rtrain:") and err.endswith(
        "\nspecdraft train: error: train: something the user can fix\n"
    )


# --- also: --skip-bad's count, --allow-partial and a lost shard ------------------------------------------------


def test_skip_bad_counts_what_a_skipped_shard_holds(tmp_path, ds, tiny_llama_dir, capsys):
    x = run_extract(ds, tmp_path / "x", tiny_llama_dir)
    for ext in (".safetensors", ".json"):  # shard 0 replaced by shard 1 under its name: it holds 4 samples
        shutil.copy(x / f"shard-00000-00001{ext}", x / f"shard-00000-00000{ext}")
    capsys.readouterr()
    ss = ShardSet.open(x, skip_bad=True)
    assert capsys.readouterr().out.startswith("specdraft: warning: skipping 1 bad shard(s), 4 samples: ")
    assert len(ss.sample_ids()) == 4  # shard 1's own, read from shard 1


def test_a_lost_shard_names_skip_bad_with_allow_partial_and_that_trains(tmp_path, ds, tiny_llama_dir, capsys):
    x = run_extract(ds, tmp_path / "x", tiny_llama_dir)
    for ext in (".safetensors", ".json"):  # lost, sidecar and all
        (x / f"shard-00000-00001{ext}").unlink()
    with pytest.raises(ValueError) as e:
        train(str(x), str(tmp_path / "t"), replace(CFG, allow_partial=True))
    assert str(e.value).endswith(": rerun `specdraft extract` with the same command to redo it, or train with "
                                 "--skip-bad --allow-partial to train without its samples")  # fmt: skip
    train(str(x), str(tmp_path / "t"), replace(CFG, allow_partial=True, skip_bad=True, max_steps=1))
    out = capsys.readouterr().out
    assert "specdraft: warning: skipping 1 bad shard(s), 4 samples (4 of them listed by no sidecar): " in out
    assert "training on the 4 there" in out

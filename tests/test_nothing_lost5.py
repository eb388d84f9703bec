"""Nothing lost, round five (issue 60): train writes only into a new or empty OUT or an earlier run's, as export and
eval do (a user's files refused, never replaced); a user's folder named like a checkpoint is kept; no checkpoint
holds non-finite weights and every number of the settings is checked; a finished run resumed with fewer steps
keeps its step; --ttt-steps is bounded by the data; a resume counts the checkpoints already in OUT; a refused
train or extract creates nothing; the messages name what is wrong. Tiny random Llama, hf backend."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import types
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from conftest import conversations, write_jsonl

from specdraft.train.checkpoint import NonFiniteError
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

E3 = TrainConfig(draft_vocab_size=64, ttt_steps=2, epochs=1, max_steps=2, max_tokens=512, checkpoint_every=1,
                 val_fraction=0.1, progress=False, prefetch=False, tensorboard=False)  # fmt: skip
DF = TrainConfig(draft="dflash", draft_vocab_size=64, block_size=4, anchors=4, max_tokens=600, max_length=64,
                 epochs=1, max_steps=2, lr=3e-3, val_fraction=0.1, checkpoint_every=1, keep_checkpoints=1,
                 progress=False, tensorboard=False)  # fmt: skip
KINDS = {"eagle3": E3, "dflash": DF}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_llama_dir) -> tuple[Path, Path]:
    """(a prepared dataset of 64-token samples at most, its extraction at the default layers)."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("lost5")
    src = write_jsonl(d / "c.jsonl", conversations(24, seed=2))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=64)
    x = extract(str(ds), str(d / "x"), target=str(tiny_llama_dir), samples_per_shard=12, skip_doctor=True, store_dtype="float32")  # fmt: skip
    return ds, x


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory) -> dict[str, Path]:
    """{kind: the OUT of a finished 2-step run (checkpoints at steps 1 and 2, the first pruned for DFlash)}."""
    root = tmp_path_factory.mktemp("finished")
    return {kind: train(str(data[1]), str(root / kind), cfg).parent for kind, cfg in KINDS.items()}


def copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def tree(d: Path) -> dict[str, str]:
    """Every file under `d` (relative path -> sha256), the directory lock included: a refusal creates none."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}  # fmt: skip


def vals(out: Path) -> list[int]:
    recs = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in recs if r["split"] == "val"]


# --- 1: train refuses an OUT holding a user's files, as export and eval do --------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_train_refuses_an_out_holding_a_users_files_and_touches_nothing(data, tmp_path, kind):
    out = tmp_path / "mine"
    (out / "final").mkdir(parents=True)
    (out / "final" / "notes.txt").write_text("my notes")
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    (out / "README.md").write_text("# my project")
    before = tree(out)
    with pytest.raises(ValueError) as e:
        train(str(data[1]), str(out), KINDS[kind])
    assert (f"refusing to write into {out}: it holds files train did not write (README.md, final/notes.txt, "
            "metrics.jsonl): move them out, or choose a new or empty OUT directory") in str(e.value)  # fmt: skip
    assert tree(out) == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_runs_out_keeps_a_users_readme_and_refuses_a_users_file_in_final(finished, tmp_path, data, kind):
    """Beside a run's files a user's file is kept (train never touches it); in final/, which a run replaces
    whole, it is refused before anything is written."""
    run = copy(finished[kind], tmp_path / "run")
    (run / "final" / "notes.txt").write_text("my notes")
    before = tree(run)
    with pytest.raises(ValueError, match=rf"refusing to replace {run / 'final'} \(a run writes it whole\): it holds "
                                         r"files train did not write \(final/notes.txt\)"):  # fmt: skip
        train(str(data[1]), str(run), replace(KINDS[kind], resume=True, max_steps=3))
    assert tree(run) == before
    (run / "final" / "notes.txt").rename(run / "README.md")
    train(str(data[1]), str(run), replace(KINDS[kind], resume=True, max_steps=3))
    assert (run / "README.md").read_text() == "my notes"


# --- 2: a user's folder named exactly like a checkpoint ---------------------------------------------------------


def test_a_users_folder_named_like_the_next_checkpoint_is_kept(finished, data, tmp_path):
    run = copy(finished["eagle3"], tmp_path / "run")
    mine = run / "checkpoints" / "step_00000003"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    before = tree(run)
    with pytest.raises(ValueError, match=rf"{mine} is in the way of the checkpoint of its step and holds files "
                                         rf"specdraft did not write \(notes.txt\): move it out of {mine.parent}"):  # fmt: skip
        train(str(data[1]), str(run), replace(E3, resume=True, max_steps=3))
    assert tree(run) == before


def test_a_users_folder_made_during_the_run_is_kept_when_its_step_is_written(
    finished, data, tmp_path, monkeypatch
):
    """The same folder made while the run goes on (after its checks): the checkpoint of that step is refused when
    written, the folder kept, no temporary left."""
    import specdraft.train.loop as loop

    run = copy(finished["eagle3"], tmp_path / "run")
    mine = run / "checkpoints" / "step_00000003"
    real = loop._build

    def build_then_user(*a):
        built = real(*a)
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
        return built

    monkeypatch.setattr(loop, "_build", build_then_user)
    with pytest.raises(ValueError, match=f"{mine} is in the way"):
        train(str(data[1]), str(run), replace(E3, resume=True, max_steps=4))
    assert (mine / "notes.txt").read_text() == "mine"
    assert not [p for p in run.rglob("*.tmp")]


# --- 3, 9: non-finite settings and weights -------------------------------------------------------------------


def test_every_number_of_the_settings_must_be_finite():
    floats = [f.name for f in fields(TrainConfig) if isinstance(getattr(TrainConfig(), f.name), float)]
    assert {"lr", "weight_decay", "grad_clip", "min_lr_ratio", "warmup_ratio", "val_fraction"} <= set(floats)
    for name in floats:
        for bad in (math.nan, math.inf):
            probs = replace(TrainConfig(), **{name: bad}).problems()
            assert f"--{name.replace('_', '-')} must be a finite number, not {bad}" in probs, name


@pytest.mark.parametrize("kind", KINDS)
def test_a_learning_rate_of_nan_is_refused_before_anything_is_written(data, tmp_path, kind):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="--lr must be a finite number, not nan"):
        train(str(data[1]), str(out), replace(KINDS[kind], lr=math.nan))
    assert not out.exists()


def poison_at(monkeypatch, module, at: int) -> None:
    """The optimizer `module` builds, made to leave a NaN in a weight at its update `at` (as an overflowing
    update would: the loss and gradient before it were finite)."""
    real = module.make_optimizer

    def make(*a, **k):
        opt = real(*a, **k)
        step, done = opt.step, [0]

        def poisoned(self, *sa, **sk):
            out = step(*sa, **sk)
            done[0] += 1
            if done[0] == at:
                with torch.no_grad():
                    opt.param_groups[0]["params"][0].view(-1)[0] = math.nan
            return out

        opt.step = types.MethodType(poisoned, opt)  # a bound method, as the schedule wraps it
        return opt

    monkeypatch.setattr(module, "make_optimizer", make)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_that_stop_being_finite_are_named_with_their_step_and_never_saved(
    data, tmp_path, kind, monkeypatch
):
    """An update that leaves a weight non-finite stops the run at that step, naming it and its learning rate,
    before a checkpoint (every step here) or final/ holds it; the last good checkpoint is the one before."""
    import specdraft.train.block.run as block_run
    import specdraft.train.loop as loop

    poison_at(monkeypatch, block_run if kind == "dflash" else loop, 2)
    out = tmp_path / "run"
    good = out / "checkpoints" / ("step_1" if kind == "dflash" else "step_00000001")
    with pytest.raises(NonFiniteError, match=rf"the weights stopped being finite at the update of step 2 \(learning "
                                             rf"rate [0-9.e+-]+\); that step was not saved, last good checkpoint: "
                                             rf"{good}. Lower --lr"):  # fmt: skip
        train(str(data[1]), str(out), replace(KINDS[kind], max_steps=3))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [good.name]
    assert not (out / "final").exists()


@pytest.mark.parametrize("lr", [1e30, 2.0])
def test_a_learning_rate_above_one_is_refused(data, tmp_path, lr):
    """--lr 1e30 (item 9) trained weights of 1e30 into a checkpoint, then a NaN loss blamed on the data; 1e39
    overflowed inside AdamW: refused, with the recipe's rate."""
    with pytest.raises(
        ValueError, match=rf"--lr must be in \(0, 1\], not {re.escape(str(lr))}: the recipe's is 1e-3"
    ):
        train(str(data[1]), str(tmp_path / "run"), replace(E3, lr=lr))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_negative_seed_trains(data, tmp_path, kind):
    """--seed -1 (item 9): every generator seeded from it takes a negative seed; the run is reproducible."""
    a = train(str(data[1]), str(tmp_path / "a"), replace(KINDS[kind], seed=-1, max_steps=1))
    b = train(str(data[1]), str(tmp_path / "b"), replace(KINDS[kind], seed=-1, max_steps=1))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_non_finite_values_written_into_a_shard_are_named_by_verify_and_train(data, tmp_path):
    """NaN and Inf written into a shard's hidden states (item 9): verify names the shard; train refuses it
    before a step, naming it with the fix, and writes no checkpoint."""
    from safetensors.torch import load_file, save_file

    from specdraft.data.store import verify

    x = copy(data[1], tmp_path / "x")
    shard = sorted(x.glob("shard-*.safetensors"))[0]
    t = load_file(shard)
    key = next(k for k in t if k.endswith(".hidden"))
    t[key][0, 0, 0], t[key][1, 0, 0] = math.nan, math.inf
    save_file(t, shard)
    problems = verify([str(x)])
    assert problems and all(shard.name in p for p in problems), problems
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=shard.name):
        train(str(x), str(out), E3)
    assert not list(out.rglob("step_*"))


# --- 4: a finished run resumed with a lower --max-steps ----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_a_finished_run_with_fewer_steps_keeps_its_step(finished, data, tmp_path, kind):
    run = copy(finished[kind], tmp_path / "run")
    weights = (run / "final" / "model.safetensors").read_bytes()
    train(str(data[1]), str(run), replace(KINDS[kind], resume=True, max_steps=1))
    meta = json.loads((run / "final" / "config.json").read_text())["train"]
    assert meta.get("steps", meta.get("step")) == 2
    assert vals(run) == [0, 2]
    assert (run / "final" / "model.safetensors").read_bytes() == weights


# --- 5: --ttt-steps bounded by the data ---------------------------------------------------------------------------


def test_ttt_steps_past_the_longest_sample_are_refused_before_anything_loads(data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"--ttt-steps 100000 is longer than any sample can unroll: the longest "
                                         r"sample has 64 tokens .* lower --ttt-steps to at most 62"):  # fmt: skip
        train(str(data[1]), str(out), replace(E3, ttt_steps=100000))
    assert not out.exists()
    train(str(data[1]), str(out), replace(E3, ttt_steps=62, max_steps=1))  # the bound itself trains


# --- 6: a resume counts the checkpoints already in OUT ----------------------------------------------------------


def test_the_disk_check_of_a_resume_counts_the_checkpoints_already_in_out(finished, tmp_path, monkeypatch):
    """What a resume needs is what a fresh run needs less the checkpoints OUT already holds (they are among the
    --keep-checkpoints kept): free space between the two passes a resume and refuses a fresh run."""
    import specdraft.train.loop as loop

    run = finished["eagle3"]
    held = sum(
        f.stat().st_size for f in (run / "checkpoints").rglob("*") if f.is_file() and f.name != "latest"
    )
    assert held > 0
    n, keep = 10**6, 2

    def with_free(free):
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 50, 0, free))

    with_free(0)
    with pytest.raises(OSError) as e:
        loop._check_disk(tmp_path, n, keep)
    fresh = float(str(e.value).split("~")[1].split(" MiB")[0]) * 2**20
    with_free(int(fresh) - held // 2)
    loop._check_disk(run, n, keep)  # fits: the checkpoints are there already
    with pytest.raises(OSError, match="train needs ~"):
        loop._check_disk(tmp_path, n, keep)


# --- 7: a refused train or extract creates nothing ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_train_creates_no_out_and_no_lock(data, tmp_path, kind):
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match=r"--lr must be in \(0, 1\], not -1.0"):
        train(str(data[1]), str(out), replace(KINDS[kind], lr=-1.0))
    with pytest.raises(
        ValueError, match="--draft-layers must be at least 1, not 0"
    ):  # item 8: the option named
        train(str(data[1]), str(out), replace(KINDS[kind], draft_layers=0))
    empty = copy(data[1], tmp_path / "x")
    man = next(empty.glob("manifest-*.json"))
    man.write_text("{}")
    with pytest.raises(ValueError) as e:
        train(str(empty), str(out), KINDS[kind])
    assert f"{man} cannot be read (it lacks 'kind', 'extraction_id'): delete it and rerun" in str(e.value)
    assert "specdraft ?" not in str(e.value)
    assert not (tmp_path / "new").exists()


def test_a_refused_extract_creates_no_out_and_no_lock(data, tmp_path, tiny_llama_dir):
    from specdraft.capture.extract import extract

    out = tmp_path / "new" / "x"
    with pytest.raises(ValueError, match="99"):
        extract(str(data[0]), str(out), target=str(tiny_llama_dir), layers=[99, 100, 101], skip_doctor=True)
    assert not (tmp_path / "new").exists()
    x = copy(data[1], tmp_path / "x")
    man = next(x.glob("manifest-*.json"))
    man.write_text("{}")
    before = tree(x)
    with pytest.raises(ValueError, match=rf"{man} cannot be read \(it lacks 'kind', 'extraction_id'\)"):
        extract(str(data[0]), str(x), target=str(tiny_llama_dir), samples_per_shard=12, skip_doctor=True, store_dtype="float32")  # fmt: skip
    assert tree(x) == before


# --- 8: messages ----------------------------------------------------------------------------------------------------


def test_a_nearly_full_disk_shows_the_extractions_shortfall_in_a_unit_that_shows_it(data, tmp_path, tiny_llama_dir,
                                                                                   monkeypatch):  # fmt: skip
    from specdraft.capture.extract import extract
    from specdraft.fileio import size_text

    assert [size_text(b) for b in (300, 5 << 20, 3 << 29, 1 << 45)] == ["0.29 KiB", "5.00 MiB", "1.50 GiB", "32.00 TiB"]  # fmt: skip
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1000))
    with pytest.raises(OSError) as e:
        extract(str(data[0]), str(tmp_path / "x"), target=str(tiny_llama_dir), skip_doctor=True, store_dtype="float32")  # fmt: skip
    msg = str(e.value)
    assert "0.00 GiB" not in msg and "but only 0.98 KiB are free (" in msg and " MiB short)" in msg, msg


def test_a_full_disk_mid_checkpoint_leaves_no_temporary(data, tmp_path, monkeypatch):
    import errno

    import safetensors.torch

    real = safetensors.torch.save_file

    def full(tensors, filename, metadata=None):
        if "step_00000002" in filename:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        train(str(data[1]), str(out), E3)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]

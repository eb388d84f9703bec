"""Nothing lost, nothing mixed (issue 28): every artefact is bound to its run. A shard copied in from another
extraction or renamed, a swapped parquet, a dataset rewritten under a finished extraction, an extraction
from before the binding are refused naming the file and the fix; train refuses missing samples unless
--allow-partial; its disk check counts final/ and a full disk at the end names the path. Tiny random Llama,
hf backend."""

from __future__ import annotations

import errno
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import CHATML, build_tokenizer, conversations, tiny_config, write_jsonl

from specdraft.capture.extract import extract
from specdraft.data.prepare import DATASET_FILE, load_dataset, prepare
from specdraft.data.store import ShardError, ShardSet, verify
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

CFG = TrainConfig(draft_vocab_size=64, ttt_steps=2, epochs=1, max_steps=2, max_tokens=512, checkpoint_every=1,
                  val_fraction=0.0, val_every=0, progress=False, prefetch=False, tensorboard=False)  # fmt: skip
MAN = "manifest-00000-of-00001.json"
REDO = "rerun `specdraft extract` with the same command to redo it"


@pytest.fixture(scope="module")
def ds(tmp_path_factory, tiny_llama_dir) -> Path:
    d = tmp_path_factory.mktemp("binding")
    src = write_jsonl(d / "c.jsonl", conversations(16, seed=5))
    return prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=96)


def run_extract(ds: Path, out: Path, target: Path, **kw) -> Path:
    return extract(str(ds), str(out), target=str(target), samples_per_shard=4, skip_doctor=True, **kw)


@pytest.fixture(scope="module")
def runs(ds, tiny_llama_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two finished extractions of one dataset with other aux layers: same sample ids, lengths and shapes."""
    d = tmp_path_factory.mktemp("runs")
    return run_extract(ds, d / "a", tiny_llama_dir), run_extract(
        ds, d / "b", tiny_llama_dir, layers=[1, 3, 4]
    )


def copy_shard(src: Path, dst: Path, stem: str, as_stem: str = "") -> None:
    for ext in (".safetensors", ".json"):
        shutil.copy(src / f"{stem}{ext}", dst / f"{as_stem or stem}{ext}")


def edit_manifest(d: Path, **changes) -> None:
    man = json.loads((d / MAN).read_text())
    for k, v in changes.items():
        if v is None:
            del man[k]
        else:
            man[k] = v
    (d / MAN).write_text(json.dumps(man))


def test_a_shard_copied_in_from_another_extraction_is_refused(tmp_path, ds, runs, tiny_llama_dir):
    a, b = runs
    x = tmp_path / "x"
    shutil.copytree(a, x)
    train(str(x), str(tmp_path / "t"), CFG)  # a run started on the right data, resumed below
    stem = "shard-00000-00001"
    copy_shard(b, x, stem)
    assert (
        json.loads((x / f"{stem}.json").read_text())["samples"]
        == json.loads((a / f"{stem}.json").read_text())["samples"]
    )
    probs = verify([str(x)])
    assert len(probs) == 1 and probs[0].startswith(f"{stem}.safetensors: copied in from another extraction (its "
                                                   "sidecar records extraction "), probs  # fmt: skip
    fix = f"delete {x / stem}.safetensors and {x / stem}.json, then {REDO}"
    with pytest.raises(ShardError) as e:
        train(str(x), str(tmp_path / "t2"), CFG)
    assert str(e.value).startswith(f"{x / stem}.safetensors: copied in from another extraction") and str(
        e.value
    ).endswith(fix)
    with pytest.raises(ShardError, match="copied in from another extraction"):
        train(str(x), str(tmp_path / "t"), replace(CFG, max_steps=3, resume=True))
    # extract: the run is complete, and then a resume of it: both refuse the shard, naming it
    for state in ("complete", "resume"):
        if state == "resume":
            edit_manifest(x, complete=False)
            (x / "shard-00000-00002.json").unlink()
        with pytest.raises(ValueError) as e:
            run_extract(ds, x, tiny_llama_dir)
        assert str(e.value).startswith(f"extract: {x / stem}.json copied in from another extraction")
        assert str(e.value).endswith(fix)
    # the fix given works
    (x / f"{stem}.json").unlink()
    (x / f"{stem}.safetensors").unlink()
    run_extract(ds, x, tiny_llama_dir)
    assert verify([str(x)]) == []


def test_a_shard_replaced_by_another_of_its_run_is_refused(tmp_path, runs, capsys):
    a, _ = runs
    x = tmp_path / "x"
    shutil.copytree(a, x)
    copy_shard(a, x, "shard-00000-00002", as_stem="shard-00000-00001")  # other ids under shard 1's name
    probs = verify([str(x)])
    assert (
        "shard-00000-00001.safetensors: holds shard shard-00000-00002 of this extraction under another name"
        in probs
    )
    assert any(p.startswith("4 samples missing") for p in probs), probs
    with pytest.raises(ShardError, match="under another name"):
        train(str(x), str(tmp_path / "t"), CFG)
    with pytest.raises(ValueError) as e:  # left out with --skip-bad: its 4 samples are still missing
        train(str(x), str(tmp_path / "t"), replace(CFG, skip_bad=True))
    n = ShardSet.open(a).manifest["num_samples"]
    assert str(e.value).startswith(f"train: {x} lacks 4 of the extraction's {n} samples (shards lost): ")
    # a run killed mid-way (not complete, a shard not written yet) is refused the same way
    y = tmp_path / "y"
    shutil.copytree(a, y)
    edit_manifest(y, complete=False)
    for ext in (".safetensors", ".json"):
        (y / f"shard-00000-00003{ext}").unlink()
    with pytest.raises(
        ValueError, match=rf"lacks 4 of the extraction's {n} samples \(process\(es\) \[0\] not finished\)"
    ):
        train(str(y), str(tmp_path / "t"), CFG)


def test_one_process_of_two_is_refused_unless_allow_partial(tmp_path, ds, tiny_llama_dir, capsys):
    p0 = run_extract(ds, tmp_path / "p0", tiny_llama_dir, num_shards=2, shard_index=0)
    n = len(load_dataset(ds))
    have = len(ShardSet.open(p0).sample_ids())
    assert have == (n + 1) // 2
    with pytest.raises(ValueError) as e:
        train(str(p0), str(tmp_path / "t"), CFG)
    assert str(e.value) == (
        f"train: {p0} lacks {n - have} of the extraction's {n} samples (no output of processes [1] of --num-shards "
        "2): finish the extraction (rerun `specdraft extract`; `specdraft verify` lists what is missing) and pass "
        f"every process's directory, or pass --allow-partial to train on the {have} there"
    )
    capsys.readouterr()
    train(str(p0), str(tmp_path / "t"), replace(CFG, allow_partial=True))
    out = capsys.readouterr().out
    assert f"train: warning: --allow-partial: {p0} lacks {n - have} of the extraction's {n} samples" in out
    assert f"training on the {have} there" in out


def test_a_swapped_parquet_is_refused(tmp_path, ds, tiny_llama_dir):
    other = prepare(str(write_jsonl(tmp_path / "o.jsonl", conversations(9, seed=9))), str(tmp_path / "other"),
                    target=str(tiny_llama_dir), max_length=96)  # fmt: skip
    y = tmp_path / "ds"
    shutil.copytree(ds, y)
    shutil.copy(other / DATASET_FILE, y / DATASET_FILE)  # 9 rows of other data; the manifest says 16
    with pytest.raises(ValueError) as e:
        run_extract(y, tmp_path / "x", tiny_llama_dir)
    n = len(load_dataset(ds))
    assert str(e.value).startswith(
        f"{y / DATASET_FILE} does not match its manifest.json (9 rows, content hash "
    )
    assert f"the manifest says {n} rows" in str(e.value)
    assert str(e.value).endswith(f"it was replaced or partly written; rerun `specdraft prepare` into {y}")
    assert not (tmp_path / "x").exists()


def test_prepare_rerun_with_other_data_under_a_finished_extraction(tmp_path, tiny_llama_dir):
    def prep(seed: int, **kw) -> Path:
        src = write_jsonl(tmp_path / f"c{seed}.jsonl", conversations(12, seed=seed))
        return prepare(str(src), str(tmp_path / "ds"), target=str(tiny_llama_dir), max_length=96, **kw)

    ds = prep(6)
    assert prep(6) == ds  # the same data again: nothing changes, accepted
    hs = run_extract(ds, tmp_path / "hs", tiny_llama_dir)
    with pytest.raises(ValueError) as e:
        prep(7)
    assert str(e.value).startswith(f"prepare: {ds} already holds another dataset (content hash ")
    assert str(e.value).endswith("pass --overwrite to replace it, or choose another OUT")
    assert verify([str(hs)]) == []  # untouched
    prep(7, overwrite=True)
    changed = f"{ds / DATASET_FILE} changed since these shards were extracted from it"
    with pytest.raises(ValueError) as e:
        train(str(hs), str(tmp_path / "t"), CFG)
    assert str(e.value).startswith(changed)
    assert str(e.value).endswith("restore that dataset, or extract the new one into a new directory")
    assert any(p.startswith(changed) for p in verify([str(hs)]))
    with pytest.raises(ValueError, match="holds another extraction: dataset_hash .* \\(the prepared dataset"):
        run_extract(ds, hs, tiny_llama_dir)


def test_an_extraction_from_before_the_binding_gets_one_line(tmp_path, ds, runs, tiny_llama_dir):
    x = tmp_path / "x"
    shutil.copytree(runs[0], x)
    edit_manifest(x, extraction_id=None)
    msg = "from before shards were bound to their extraction: extract again into a new directory"
    assert len(verify([str(x)])) == 1 and msg in verify([str(x)])[0]
    with pytest.raises(ValueError, match=msg):
        train(str(x), str(tmp_path / "t"), CFG)
    with pytest.raises(
        ValueError, match=f"extract: {x / MAN} is from specdraft .*, before shards were bound"
    ):
        run_extract(ds, x, tiny_llama_dir)


def test_resume_on_another_extraction_is_refused(tmp_path, runs):
    a, b = runs
    train(str(a), str(tmp_path / "t"), CFG)
    with pytest.raises(ValueError, match=r"was trained on other data \(extraction \["):
        train(str(b), str(tmp_path / "t"), replace(CFG, max_steps=3, resume=True))


# --- the disk ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """Shards of a tiny Llama whose vocabulary (20000) dwarfs the draft: final/, which keeps the frozen
    embedding, is most of what train writes."""
    import torch
    import transformers as tf

    d = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tiny_config("llama", vocab_size=20000)).save_pretrained(d / "target")
    build_tokenizer(CHATML).save_pretrained(d / "target")
    ds = prepare(str(write_jsonl(d / "c.jsonl", conversations(8, seed=3))), str(d / "ds"),
                 target=str(d / "target"), max_length=64)  # fmt: skip
    return run_extract(ds, d / "hs", d / "target")


def test_the_disk_check_counts_final(tmp_path, wide, monkeypatch):
    c = replace(CFG, keep_checkpoints=1)
    out = tmp_path / "a"
    train(str(wide), str(out), c)
    size = {
        k: sum(f.stat().st_size for f in (out / k).rglob("*") if f.is_file())
        for k in ("checkpoints", "final")
    }
    assert size["final"] > 4 * size["checkpoints"]  # the embedding: what the check left out
    written = size["final"] + size["checkpoints"]
    monkeypatch.setattr(
        "shutil.disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - written, written)
    )
    with pytest.raises(OSError) as e:
        train(str(wide), str(tmp_path / "b"), c)
    assert str(e.value).startswith(
        "train needs ~"
    ) and f" MiB in {tmp_path / 'b'}: 1 checkpoint(s) of ~" in str(e.value)
    assert f"and {tmp_path / 'b' / 'final'} of ~" in str(e.value)
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_a_full_disk_at_the_end_names_final_and_resume_finishes(tmp_path, runs, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file

    def full_at_final(tensors, filename, metadata=None):
        if "/.final." in filename:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    out = tmp_path / "t"
    monkeypatch.setattr(safetensors.torch, "save_file", full_at_final)
    with pytest.raises(OSError) as e:
        train(str(runs[0]), str(out), CFG)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out / "final")
    monkeypatch.undo()
    final = train(str(runs[0]), str(out), replace(CFG, resume=True))  # the last checkpoint is intact
    assert (final / "model.safetensors").exists()

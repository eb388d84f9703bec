"""The store's readers check what they read: missing, truncated, corrupted or non-finite shards are refused
naming the file and the fix (or skipped, counted, with skip_bad); fp8 shards are half of bf16 and
decode within e4m3's rounding. Stores here are written directly (no model), so these tests are fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.data.prepare import COUNTS_FILE, DATASET_FILE, MANIFEST_FILE, dataset_hash
from specdraft.data.store import (
    ShardError,
    ShardSet,
    bytes_per_token,
    estimate_bytes,
    extraction_id,
    plan_shards,
    shard_stem,
    verify,
    write_manifest,
    write_shard,
)

H = 32


def make_samples(n: int, seed: int = 0, h: int = H) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in range(n):
        T = 5 + 3 * s
        out[s] = {
            "input_ids": torch.randint(0, 300, (T,), generator=g),
            "loss_mask": torch.randint(0, 2, (T,), generator=g),
            "hidden": torch.randn(T, 4, h, generator=g)
            * torch.logspace(-2, 2, 4)[None, :, None],  # (T, 4, H)
        }
    return out


def fake_dataset(d: Path) -> Path:
    """The files of a prepared dataset (contents arbitrary: the store only hashes them and reads counts)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / DATASET_FILE).write_bytes(b"not really parquet")
    (d / COUNTS_FILE).write_bytes(b"counts")
    (d / MANIFEST_FILE).write_text("{}")
    return d


def bound_manifest(d: Path, n: int, dtype: str, h: int = H, **more) -> dict:
    """A manifest as extract writes it (the fields readers use), bound to a dataset beside `d`."""
    ds = fake_dataset(d.parent / f"{d.name}-ds")
    man = {"shard_index": 0, "num_shards": 1, "num_samples": n, "layer_ids": [1, 2, 3, 4],
           "target": {"hidden_size": h}, "dtype": dtype, "dataset_hash": dataset_hash(ds), "dataset": str(ds),
           **more}  # fmt: skip
    man["identity"] = {k: man[k] for k in ("num_samples", "dtype", "dataset_hash")}
    man["extraction_id"] = extraction_id(man["identity"])
    return man


def make_store(
    d: Path, dtype: str = "bfloat16", n: int = 12, per_shard: int = 3, complete: bool = True, h: int = H
) -> Path:
    """An extraction directory as extract writes it, from synthetic samples."""
    d.mkdir(parents=True, exist_ok=True)
    samples = make_samples(n, h=h)
    plan = plan_shards({s: int(v["input_ids"].shape[0]) for s, v in samples.items()}, per_shard)
    man = bound_manifest(d, n, dtype, h, num_planned_shards=len(plan), complete=complete)
    for k, sids in enumerate(plan):
        write_shard(d, shard_stem(0, k), {s: samples[s] for s in sids}, dtype, man["extraction_id"])
    write_manifest(d, man)
    return d


def shard_of(d: Path, k: int) -> tuple[Path, list[int]]:
    path = d / f"{shard_stem(0, k)}.safetensors"
    return path, json.loads(path.with_suffix(".json").read_text())["samples"]


def flip_byte(path: Path, at: int = -100) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def test_flipped_bytes_are_refused_on_load_naming_the_file(tmp_path):
    d = make_store(tmp_path / "x")
    bad, bad_sids = shard_of(d, 1)
    flip_byte(bad)  # same size: only the checksum tells
    ss = ShardSet.open(d)
    _, good = shard_of(d, 0)
    assert all(torch.isfinite(ss.load(s)["hidden"]).all() for s in good)
    with pytest.raises(ShardError) as e:
        ss.load(bad_sids[0])
    assert str(e.value) == (
        f"{bad}: checksum mismatch (file corrupted or modified): delete {bad.with_suffix('.json')} and rerun "
        "`specdraft extract` with the same command to redo it, or train with --skip-bad to leave its samples out"
    )
    assert verify([str(d)]) == [f"{bad.name}: checksum mismatch (file corrupted or modified)"]


def test_missing_sidecar_of_a_complete_extraction_is_refused_at_open(tmp_path):
    d = make_store(tmp_path / "x")
    side = d / f"{shard_stem(0, 2)}.json"
    side.unlink()
    with pytest.raises(ShardError) as e:
        ShardSet.open(d)
    assert str(e.value) == (
        f"{side}: sidecar missing (the manifest lists 4 shards): rerun `specdraft extract` with the same "
        "command to redo it, or train with --skip-bad --allow-partial to train without its samples"
    )
    assert any(p.startswith("3 samples missing") for p in verify([str(d)]))


def test_incomplete_extraction_opens_with_its_finished_shards(tmp_path):
    d = make_store(tmp_path / "x", complete=False)
    (d / f"{shard_stem(0, 2)}.json").unlink()  # not written yet: a run killed mid-way
    (d / f"{shard_stem(0, 2)}.safetensors").unlink()
    ss = ShardSet.open(d)
    assert len(ss.sample_ids()) == 9
    for s in ss.sample_ids():
        ss.load(s)


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_truncated_or_missing_shard_is_refused_at_open(tmp_path, how):
    d = make_store(tmp_path / "x")
    path, _ = shard_of(d, 3)
    size = path.stat().st_size
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:50])
        problem = f"size 50 != {size} recorded (truncated or partly written)"
    else:
        path.unlink()
        problem = "shard file missing (its sidecar lists 3 samples)"
    with pytest.raises(ShardError) as e:
        ShardSet.open(d)
    fix = "rerun `specdraft extract` with the same command to redo it"
    if how != "truncated":  # its sidecar still lists its samples: --skip-bad leaves them out
        fix += ", or train with --skip-bad to leave its samples out"
    assert str(e.value) == f"{path}: {problem}: {fix}"


def test_non_finite_values_and_wrong_shapes_are_refused_on_load(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    samples = make_samples(2)
    samples[1]["hidden"][2, 1, 3] = float("inf")
    man = bound_manifest(d, 2, "float32", num_planned_shards=1, complete=True)
    write_shard(d, shard_stem(0, 0), samples, "float32", man["extraction_id"])
    write_manifest(d, man)
    ss = ShardSet.open(d)
    ss.load(0)
    with pytest.raises(ShardError, match=r"shard-00000-00000.safetensors: 1.hidden has 1 non-finite values: its "
                       r"checksum matches, so the target produced them"):  # fmt: skip
        ss.load(1)
    write_manifest(
        d, {**man, "target": {"hidden_size": H + 1}}
    )  # shards of another model than the manifest's
    with pytest.raises(
        ShardError, match=rf"0.hidden is \(5, 4, {H}\) torch.float32, expected \(5, 4, {H + 1}\)"
    ):
        ShardSet.open(d).load(0)


def test_checksum_is_verified_once_per_shard_per_process(tmp_path, monkeypatch):
    import specdraft.data.store as store

    d = make_store(tmp_path / "x")
    calls = []
    real = store.sha256_file
    monkeypatch.setattr(store, "sha256_file", lambda p: calls.append(p) or real(p))
    ss = ShardSet.open(d)
    for _ in range(2):
        for s in ss.sample_ids():
            ss.load(s)
    assert len(calls) == 4 and len(set(calls)) == 4


def test_skip_bad_leaves_bad_shards_out_loudly(tmp_path, capsys):
    d = make_store(tmp_path / "x")
    flipped, flipped_sids = shard_of(d, 1)
    flip_byte(flipped)
    cut, cut_sids = shard_of(d, 2)
    cut.write_bytes(cut.read_bytes()[:-10])
    ss = ShardSet.open(d, skip_bad=True)
    out = capsys.readouterr().out
    assert out.startswith("specdraft: warning: skipping 2 bad shard(s), 6 samples: ")
    assert f"{flipped.name} (checksum mismatch" in out and f"{cut.name} (size " in out
    assert set(ss.skipped) == {str(flipped), str(cut)}
    assert set(ss.sample_ids()) == set(range(12)) - set(flipped_sids) - set(cut_sids)
    for s in ss.sample_ids():
        ss.load(s)
    assert ShardSet.open(make_store(tmp_path / "y"), skip_bad=True).skipped == {}
    assert capsys.readouterr().out == ""


def test_fp8_shards_are_half_of_bf16_and_decode_within_e4m3_rounding(tmp_path):
    h = 576  # SmolLM2's width: the per-token scales (4 float32) are small next to the values
    bf, f8 = make_store(tmp_path / "bf16", h=h), make_store(tmp_path / "fp8", dtype="fp8", h=h)
    assert verify([str(f8)]) == [] and verify([str(bf)]) == []
    src = make_samples(12, h=h)
    for k in range(4):
        (a_path, sids), b_path = shard_of(bf, k), shard_of(f8, k)[0]
        a, b = a_path.stat().st_size, b_path.stat().st_size
        tokens = sum(int(src[s]["input_ids"].shape[0]) for s in sids)
        assert b <= 0.5 * a + tokens * 4 * 4 + 1024, (k, a, b)  # half, plus the scales and a longer header
        assert b <= 0.51 * a, (k, a, b)
    tokens = sum(int(v["input_ids"].shape[0]) for v in src.values())
    written = sum(p.stat().st_size for p in f8.glob("shard-*.safetensors"))
    assert written <= estimate_bytes(tokens, 4, h, "fp8") < 0.51 * estimate_bytes(tokens, 4, h, "bfloat16")
    assert bytes_per_token(4, h, "fp8") == 4 * h + 4 * 4 + 5
    ss = ShardSet.open(f8)
    for s in ss.sample_ids():
        got, x = ss.load(s), src[s]["hidden"]
        assert got["hidden"].dtype == torch.float32 and got["hidden"].shape == x.shape
        scale = x.abs().amax(-1, keepdim=True) / 448  # (T, 4, 1)
        normal = x.abs() >= scale * 2**-6
        err = (got["hidden"] - x).abs()
        assert (err[normal] <= x.abs()[normal] * 2**-4).all()
        assert (err[~normal] <= (scale * 2**-9).expand_as(x)[~normal] + 1e-12).all()
        assert torch.equal(got["input_ids"], src[s]["input_ids"])
    # a corrupted value or scale is caught like any other byte
    path, sids = shard_of(f8, 0)
    flip_byte(path)
    with pytest.raises(ShardError, match="checksum mismatch"):
        ShardSet.open(f8).load(sids[0])

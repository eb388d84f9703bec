"""`train --draft dflash --online`: a prepared dataset captured from the target batch by batch trains the draft
an extraction of the same layers trains (same losses, same weights); the layer set is --layers, any number."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import conversations, write_jsonl

from specdraft.model.dflash_files import load_dflash
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

LAYERS = [1, 3, 5, 6]  # 4 aux layers (not EAGLE-3's 3), then the final layer 8 (captured too, as offline)


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_llama_dir):
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("dflash-online")
    src = write_jsonl(d / "c.jsonl", conversations(16, seed=5))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=96)
    shards = extract(str(ds), str(d / "shards"), target=str(tiny_llama_dir), samples_per_shard=8, layers=LAYERS,
                     max_tokens_per_batch=512, skip_doctor=True, store_dtype="float32")  # fmt: skip
    return ds, shards


def cfg(**kw) -> TrainConfig:
    base = dict(draft="dflash", draft_vocab_size=128, block_size=4, anchors=8, max_tokens=400, max_length=96,
                epochs=1, max_steps=3, lr=3e-3, warmup_ratio=0.1, val_fraction=0.15, checkpoint_every=10,
                recipe="off", progress=False, tensorboard=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_online_trains_the_draft_the_extraction_trains(data, tmp_path, tiny_llama_dir):
    ds, shards = data
    off = train(str(shards), str(tmp_path / "off"), cfg())
    on = train(str(ds), str(tmp_path / "on"), cfg(online=True, layers=LAYERS, target=str(tiny_llama_dir)))
    a, b = load_dflash(off), load_dflash(on)
    assert b.cfg.aux_layer_ids == LAYERS and b.cfg.target_name == a.cfg.target_name
    la, lb = ([(r["split"], r["step"], r["loss"]) for r in _records(tmp_path / d)] for d in ("off", "on"))
    assert [x[:2] for x in la] == [x[:2] for x in lb] and len(la) >= 4  # 3 train steps, validation
    assert [x[2] for x in lb] == pytest.approx([x[2] for x in la], rel=1e-4, abs=1e-5)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3, msg=k)


def test_online_resumes_exactly_and_the_default_layers_are_eagle3s(data, tmp_path, tiny_llama_dir):
    from specdraft.train.block.run import train_dflash

    ds, _ = data
    c = cfg(online=True, target=str(tiny_llama_dir))
    a = load_dflash(train_dflash(str(ds), tmp_path / "a", c))
    assert a.cfg.aux_layer_ids == [2, 4, 5]  # 8 layers: 2, L//2, L-3
    train_dflash(str(ds), tmp_path / "b", c, _stop_at=2)
    b = load_dflash(train_dflash(str(ds), tmp_path / "b", replace(c, resume=True)))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_online_is_refused_without_a_dataset_with_the_fix(data, tmp_path, tiny_llama_dir):
    _, shards = data  # an extraction where a prepared dataset is wanted
    with pytest.raises((ValueError, FileNotFoundError), match="prepare|dataset"):
        train(str(shards), str(tmp_path / "x"), cfg(online=True, target=str(tiny_llama_dir)))

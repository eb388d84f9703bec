"""Rough edges of the trainer's results: --ema at few steps holds the steps' weights (not the random init);
--steps-per-batch N counts each step's share of its batch's tokens in the metrics. Tiny random Llama."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import conversations, write_jsonl

import specdraft.train.setup as setup
from specdraft.model.checkpoint import load_draft
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

TRAINED = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
           "lm_head.weight")  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_llama_dir):
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("rough-edges")
    ds = prepare(str(write_jsonl(d / "c.jsonl", conversations(32, seed=3))), str(d / "ds"),
                 target=str(tiny_llama_dir), max_length=96)  # fmt: skip
    return extract(str(ds), str(d / "hs"), target=str(tiny_llama_dir), samples_per_shard=16, skip_doctor=True)


def cfg(**kw) -> TrainConfig:
    base = dict(draft_vocab_size=64, ttt_steps=2, max_tokens=512, max_length=96, epochs=1, lr=3e-3,
                warmup_ratio=0.0, val_fraction=0.0, checkpoint_every=100, progress=False, tensorboard=False)  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def train_records(out) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == "train"]


def _dist(a: dict, b: dict) -> float:
    """The L2 distance of two drafts over their trained weights."""
    return float(sum(((a[k] - b[k]).double() ** 2).sum() for k in TRAINED) ** 0.5)


def test_ema_after_few_steps_holds_the_steps_weights_not_the_init(tmp_path, shards):
    """--ema 0.99 over 4 steps: final/ is the (bias-corrected) average of the 4 steps' weights: near the
    last steps', far from the random init (a fixed decay from the init left it 0.99**4 = 96% of the init)."""
    c = cfg(max_steps=4, checkpoint_every=1, keep_checkpoints=5, ema=0.99)
    final = load_draft(train(str(shards), str(tmp_path / "e"), c)).state_dict()
    init = setup._setup(str(shards), c, torch.device("cpu")).draft.state_dict()
    last = load_draft(tmp_path / "e" / "checkpoints" / "step_00000004").state_dict()  # the raw step-4 weights
    travelled = _dist(last, init)
    assert travelled > 1e-3
    assert _dist(final, last) < 0.5 * travelled, (_dist(final, last), travelled)
    assert _dist(final, init) > 2 * _dist(final, last), (_dist(final, init), _dist(final, last))


def test_steps_per_batch_every_step_counts_its_share_of_the_batch_tokens(tmp_path, shards):
    """--steps-per-batch 2: every step's record has tokens/s > 0 and a real pad share, and the two steps of
    a batch record tokens that add up to the batch's (the tokens of the same step at --steps-per-batch 1)."""
    train(str(shards), str(tmp_path / "one"), cfg(max_steps=3))
    train(str(shards), str(tmp_path / "two"), cfg(max_steps=6, steps_per_batch=2))
    one, two = train_records(tmp_path / "one"), train_records(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3, 4, 5, 6]
    for r in two:
        assert r["tokens_per_s"] > 0 and 0 <= r["pad_share"] < 1 and r["tokens"] > 0, r
    assert [a["tokens"] + b["tokens"] for a, b in zip(two[::2], two[1::2])] == [r["tokens"] for r in one]
    for a, b, r in zip(
        two[::2], two[1::2], one
    ):  # each share of the batch: about half its tokens and padding
        assert abs(a["tokens"] - b["tokens"]) <= 1
        assert a["pad_share"] == pytest.approx(r["pad_share"], abs=0.01)

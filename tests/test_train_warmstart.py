"""train --init-from: a new run on other data starts from a trained draft (its weights and its draft vocabulary,
not the new data's), records where it started, and refuses settings or data the draft cannot take, with the
fix. Tiny random Llama."""

from __future__ import annotations

import json
import types

import pytest
import torch
from conftest import CORPUS, write_jsonl
from test_train_rough_edges import TRAINED, _dist, cfg, shards  # noqa: F401  (the module's fixture)

from specdraft.model.checkpoint import load_draft
from specdraft.train.loop import train
from specdraft.train.setup import warm_draft


@pytest.fixture(scope="module")
def other_shards(tmp_path_factory, tiny_llama_dir):
    """Other conversations, same target: token counts that pick another draft vocabulary."""
    import random

    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    rng, words = (
        random.Random(11),
        (CORPUS[1] + " " + CORPUS[2]).split(),
    )  # replies in other words than `shards`'
    convs = [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=6))},
                           {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(8, 30)))}]}
             for _ in range(24)]  # fmt: skip
    d = tmp_path_factory.mktemp("warmstart")
    ds = prepare(str(write_jsonl(d / "c.jsonl", convs)), str(d / "ds"),
                 target=str(tiny_llama_dir), max_length=96)  # fmt: skip
    return extract(str(ds), str(d / "hs"), target=str(tiny_llama_dir), samples_per_shard=16, skip_doctor=True)


@pytest.fixture(scope="module")
def first(tmp_path_factory, shards):  # noqa: F811
    out = tmp_path_factory.mktemp("first") / "run"
    train(str(shards), str(out), cfg(max_steps=4))
    return out


def test_a_warm_run_starts_from_the_drafts_weights_and_vocabulary(tmp_path, first, other_shards):
    a = load_draft(first / "final").state_dict()
    # a learning rate of ~0 keeps every weight where the run started
    warm = train(str(other_shards), str(tmp_path / "warm"), cfg(max_steps=2, lr=1e-12, init_from=str(first)))
    cold = train(str(other_shards), str(tmp_path / "cold"), cfg(max_steps=2, lr=1e-12))
    w, c = load_draft(warm).state_dict(), load_draft(cold).state_dict()
    assert not torch.equal(c["d2t"], a["d2t"]), (
        "the other data must pick another vocabulary for this to test it"
    )
    assert torch.equal(w["d2t"], a["d2t"]) and torch.equal(w["t2d"], a["t2d"])
    assert _dist(w, a) < 1e-5 < _dist(c, a)
    for k in TRAINED:
        torch.testing.assert_close(w[k], a[k], rtol=0, atol=1e-6)
    info = json.loads((warm / "config.json").read_text())["train"]
    assert info["init_from"] == str(first / "final")


def test_a_warm_run_trains_on(tmp_path, first, other_shards):
    a = load_draft(first / "final").state_dict()
    w = load_draft(
        train(str(other_shards), str(tmp_path / "w"), cfg(max_steps=3, init_from=str(first)))
    ).state_dict()
    assert _dist(w, a) > 1e-3


def test_settings_the_draft_cannot_take_are_named_at_once_with_their_fix(tmp_path, first, other_shards):
    with pytest.raises(ValueError) as e:
        train(str(other_shards), str(tmp_path / "x"),
              cfg(init_from=str(first), draft_vocab_size=32, norm_before_residual=True))  # fmt: skip
    msg = str(e.value)
    assert "--draft-vocab-size 64" in msg and "--no-norm-before-residual" in msg
    assert not (tmp_path / "x").exists()  # refused before anything ran (no OUT, no lock: issue 60)
    with pytest.raises(ValueError, match="no saved draft there"):
        train(str(other_shards), str(tmp_path / "y"), cfg(init_from=str(tmp_path / "nothing")))


def test_a_draft_of_another_target_or_other_layers_is_refused(first):
    d = load_draft(first / "final")
    ok = types.SimpleNamespace(config_hash=d.cfg.target_config_hash, hidden_size=d.cfg.hidden_size,
                               vocab_size=d.cfg.vocab_size)  # fmt: skip
    layers = list(d.cfg.aux_layer_ids)
    warm_draft(str(first), ok, layers)  # the draft's own target and layers load
    other = types.SimpleNamespace(**{**vars(ok), "config_hash": "0123456789abcdef"})
    with pytest.raises(ValueError) as e:  # another target: no --layers fix (it could not work)
        warm_draft(str(first), other, [layers[0], layers[1], layers[2] - 1])
    assert "is a draft for another target" in str(e.value) and "--layers" not in str(e.value)
    with pytest.raises(ValueError) as e:  # the same target, other layers: extract with the draft's
        warm_draft(str(first), ok, [layers[0], layers[1], layers[2] - 1])
    assert f"extract the data again with --layers {' '.join(map(str, layers))}" in str(e.value)

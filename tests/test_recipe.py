"""train --recipe: the small-run recipe (measured best along the scaling curve) is what a run on small data gets
when none of its settings is given; given settings, large data or `--recipe off` keep the library defaults."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_train_rough_edges import shards  # noqa: F401  (the module's fixture)

from specdraft.train.config import SMALL_RUN, SMALL_RUN_BELOW, TrainConfig, with_recipe
from specdraft.train.loop import train

DEFAULTS = TrainConfig()


def test_auto_applies_the_recipe_to_small_data_when_none_of_it_is_given():
    got, said = with_recipe(DEFAULTS, 80_000)
    assert {k: getattr(got, k) for k in SMALL_RUN} == SMALL_RUN
    assert "80,000 scored tokens" in said and "--lr 0.001" in said and "--prompt-loss" in said
    assert got.recipe == "auto" and replace(got, **{k: getattr(DEFAULTS, k) for k in SMALL_RUN}) == DEFAULTS


@pytest.mark.parametrize("case", ["large data", "set from Python", "off"])
def test_otherwise_the_settings_are_kept_as_given(case):
    cfg, scored = {
        "large data": (DEFAULTS, SMALL_RUN_BELOW),
        "set from Python": (replace(DEFAULTS, lr=3e-4), 80_000),  # no command line: a caller tuning
        "off": (replace(DEFAULTS, recipe="off"), 80_000),
    }[case]
    assert with_recipe(cfg, scored) == (cfg, "")


def test_auto_fills_in_what_was_not_given_and_says_which_came_from_where(monkeypatch):
    """--lr alone no longer switches the recipe off: the other eight settings are still the recipe's."""
    from specdraft import runtime

    monkeypatch.setattr(runtime, "GIVEN", {"lr": "command line", "decay": "--config run.json"})
    monkeypatch.setattr(runtime, "FROM_COMMAND_LINE", True)
    got, said = with_recipe(replace(DEFAULTS, lr=3e-4, decay=0.8), 80_000)
    assert got.lr == 3e-4 and got.decay == 0.8  # given, even at the library's value
    assert {k: getattr(got, k) for k in SMALL_RUN if k not in ("lr", "decay")} == {
        k: v for k, v in SMALL_RUN.items() if k not in ("lr", "decay")
    }
    assert said.startswith("train: settings from the small-run recipe (80,000 scored tokens")
    assert "command line: --lr 0.0003" in said and "--config run.json: --decay 0.8" in said
    assert "--max-tokens 512" in said and "--lr 0.001" not in said


def test_on_fills_in_what_was_not_given_at_any_size_and_leaves_ema_out_under_fsdp():
    got, said = with_recipe(replace(DEFAULTS, recipe="on", lr=3e-4, fsdp=True), 10**9)
    assert got.lr == 3e-4 and got.max_tokens == 512 and got.prompt_loss and got.steps_per_batch == 2
    assert (
        got.ema == 0.0 and "--recipe on" in said and "--lr 0.001" not in said and "given: --lr 0.0003" in said
    )


def test_a_draft_served_at_t1_trains_with_the_nla_loss_unless_a_loss_is_given(monkeypatch):
    """--serve-temperature 1 (or more): the recipe's loss is NLA (measured best at T = 1); below 1, or not said, the
    draft's own soft KL; a --loss given wins; a DFlash draft keeps its own recipe."""
    from specdraft import runtime

    for t in (1.0, 1.5):
        got, said = with_recipe(replace(DEFAULTS, serve_temperature=t), 80_000)
        assert got.loss == "nla" and f"served at T={t:g}: the NLA loss" in said and "--loss nla" in said
    for t in (-1.0, 0.0, 0.7):
        got, said = with_recipe(replace(DEFAULTS, serve_temperature=t), 80_000)
        assert got.loss == "" and "--loss" not in said
    monkeypatch.setattr(runtime, "GIVEN", {"loss": "command line"})
    monkeypatch.setattr(runtime, "FROM_COMMAND_LINE", True)
    got, said = with_recipe(replace(DEFAULTS, serve_temperature=1.0, loss="kl"), 80_000)
    assert got.loss == "kl" and "command line: --loss kl" in said
    assert "--serve-temperature must be -1" in " ".join(replace(DEFAULTS, serve_temperature=3.0).problems())


def test_a_run_on_small_data_trains_with_the_recipe_and_says_so(tmp_path, shards, capsys):  # noqa: F811
    base = dict(draft_vocab_size=64, ttt_steps=2, max_length=96, max_steps=2, val_fraction=0.0, progress=False,
                tensorboard=False)  # fmt: skip
    train(str(shards), str(tmp_path / "auto"), TrainConfig(**base))
    train(str(shards), str(tmp_path / "off"), TrainConfig(**base, recipe="off"))
    out = capsys.readouterr().out
    assert out.count("train: settings from the small-run recipe (") == 1 and "--recipe off keeps the" in out

    def first(run: str) -> dict:
        return json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])

    assert first("auto")["lr"] == pytest.approx(1e-3) and first("off")["lr"] <= 1e-4


def test_resuming_without_the_recipe_the_run_started_with_says_which(tmp_path, shards):  # noqa: F811
    """A run started with --recipe off (or before --recipe existed) resumed with the default auto: refused, and
    the error names the flag."""
    base = dict(draft_vocab_size=64, ttt_steps=2, max_length=96, val_fraction=0.0, progress=False, tensorboard=False,
                checkpoint_every=1)  # fmt: skip
    train(str(shards), str(tmp_path / "run"), TrainConfig(**base, max_steps=1, recipe="off"))
    with pytest.raises(ValueError, match="--recipe off"):
        train(str(shards), str(tmp_path / "run"), TrainConfig(**base, max_steps=2, resume=True))


def test_the_recipe_is_sized_for_the_ranks_and_the_data():
    """Issue 48 item 1: 2 ranks of samples up to 2048 tokens need 4096 tokens a step, not the recipe's 512:
    the recipe raises it and says why; one rank of short samples keeps 512."""
    cfg, said = with_recipe(TrainConfig(recipe="on"), 10_000, world=2, longest=2048)
    assert cfg.max_tokens == 4096 and "raised from the recipe's 512 to 4096" in said and "2 ranks" in said
    for longest in (300, 2048):  # one process: a longer sample is a batch of its own, as before
        cfg, said = with_recipe(TrainConfig(recipe="on"), 10_000, world=1, longest=longest)
        assert cfg.max_tokens == 512 and "raised" not in said
    cfg, said = with_recipe(TrainConfig(recipe="on"), 10_000, world=2, longest=700)
    assert cfg.max_tokens == 1536


def test_print_config_shows_what_the_run_uses(tmp_path, shards, capsys, monkeypatch):  # noqa: F811
    """Issue 48 item 2: --print-config prints the recipe's values (not the library defaults), where each came
    from, and absolute paths."""
    from specdraft import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", str(shards), "rel-out", "--lr", "5e-4", "--print-config"]) in (0, None)
    doc = json.loads(capsys.readouterr().out)
    s, src = doc["settings"], doc["from"]
    assert s["lr"] == 5e-4 and src["lr"] == "command line"
    assert s["max_tokens"] == SMALL_RUN["max_tokens"] and s["schedule"] == "constant"
    assert src["schedule"] == "small-run recipe" and "small-run recipe" in doc["recipe"]
    assert s["out"] == str(tmp_path / "rel-out")

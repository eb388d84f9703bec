"""Issue 49 items 1 and 6 (EAGLE-3): one identity per train OUT, and a refused --resume writes nothing."""

from __future__ import annotations

import json

import pytest
from test_train_rough_edges import cfg, shards  # noqa: F401  (the module's fixture)

from specdraft.train.loop import train


def _files(d) -> dict[str, bytes]:
    return {
        str(p.relative_to(d)): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != ".specdraft.lock"
    }


def test_an_eagle3_run_into_a_dflash_runs_out_is_refused_and_touches_nothing(tmp_path, shards):  # noqa: F811
    """The OUT of a finished --draft dflash run (its settings file, final/, metrics and checkpoints): an EAGLE-3
    run there, without --resume, would have replaced final/, cut metrics.jsonl and pruned the checkpoints."""
    out = tmp_path / "dflash-run"
    (out / "final").mkdir(parents=True)
    (out / "checkpoints" / "step_11").mkdir(parents=True)
    (out / "train_settings.json").write_text(
        json.dumps({"command": "train", "settings": {"draft": "dflash"}})
    )
    (out / "final" / "config.json").write_text(json.dumps({"format": "specdraft.dflash"}))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(14)))
    (out / "checkpoints" / "latest").write_text("step_11")
    before = _files(out)
    with pytest.raises(ValueError, match="holds a --draft dflash run.*choose another OUT"):
        train(str(shards), str(out), cfg(max_steps=2))
    assert _files(out) == before


def test_the_other_way_round_too(tmp_path, shards):  # noqa: F811
    out = tmp_path / "eagle-run"
    train(str(shards), str(out), cfg(max_steps=2))
    before = _files(out)
    with pytest.raises(ValueError, match="holds a --draft eagle3 run"):
        train(str(shards), str(out), cfg(max_steps=2, draft="dflash", ttt_steps=7))
    assert _files(out) == before


def test_a_refused_resume_leaves_the_recorded_settings_alone(tmp_path, shards):  # noqa: F811
    """`--resume --ttt-steps 3` on a run of 2 TTT steps is refused, and OUT/train_settings.json still says 2:
    a later plain --resume works."""
    out = tmp_path / "run"
    train(str(shards), str(out), cfg(max_steps=2, checkpoint_every=1))
    recorded = (out / "train_settings.json").read_bytes()
    with pytest.raises(ValueError, match="written with other settings.*ttt_steps"):
        train(str(shards), str(out), cfg(max_steps=4, checkpoint_every=1, ttt_steps=3, resume=True))
    assert (out / "train_settings.json").read_bytes() == recorded
    train(
        str(shards), str(out), cfg(max_steps=4, checkpoint_every=1, resume=True)
    )  # the same settings resume


def test_concurrent_exports_into_one_out_one_wins_the_other_is_refused(tmp_path, monkeypatch):
    """Issue 49 item 3: while one export holds OUT (from its checks to its rename), a second is refused at once;
    after it, exporting again replaces the export as before."""
    import threading

    import specdraft.export as ex

    out = tmp_path / "exp"
    entered, release = threading.Event(), threading.Event()
    errors = []

    def slow(*a, **kw):
        entered.set()
        release.wait(30)
        return 0

    monkeypatch.setattr(ex, "_export", slow)
    t = threading.Thread(target=lambda: ex.export("run", str(out)))
    t.start()
    assert entered.wait(30)
    try:
        ex.export("run", str(out))
    except ValueError as e:
        errors.append(str(e))
    release.set()
    t.join()
    assert len(errors) == 1 and "another export is writing" in errors[0]
    assert ex.export("run", str(out)) == 0  # the lock is gone with its holder


def test_a_damaged_eagle3_draft_is_named_in_one_line(tmp_path):
    """Issue 49 item 7: an empty config.json, a safetensors file with a corrupted header: the file named."""
    import numpy as np
    from conftest import build_tiny_model

    from specdraft.model.checkpoint import load_draft, load_draft_config, save_draft
    from specdraft.model.draft import build_draft
    from specdraft.targets import wrap_model

    target = wrap_model(build_tiny_model("llama"), name="tiny")
    d = tmp_path / "d"
    save_draft(build_draft(target, np.arange(target.vocab_size), [2, 4, 5], draft_vocab_size=32), d)
    w = d / "model.safetensors"
    w.write_bytes(b"\xff" * 16 + w.read_bytes()[16:])
    with pytest.raises(ValueError, match="model.safetensors cannot be read.*damaged"):
        load_draft(d, with_embeddings=False)
    (d / "config.json").write_text("")
    with pytest.raises(ValueError, match="config.json is not readable JSON"):
        load_draft_config(d)

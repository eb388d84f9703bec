"""quickstart: refuses to relabel an earlier run, one writer per directory, and (slow) the whole pipeline."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft import quickstart as Q
from specdraft.fileio import DirectoryInUse, DirLock


def test_a_rerun_with_another_budget_is_refused_naming_what_differs(tmp_path):
    Q._check_settings(tmp_path, {"budget": "tiny", "samples": 48, "device": "cpu"})
    Q._check_settings(tmp_path, {"budget": "tiny", "samples": 48, "device": "cpu"})  # same settings resume
    with pytest.raises(
        ValueError, match=r"other settings \(budget 'tiny' -> 'default', samples 48 -> 320\).*--fresh"
    ):
        Q._check_settings(tmp_path, {"budget": "default", "samples": 320, "device": "cpu"})


def test_a_run_made_before_a_budget_setting_existed_resumes_and_a_changed_budget_is_named(tmp_path, capsys):
    # a run recorded by an older specdraft: the setting it lacks applies to the stages still to run
    Q._check_settings(tmp_path, {"budget": "default", "samples": 240, "device": "cpu"})
    newer = {"budget": "default", "samples": 240, "device": "cpu", "serve_dist_samples": 100}
    Q._check_settings(tmp_path, newer)
    assert "made before these settings existed: serve_dist_samples=100" in capsys.readouterr().out
    # the same budget defined otherwise since: no "rerun with --budget default" (the budget it already names)
    with pytest.raises(ValueError) as e:
        Q._check_settings(tmp_path, {**newer, "samples": 320})
    msg = str(e.value)
    assert "samples 240 -> 320" in msg and "the default budget changed since it was made" in msg
    assert "--budget default" not in msg and "--fresh" in msg


def test_a_second_quickstart_on_one_directory_fails_at_once(tmp_path):
    with DirLock(tmp_path / "run", "quickstart"):
        with pytest.raises(DirectoryInUse, match="in use by another specdraft process"):
            Q.quickstart(out=str(tmp_path / "run"), budget="tiny")


@pytest.mark.slow
@pytest.mark.real
def test_tiny_quickstart_end_to_end_from_the_cli(tmp_path):
    """The README's main job on the embedded default at the smallest budget, through the CLI, spelled relative."""
    run = [sys.executable, "-m", "specdraft.cli", "quickstart", "--budget", "tiny", "--out", "qs"]
    r = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "qs" / "summary.json").read_text())
    assert s["budget"]["name"] == "tiny" and 0 < s["data"]["num_samples"] <= 48
    # trained on the target's own replies (regenerated), counted by stop reason
    regen = json.loads((tmp_path / "qs" / "regenerated" / "regenerate.json").read_text())
    assert regen["done"] and sum(regen["totals"]["replies"].values()) >= s["data"]["num_samples"]
    tr, ag = s["eval"]["trained"], s["eval"]["agreement"]
    assert tr["lossless"] is True  # greedy speculative output == target alone
    assert tr["tau"] >= 1.0 and len(tr["acceptance_per_position"]) == 3
    # the untrained draft's figure is training's validation at step 0 (no decode of it)
    assert ag["steps"] == [0, s["train"]["steps"]] and len(ag["untrained"]) == len(ag["trained"]) == 3
    assert list(json.loads((tmp_path / "qs" / "eval" / "report.json").read_text())["drafts"]) == [
        str(tmp_path / "qs" / "train" / "final")
    ]
    assert s["train"]["steps"] > 0 and all(0 <= a <= 1 for a in s["train"]["val"]["acc"])
    assert (tmp_path / "qs" / "export" / "speculators" / "config.json").exists()
    if s["serve"] is not None:  # vLLM installed: the export served, batched and at batch 1, lossless
        assert s["serve"]["lossless"] is True and s["serve"]["tau"] >= 1.0
        assert s["serve"]["batch1"]["prompts"] == 2 and s["serve"]["batch1"]["round_cost_in_target_steps"] > 0
        # and again at the temperature the target is served at (SmolLM2's GGUF names none: 0.7), sampled
        t = s["serve"]["sampled"]
        assert (t["temperature"], t["draft_sample"], t["lossless"]) == (0.7, "probabilistic", None)
        assert t["tau"] >= 1
        sampled = json.loads((tmp_path / "qs" / "serve_sampled" / "report_vllm.json").read_text())
        assert sampled["settings"]["temperature"] == 0.7
        assert "vLLM batch 1" in r.stdout
    # the same run spelled absolute resumes (every stage already done) instead of failing
    r2 = subprocess.run([*run[:-1], str(tmp_path / "qs")], capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert json.loads((tmp_path / "qs" / "summary.json").read_text())["eval"]["trained"]["tau"] == tr["tau"]
    # another budget on the same directory is refused with the fix
    r3 = subprocess.run([*run[:-3], "default", "--out", "qs"], cwd=tmp_path, capture_output=True, text=True)
    assert r3.returncode == 2 and "--fresh" in r3.stderr and "Traceback" not in r3.stderr


def test_a_rerun_after_an_interrupted_first_checkpoint_starts_training_instead_of_resuming(
    tmp_path, monkeypatch
):
    """Killed while writing its first checkpoint, a run leaves only a temporary under checkpoints/: the rerun
    must train from the start (it used to pass --resume and fail with "no checkpoint ... to resume from")."""
    import specdraft.capture.extract as X
    import specdraft.data.prepare as P
    import specdraft.data.regenerate as G
    import specdraft.eval.reference as R
    import specdraft.export as E
    import specdraft.train.loop as L

    root = tmp_path / "qs"
    (root / "dataset").mkdir(parents=True)
    (root / "dataset" / "manifest.json").write_text(
        '{"num_samples": 1, "num_tokens": 1, "num_loss_tokens": 1}'
    )
    (root / "hidden_states").mkdir()
    (root / "hidden_states" / "manifest-00000-of-00001.json").write_text("{}")
    (root / "train" / "checkpoints" / ".step_00000020.4242.tmp").mkdir(parents=True)
    seen = {}

    class Stop(Exception):
        pass

    def fake_train(shards, out, cfg):
        seen["resume"] = cfg.resume
        raise Stop

    monkeypatch.setattr(X, "extract", lambda *a, **k: None)
    monkeypatch.setattr(P, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(G, "regenerate", lambda *a, **k: tmp_path / "conversations.jsonl")
    monkeypatch.setattr(L, "train", fake_train)
    monkeypatch.setattr(R, "evaluate_report", lambda *a, **k: pytest.fail("eval before train"))
    monkeypatch.setattr(E, "export", lambda *a, **k: None)
    with pytest.raises(Stop):
        Q.quickstart(out=str(root), budget="tiny")
    assert seen == {"resume": False}


def test_the_agreement_before_and_after_training_is_read_from_the_validation_records(tmp_path):
    recs = [{"split": "val", "step": 0, "acc": [0.0184, 0.01, 0.02], "tokens": 70},
            {"split": "train", "step": 1, "acc": [0.5, 0.5, 0.5]},
            {"split": "val", "step": 100, "acc": [0.2, 0.1, 0.1], "tokens": 70},
            {"split": "val", "step": 200, "acc": [0.3214, 0.25, 0.2], "tokens": 70}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ag = Q._agreement(tmp_path)
    assert ag == {
        "untrained": [0.018, 0.01, 0.02],
        "trained": [0.321, 0.25, 0.2],
        "steps": [0, 200],
        "tokens": 70,
    }
    assert Q._agreement(tmp_path / "none") == {}  # no validation: the summary leaves the row out


def test_the_summary_places_the_run_on_the_measured_curve():
    from specdraft.quickstart import CURVE, curve_position

    a, b = CURVE["a"], CURVE["b"]
    line = curve_position(100_000, 3)
    assert f"tau {a + b * 5:.2f} for one epoch of them" in line  # log10(100k) = 5
    assert f"{a + b * math.log10(300_000):.2f} for one epoch of 3x as many new ones" in line
    assert "(extrapolated)" not in line and f"tau 1.5 needs ~{10 ** ((1.5 - a) / b):,.0f}" in line
    assert "(extrapolated)" in curve_position(5_000_000, 1)


def test_the_default_budget_trains_as_the_scaling_curve_did():
    """The default budget trains as the measured curve did (benchmarks/scaling.py trains with ablate.py's best arm,
    one epoch of ShareGPT replies), but for issue 45's changes: the soft KL instead of the argmax loss, and two
    epochs with AdamW where the library's recipe takes Muon (docs/experiments.md: at the quickstart's CPU time
    AdamW's two epochs beat Muon's)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        from ablate import ARMS
        from draft_quality import settings
    finally:
        sys.path.pop(0)
    arm = dict(ARMS["best_spb2_fc_high_ema0.99"])
    b = Q.BUDGETS["default"]
    assert b.recipe and b.reply_tokens == 0  # ShareGPT's replies
    issue45 = {**{k: v for k, v in arm.items() if k != "hard_weight"}, "optimizer": "muon"}
    assert {"lr": b.lr, "max_tokens": b.max_tokens, "schedule": b.schedule, **Q.SMALL_RUN} == issue45
    # and issue 45's two epochs at the recipe's two steps a batch with AdamW: the arm kl+epochs2 of
    # benchmarks/draft_quality.py (1.357 and 1.355 on two seeds against 1.341 for Muon at one step a batch)
    assert b.epochs == 2 and b.train_recipe() == {**Q.SMALL_RUN, "optimizer": "adamw"}
    _, measured = settings("kl+epochs2")
    quickstart = {**b.train_recipe(), "epochs": b.epochs, "lr": b.lr, "max_tokens": b.max_tokens}
    for key, value in quickstart.items():
        assert getattr(measured, key) == value, key
    # the loss: the arm names the KL, the quickstart leaves --loss and --hard-weight at their defaults (EAGLE-3: KL)
    assert (measured.loss, measured.hard_weight) == ("kl", 0.0)
    from specdraft.train.config import TrainConfig

    assert (TrainConfig().loss, TrainConfig().hard_weight) == ("", 0.0)


@pytest.mark.parametrize("native", [True, False])
def test_extract_and_train_compute_in_bf16_where_native_and_a_stage_begun_keeps_its_dtype(
    tmp_path, monkeypatch, native
):
    """bf16 where the device has it natively (a CPU with AVX512-BF16 or AMX: 1.6x extraction, 1.4x training),
    fp32 elsewhere; a stage an older run began in another dtype resumes in its own (else its resume is refused)."""
    import specdraft.capture.extract as X
    import specdraft.data.prepare as P
    import specdraft.data.regenerate as G
    import specdraft.runtime as RT
    import specdraft.train.loop as L

    class Stop(Exception):
        pass

    seen = {}
    monkeypatch.setattr(RT, "bf16_native", lambda device: native)
    monkeypatch.setattr(G, "regenerate", lambda *a, **k: tmp_path / "conversations.jsonl")
    monkeypatch.setattr(P, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(X, "extract", lambda *a, **k: seen.setdefault("extract", k["dtype"]))

    def fake_train(shards, out, cfg):
        seen["train"] = cfg.dtype
        raise Stop

    monkeypatch.setattr(L, "train", fake_train)
    fast = "bfloat16" if native else "float32"
    for root, begun in [(tmp_path / "fresh", False), (tmp_path / "begun", True)]:
        seen.clear()
        (root / "dataset").mkdir(parents=True)
        (root / "dataset" / "manifest.json").write_text('{"num_samples": 1}')
        (root / "hidden_states").mkdir()
        if begun:  # an older run's extraction (fp32, 3 of 15 shards) and its training (dtype auto)
            man = {"compute_dtype": "float32", "complete": False}
            (root / "hidden_states" / "manifest-00000-of-00001.json").write_text(json.dumps(man))
            (root / "train").mkdir()
            (root / "train" / "train_settings.json").write_text('{"settings": {"dtype": "auto"}}')
        with pytest.raises(Stop):
            Q.quickstart(out=str(root), budget="tiny", device="cpu")
        assert seen == (
            {"extract": "float32", "train": "auto"} if begun else {"extract": fast, "train": fast}
        )


def test_the_serving_temperature_picks_the_loss_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    """--serve-temperature 1: the draft trains with the NLA loss (measured best there); not named: the target's own
    (SmolLM2 names none: 0.7) and the soft KL; another temperature on the same run is refused with the fix."""
    import specdraft.capture.extract as X
    import specdraft.data.prepare as P
    import specdraft.data.regenerate as G
    import specdraft.train.loop as L

    class Stop(Exception):
        pass

    seen = {}

    def fake_train(shards, out, cfg):
        seen.update(loss=cfg.loss, at=cfg.serve_temperature)
        raise Stop

    monkeypatch.setattr(P, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(X, "extract", lambda *a, **k: None)
    monkeypatch.setattr(G, "regenerate", lambda *a, **k: tmp_path / "conversations.jsonl")
    monkeypatch.setattr(L, "train", fake_train)
    monkeypatch.setattr(
        Q, "_serve_temperature", lambda named=-1.0: (named, 1.0, "x") if named >= 0 else (0.7, 1.0, "y")
    )
    for name, at, want in [("t1", 1.0, {"loss": "nla", "at": 1.0}), ("own", -1.0, {"loss": "", "at": 0.7})]:
        root = tmp_path / name
        (root / "dataset").mkdir(parents=True)
        (root / "dataset" / "manifest.json").write_text('{"num_samples": 1}')
        with pytest.raises(Stop):
            Q.quickstart(out=str(root), budget="tiny", device="cpu", serve_temperature=at)
        assert seen == want
    with pytest.raises(ValueError, match=r"serve_temperature 1\.0 -> 0\.6.*--fresh"):
        Q.quickstart(out=str(tmp_path / "t1"), budget="tiny", device="cpu", serve_temperature=0.6)
    with pytest.raises(ValueError, match=r"--serve-temperature must be -1 .* in \[0, 2\]"):
        Q.quickstart(out=str(tmp_path / "t1"), budget="tiny", device="cpu", serve_temperature=5)


def test_a_new_machine_converts_the_embedded_default_before_reading_its_serving_temperature(
    tmp_path, monkeypatch
):
    """On a machine that never converted the embedded default, the quickstart read its generation_config from
    None and crashed before its first stage: the conversion is now its first (timed) stage."""
    from specdraft import targets

    made = []

    def convert(gguf, out, what):  # the real one takes ~10 s; this one writes what it would
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "generation_config.json").write_text('{"temperature": 0.3, "top_p": 0.9}')
        made.append(out)
        return out

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(targets, "_convert_gguf", convert)
    assert targets.resolve_target_dir(targets.EMBEDDED_DEFAULT) is None  # a new machine
    assert Q._serve_temperature() == (0.3, 0.9, "the target's generation_config")
    assert Q._serve_temperature(1.0) == (1.0, 0.9, "--serve-temperature") and len(made) == 1


def test_a_cpu_without_native_bf16_is_told_its_stages_run_in_fp32_and_longer(monkeypatch):
    import specdraft.runtime as R

    monkeypatch.setattr(R, "bf16_native", lambda device: False)
    assert "no native bf16" in Q._dtype_note("cpu") and "float32" in Q._dtype_note("cpu")
    assert Q._dtype_note("cuda:0") == ""  # a GPU: nothing to say
    monkeypatch.setattr(R, "bf16_native", lambda device: True)
    assert Q._dtype_note("cpu") == ""

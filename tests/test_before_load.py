"""Messages before loading (issue 27): a target whose tokenizer cannot render chats (a base model: no chat
template) is refused by regenerate and eval in one line, with the fix, from its tokenizer alone -- before any
model loads; with --chat-template they run. doctor --target warns about it, and about a multimodal config
without the preprocessor_config.json that vLLM's serving loads."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from conftest import CHATML, conversations, tiny_config, write_jsonl

import specdraft.export
import specdraft.targets
from specdraft.data import regenerate as regen
from specdraft.doctor.command import run_doctor
from specdraft.eval import command as eval_command


class Loaded(Exception):
    """A model loader was called: the refusal came too late."""


@pytest.fixture(scope="module")
def base_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama as a base model: the same tokenizer and weights, no chat template."""
    d = tmp_path_factory.mktemp("tiny-base") / "base"
    shutil.copytree(tiny_llama_dir, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not specdraft.targets.load_tokenizer(str(d)).chat_template
    return d


def _no_model_loads(m: pytest.MonkeyPatch) -> None:
    """Every way regenerate and eval load a model (or export a draft, which reads the target) raises `Loaded`."""

    def loaded(*args, **kwargs):
        raise Loaded

    m.setattr(specdraft.targets, "load_target", loaded)
    m.setattr(regen, "_vllm_generator", loaded)
    m.setattr(specdraft.export, "export", loaded)
    m.setattr(eval_command, "_engine_kwargs", lambda tp, args: {})  # vLLM's option check, not a load


def _one_line_refusal(exc: pytest.ExceptionInfo, target: Path) -> None:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"the tokenizer of {target} has no chat template"), msg
    assert "Fix: pass --chat-template" in msg and "instruct/chat variant" in msg, msg


def test_regenerate_refuses_a_base_model_before_loading_it(base_dir, tmp_path, monkeypatch, one_thread):
    """Refused from the tokenizer alone with either engine, nothing recorded; with --chat-template it runs."""
    data = write_jsonl(tmp_path / "in.jsonl", conversations(2, seed=1))
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _no_model_loads(m)
        for engine in ("hf", "vllm"):
            with pytest.raises(ValueError) as exc:
                regen.regenerate(str(data), str(out), target=str(base_dir), engine=engine, max_new_tokens=2)
            _one_line_refusal(exc, base_dir)
            assert not (out / regen.SETTINGS_FILE).exists()  # nothing recorded: no `done: false` left behind
    (tmp_path / "chatml.jinja").write_text(CHATML)
    got = regen.regenerate(str(data), str(out), target=str(base_dir), engine="hf", max_new_tokens=2,
                           chat_template=str(tmp_path / "chatml.jinja"))  # fmt: skip
    assert len(got.read_text().splitlines()) == 2
    meta = json.loads((out / regen.SETTINGS_FILE).read_text())
    assert meta["done"] is True and meta["settings"]["chat_template_sha256"]


def test_eval_refuses_a_base_model_before_loading_it(base_dir, tmp_path, monkeypatch, one_thread, capsys):
    """Refused from the tokenizer alone with either engine (vllm: before the train output is exported); with
    --chat-template the evaluation runs."""
    prompts = str(write_jsonl(tmp_path / "q.jsonl", [{"turns": ["Write a poem about the sea"]}]))
    with monkeypatch.context() as m:
        _no_model_loads(m)
        for engine, draft in (("hf", "untrained"), ("vllm", str(tmp_path / "run"))):
            with pytest.raises(ValueError) as exc:
                eval_command.evaluate([draft], target=str(base_dir), prompts=prompts, engine=engine,
                                      out=str(tmp_path / "eval"), progress=False)  # fmt: skip
            _one_line_refusal(exc, base_dir)
    code = eval_command.evaluate(["untrained"], target=str(base_dir), prompts=prompts, max_new_tokens=3,
                                 draft_vocab_size=64, chat_template=CHATML, out=str(tmp_path / "eval"),
                                 progress=False)  # fmt: skip
    assert code == 0 and "lossless yes" in capsys.readouterr().out
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["records"]


def _problems(report, check: str) -> list:
    return [p for p in report.problems if p.check == check]


def test_doctor_warns_about_a_target_without_a_chat_template(base_dir, tiny_llama_dir):
    report = run_doctor(target=str(base_dir), contracts=[], quiet=True)
    (warning,) = _problems(report, "tokenizer")
    assert warning.severity == "warning" and "no chat template" in warning.message
    assert "regenerate and eval" in warning.message and "--chat-template" in warning.fix
    assert "[WARNING] tokenizer" in report.format_text() and report.exit_code == 0
    assert _problems(run_doctor(target=str(tiny_llama_dir), contracts=[], quiet=True), "tokenizer") == []


def test_doctor_warns_about_a_multimodal_target_without_preprocessor_config(tmp_path):
    """The Kimi-K2.5-shaped wrapper of tests/standins.py (a vision_config around the text model), config only."""
    from standins import kimi_k25_config

    d = tmp_path / "kimi"
    kimi_k25_config().save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]  # the hub's name, as standins writes it
    (d / "config.json").write_text(json.dumps(cfg))
    (warning,) = _problems(run_doctor(target=str(d), contracts=[], quiet=True), "processor")
    assert warning.severity == "warning" and "declares a vision_config" in warning.message
    assert "no preprocessor_config.json: vLLM loads the model's processor" in warning.message
    assert "eval --engine vllm" in warning.message and "preprocessor_config.json" in warning.fix
    (d / "preprocessor_config.json").write_text("{}")
    assert _problems(run_doctor(target=str(d), contracts=[], quiet=True), "processor") == []


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="reads the installed vLLM's model registry"
)
def test_doctor_warns_about_an_architecture_vllm_registers_as_multimodal(tmp_path):
    """No vision_config in config.json, but an architecture in vLLM's multimodal registry (read, not imported)."""
    cfg = tiny_config("llama")
    cfg.architectures = ["KimiK25ForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "mm")
    (warning,) = _problems(run_doctor(target=str(tmp_path / "mm"), contracts=[], quiet=True), "processor")
    assert "KimiK25ForConditionalGeneration (multimodal in vLLM)" in warning.message
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path / "text")
    assert _problems(run_doctor(target=str(tmp_path / "text"), contracts=[], quiet=True), "processor") == []

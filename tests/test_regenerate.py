"""regenerate: the target's own replies, turn by turn, in atomic chunks that resume exactly after kill -9."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import conversations, write_jsonl

from specdraft import targets
from specdraft.data.prepare import prepare
from specdraft.data.regenerate import (
    END_OF_TURN,
    LENGTH,
    OUTPUT_FILE,
    SETTINGS_FILE,
    regenerate,
    render,
)
from specdraft.targets import load_target


def _greedy_alone(target, messages: list[dict], max_new: int) -> tuple[str, str]:
    """Oracle: token-by-token greedy decoding of one prompt alone, no padding, no KV cache, no generate()."""
    ids = render(target.tokenizer, messages)
    stop_ids = targets.stop_ids(target.tokenizer, target.model.generation_config)
    new = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = target.model(torch.tensor([ids + new])).logits[0, -1]
        t = int(logits.argmax())
        if t in stop_ids:
            return target.tokenizer.decode(new).strip(), END_OF_TURN
        new.append(t)
    return target.tokenizer.decode(new).strip(), LENGTH


@pytest.fixture
def convs_file(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", conversations(7, seed=3))


def test_replies_are_the_targets_greedy_replies_turn_by_turn(
    tiny_llama_dir, convs_file, tmp_path, one_thread
):
    out = regenerate(str(convs_file), str(tmp_path / "out"), target=str(tiny_llama_dir), engine="hf", max_new_tokens=6,
                     chunk_size=3, temperature=0.0, loops="keep")  # fmt: skip
    got = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    src = [c["messages"] for c in conversations(7, seed=3)]
    assert len(got) == len(src) == 7
    target = load_target(str(tiny_llama_dir))
    stops = []
    for g, s in zip(got, src):
        assert [m for m in g if m["role"] == "user"] == [m for m in s if m["role"] == "user"]
        assert [m["role"] for m in g] == [m["role"] for m in s]
        for i in range(1, len(g), 2):  # each reply follows the target's own earlier replies
            text, stop = _greedy_alone(target, g[:i], 6)
            assert g[i]["content"] == text
            stops.append(stop)
    meta = json.loads((tmp_path / "out" / SETTINGS_FILE).read_text())
    assert meta["done"] and meta["totals"]["replies"] == {END_OF_TURN: stops.count(END_OF_TURN),
                                                          LENGTH: stops.count(LENGTH)}  # fmt: skip
    # prepare reads the output as is
    prepare(str(out), str(tmp_path / "ds"), target=str(tiny_llama_dir))
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["num_samples"] == 7


def test_first_turn_only(tiny_llama_dir, convs_file, tmp_path, one_thread):
    out = regenerate(str(convs_file), str(tmp_path / "out"), target=str(tiny_llama_dir), engine="hf", max_new_tokens=3,
                     turns="first", temperature=0.0, loops="keep")  # fmt: skip
    assert all(len(json.loads(line)["messages"]) == 2 for line in out.read_text().splitlines())


_RUN = """
import sys
from specdraft.data.regenerate import regenerate
regenerate(sys.argv[1], sys.argv[2], target=sys.argv[3], engine="hf", max_new_tokens=8, chunk_size=1, temperature=0.8, seed=5, loops="keep")
"""


def test_resume_after_kill_9_writes_what_an_uninterrupted_run_writes(tiny_llama_dir, convs_file, tmp_path):
    whole = tmp_path / "whole"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", _RUN, str(convs_file), str(whole), str(tiny_llama_dir)], env=env,
                   check=True, capture_output=True)  # fmt: skip
    cut = tmp_path / "cut"
    p = subprocess.Popen([sys.executable, "-c", _RUN, str(convs_file), str(cut), str(tiny_llama_dir)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 120
    while len(list(cut.glob("chunk-*.jsonl"))) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    n_before = len(list(cut.glob("chunk-*.jsonl")))
    assert 2 <= n_before < 7, "the run should have been killed part-way"
    subprocess.run([sys.executable, "-c", _RUN, str(convs_file), str(cut), str(tiny_llama_dir)], env=env,
                   check=True, capture_output=True)  # fmt: skip
    assert (cut / OUTPUT_FILE).read_bytes() == (whole / OUTPUT_FILE).read_bytes()
    assert not list(cut.glob(".*.tmp"))


def test_other_settings_on_resume_are_refused(tiny_llama_dir, convs_file, tmp_path, one_thread):
    regenerate(
        str(convs_file),
        str(tmp_path / "o"),
        target=str(tiny_llama_dir),
        engine="hf",
        max_new_tokens=2,
        max_samples=2,
        temperature=0.0,
        loops="keep",
    )
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: 2 -> 3\)"):
        regenerate(str(convs_file), str(tmp_path / "o"), target=str(tiny_llama_dir), engine="hf", max_new_tokens=3,
                   max_samples=2, temperature=0.0, loops="keep")  # fmt: skip


def test_bad_inputs(tiny_llama_dir, tmp_path, one_thread):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no usable conversation"):
        regenerate(
            str(empty),
            str(tmp_path / "a"),
            target=str(tiny_llama_dir),
            engine="hf",
            temperature=0.0,
            loops="keep",
        )
    no_user = write_jsonl(tmp_path / "nouser.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(ValueError, match="no usable conversation"):
        regenerate(
            str(no_user),
            str(tmp_path / "b"),
            target=str(tiny_llama_dir),
            engine="hf",
            temperature=0.0,
            loops="keep",
        )
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [
        {"messages": [{"role": "assistant", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "Hello! How can I help you today?"},
                      {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "fox " * 400}, {"role": "assistant", "content": "x"}]},
    ])  # fmt: skip
    out = regenerate(str(mixed), str(tmp_path / "c"), target=str(tiny_llama_dir), engine="hf", max_new_tokens=2,
                     max_prompt_tokens=64, temperature=0.0, loops="keep")  # fmt: skip
    assert len(out.read_text().splitlines()) == 1  # the over-long prompt has no reply to keep
    meta = json.loads((tmp_path / "c" / SETTINGS_FILE).read_text())
    assert meta["totals"]["cut_short"] == 1 and sum(meta["dropped"].values()) == 1
    with pytest.raises(ValueError, match="no such file"):
        regenerate(
            str(tmp_path / "missing.jsonl"),
            str(tmp_path / "d"),
            target=str(tiny_llama_dir),
            engine="hf",
            temperature=0.0,
            loops="keep",
        )


def test_a_missing_or_empty_target_is_named_before_any_engine_is_chosen(convs_file, tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "nope", tmp_path / "empty"):
        out = tmp_path / f"out-{target.name}"
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(str(target))) as e:
            regenerate(
                str(convs_file), str(out), target=str(target), temperature=0.0, loops="keep"
            )  # engine auto: vLLM when installed
        assert "--engine" not in str(e.value) and "\n" not in str(e.value)
        assert not (out / SETTINGS_FILE).exists()  # nothing recorded for a run that never started


def test_a_run_that_wrote_no_chunk_may_restart_with_other_settings(
    tiny_llama_dir, convs_file, tmp_path, one_thread
):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # a target that fails to load
    out = tmp_path / "o"
    with pytest.raises(ValueError):
        regenerate(
            str(convs_file),
            str(out),
            target=str(bad),
            engine="hf",
            max_samples=2,
            temperature=0.0,
            loops="keep",
        )
    args = dict(
        temperature=0.0, loops="keep", target=str(tiny_llama_dir), engine="hf", max_samples=2, chunk_size=2
    )
    regenerate(str(convs_file), str(out), max_new_tokens=2, **args)  # the corrected target is not refused
    # a run killed before its first chunk was written (its settings recorded) starts over with other settings
    for f in [*out.glob("chunk-*"), *out.glob(".chunk-*"), out / OUTPUT_FILE]:
        f.unlink()
    regenerate(str(convs_file), str(out), max_new_tokens=3, **args)
    assert json.loads((out / SETTINGS_FILE).read_text())["settings"]["max_new_tokens"] == 3


def test_a_chunk_without_its_totals_is_redone(tiny_llama_dir, convs_file, tmp_path, one_thread):
    args = dict(
        temperature=0.0, loops="keep", target=str(tiny_llama_dir), engine="hf", max_new_tokens=3, chunk_size=2
    )
    out = regenerate(str(convs_file), str(tmp_path / "o"), **args)
    whole, meta = out.read_bytes(), json.loads((tmp_path / "o" / SETTINGS_FILE).read_text())
    (tmp_path / "o" / ".chunk-00001.totals.json").unlink()  # killed between a chunk and its totals
    out.unlink()
    assert regenerate(str(convs_file), str(tmp_path / "o"), **args).read_bytes() == whole
    assert json.loads((tmp_path / "o" / SETTINGS_FILE).read_text()) == meta

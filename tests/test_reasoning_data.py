"""Real conversation data end to end: reasoning traces and tool calls, rendered by the hybrid-thinking stand-in
template, through prepare -> extract -> train -> eval on a tiny random model; then inputs as parquet, arrow,
a `save_to_disk` directory and a two-source mixture."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CORPUS, write_jsonl

from specdraft.data.prepare import load_dataset, prepare

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object"}}}]  # fmt: skip


def agentic(n: int, seed: int = 0, tools: bool = False) -> list[dict]:
    """Multi-turn conversations with reasoning in every assistant turn, every second one with a tool call
    (the tool definitions only with `tools`: the template's tool block is long for a 256-token model)."""
    rng = random.Random(seed)
    words = (CORPUS[0] + " " + CORPUS[3]).split()

    def say(k: int) -> str:
        return " ".join(rng.choices(words, k=k))

    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": say(6)},
                {"role": "assistant", "content": say(8), "reasoning_content": say(10)},
                {"role": "user", "content": say(5)}]  # fmt: skip
        if i % 2:
            call = {
                "type": "function",
                "id": "c1",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
            msgs += [{"role": "assistant", "content": "", "reasoning_content": say(6), "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": say(3)}]  # fmt: skip
        msgs.append({"role": "assistant", "content": f"<think>{say(7)}</think>{say(9)}"})  # inline reasoning
        out.append({"messages": msgs, **({"tools": TOOLS} if tools else {})})
    return out


def test_reasoning_and_tool_calls_end_to_end(tmp_path, hybrid_dir):
    from specdraft.capture.extract import extract
    from specdraft.eval.command import evaluate
    from specdraft.train.config import TrainConfig
    from specdraft.train.loop import train

    src = write_jsonl(tmp_path / "agentic.jsonl", agentic(12))
    ds = prepare(str(src), str(tmp_path / "ds"), target=str(hybrid_dir), max_length=256)
    man = json.loads((ds / "manifest.json").read_text())
    assert man["num_conversations"] == 12 and not man["dropped"]
    assert man["samples_per_conversation"] == {
        "2": 6,
        "3": 6,
    }  # history rewritten: a sample per assistant turn
    kinds = man["loss_tokens_by_kind"]
    assert kinds["reasoning"] > 0 and kinds["tool_call"] > 0 and kinds["content"] > 0
    assert man["chat_template_kwargs"] == {} and man["chat_template_sha256"]
    hs = extract(str(ds), str(tmp_path / "hs"), target=str(hybrid_dir), samples_per_shard=16,
                 max_tokens_per_batch=1024, skip_doctor=True, store_dtype="float32")  # fmt: skip
    cfg = TrainConfig(draft_vocab_size=64, ttt_steps=2, max_tokens=1024, max_length=256, epochs=1, lr=3e-3,
                      val_fraction=0.0, checkpoint_every=100, progress=False, tensorboard=False)  # fmt: skip
    final = train(str(hs), str(tmp_path / "draft"), cfg)
    rendering = json.loads((final / "config.json").read_text())["train"]["rendering"]
    assert rendering == {
        "mode": "chat",
        "chat_template_sha256": man["chat_template_sha256"],
        "chat_template_kwargs": {},
    }
    q = write_jsonl(
        tmp_path / "q.jsonl", [{"question_id": 0, "category": "all", "turns": ["What is the weather?"]}]
    )
    kw = dict(target=str(hybrid_dir), prompts=str(q), max_prompts=1, max_new_tokens=4, k=2, progress=False)
    with pytest.raises(ValueError, match="rendered otherwise.*chat_template_kwargs \\{\\} in training"):
        evaluate([str(tmp_path / "draft")], out=str(tmp_path / "e1"), chat_template_kwargs='{"enable_thinking": false}',
                 **kw)  # fmt: skip
    assert (
        evaluate([str(tmp_path / "draft")], out=str(tmp_path / "e2"), **kw) == 0
    )  # lossless, same rendering


def test_reasoning_left_out_of_the_loss(tmp_path, hybrid_dir):
    src = write_jsonl(tmp_path / "a.jsonl", agentic(4))
    with_r = prepare(str(src), str(tmp_path / "a"), target=str(hybrid_dir))
    without = prepare(str(src), str(tmp_path / "b"), target=str(hybrid_dir), reasoning_loss=False)
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (with_r, without))
    assert b["loss_tokens_by_kind"]["reasoning"] == 0 and a["loss_tokens_by_kind"]["reasoning"] > 0
    assert a["num_loss_tokens"] - b["num_loss_tokens"] == a["loss_tokens_by_kind"]["reasoning"]
    assert load_dataset(with_r).input_ids == load_dataset(without).input_ids


def test_parquet_arrow_save_to_disk_and_a_mixture(tmp_path, hybrid_dir):
    convs = agentic(6, seed=3)
    table = pa.table({"messages": [c["messages"] for c in convs], "tools": [json.dumps(TOOLS)] * 6})
    pq.write_table(table, tmp_path / "d.parquet")
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    disk = tmp_path / "saved"
    disk.mkdir()
    with (
        pa.OSFile(str(disk / "data-00000-of-00001.arrow"), "wb") as f,
        pa.ipc.new_stream(f, table.schema) as w,
    ):
        w.write_table(table)
    (disk / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (disk / "dataset_info.json").write_text("{}")
    seen = []
    for name in ("d.parquet", "d.arrow", "saved"):
        ds = prepare(str(tmp_path / name), str(tmp_path / f"ds-{name}"), target=str(hybrid_dir))
        seen.append(load_dataset(ds).input_ids)
        assert json.loads((ds / "manifest.json").read_text())["num_conversations"] == 6
    assert seen[0] == seen[1] == seen[2]
    jsonl = write_jsonl(tmp_path / "other.jsonl", agentic(12, seed=4))
    mixed = prepare([f"{tmp_path / 'd.parquet'}:0.5", f"{jsonl}:0.5"], str(tmp_path / "mix"), target=str(hybrid_dir),
                    seed=1)  # fmt: skip
    man = json.loads((mixed / "manifest.json").read_text())
    assert [(s["available"], s["taken"]) for s in man["sources"]] == [(6, 6), (12, 6)]
    assert man["num_conversations"] == 12
    again = prepare([f"{tmp_path / 'd.parquet'}:0.5", f"{jsonl}:0.5"], str(tmp_path / "mix2"), target=str(hybrid_dir),
                    seed=1)  # fmt: skip
    assert load_dataset(again).input_ids == load_dataset(mixed).input_ids  # deterministic given the seed

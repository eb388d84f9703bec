"""Samples the engine renders, round three (issue 58): a template whose assistant turn opens with its own `</think>`
(DeepSeek-V3.1's thinking switch), text parts joined or iterated as vLLM gives them, and turns ended by the next
role marker with stop ids in generation_config (GLM-4.5), over multi-turn reasoning, tool calls and text parts.

The fast tests check the samples against the template's own renderings; the `vllm` ones check every kept sample's
scored tokens against what vLLM renders for the turn (its prompt followed by the turn as vLLM renders the
conversation from the client's messages, tokenized by vLLM, minus the prompt), and that the engine check catches a
doubled close tag and a text part joined unlike vLLM.

`python tests/test_served_samples3.py` prints the table: family x switch -> conversations kept, dropped by reason,
turns by what ends them (vLLM checking every sample).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import needs_vllm  # noqa: E402
from standin_templates import GENERATION_STOPS, standin_stop_ids, standin_target, standin_tokenizer  # noqa: E402

from specdraft.data.messages import Dropped, normalize_record  # noqa: E402
from specdraft.data.render import NO_PROMPT, conversation_samples, decode, turn_text  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object"}}}]  # fmt: skip
CALL = {
    "type": "function",
    "id": "call_0",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
PARTS = [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]
SHAPES = {
    "reasoning, 3 turns": {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "I am a helper.", "reasoning_content": "Introduce myself."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Pick one\nquickly."},
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red.", "reasoning_content": "Again."}]},
    "inline reasoning, 2 turns": {"messages": [
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "<think>\nIntroduce myself.\n</think>\n\nI am a helper."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "<think>Pick one.</think>Blue."}]},
    "tool call + result": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool says sunny."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]},
    "text parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": PARTS},
        {"role": "assistant", "content": [{"type": "text", "text": "Both parts."}], "reasoning_content": "Read them."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, "this?"]},
        {"role": "assistant", "content": "This too."}]},
    "no reasoning, 2 turns": {"messages": [
        {"role": "user", "content": "Hi, who are you?"}, {"role": "assistant", "content": "A helper."},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]},
}  # fmt: skip
#: (stand-in, template kwargs, the switch as the table names it)
CONFIGS = [("deepseek_v31", {"thinking": True}, "thinking"), ("deepseek_v31", {}, "no thinking"),
           ("glm45", {}, "thinking"), ("glm45", {"enable_thinking": False}, "no thinking")]  # fmt: skip
IDS = [f"{f}-{s.replace(' ', '_')}" for f, _, s in CONFIGS]


def _conv(shape: str):
    conv, why = normalize_record(SHAPES[shape])
    assert why is None, why
    return conv


def _samples(family: str, kwargs: dict, shape: str, engine=None):
    tok = standin_tokenizer(family)
    conv = _conv(shape)
    return (
        tok,
        conv,
        conversation_samples(tok, conv, kwargs, engine=engine, stops=standin_stop_ids(family, tok)),
    )


def _scored(tok, sample) -> str:
    return decode(tok, [t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_a_turn_that_opens_with_its_own_close_tag_gets_it_once():
    """DeepSeek-V3.1 thinking: the prompt opens `<think>`, a past turn renders `</think>ANSWER<eos>`: the scored
    part is the reasoning then that rendering (one `</think>`), never `R\\n</think>\\n\\n</think>ANSWER`."""
    tok, conv, samples = _samples("deepseek_v31", {"thinking": True}, "reasoning, 3 turns")
    turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    assert len(samples) == len(turns)
    for s, i in zip(samples, turns):
        msgs = conv.messages
        upto = tok.apply_chat_template(msgs[: i + 1], tokenize=False, thinking=True)
        rendered = upto[upto.rindex("<｜Assistant｜>") + len("<｜Assistant｜>") :]
        assert rendered.startswith("</think>")
        assert _scored(tok, s) == msgs[i]["reasoning_content"] + rendered
    # a turn without reasoning: what the target writes after `<think>` is the rendering alone
    tok, conv, (s, _) = _samples("deepseek_v31", {"thinking": True}, "no reasoning, 2 turns")
    assert _scored(tok, s) == "</think>A helper.<｜end▁of▁sentence｜>"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_turns_without_an_end_marker_end_with_the_stop_id_the_target_writes(shape):
    """GLM-4.5: a turn ends where the next role marker begins; with `<|user|>` and `<|observation|>` among the stop
    ids, each scored turn ends with the one that follows it (`<|user|>` after the last), counted as such."""
    tok, conv, samples = _samples("glm45", {}, shape)
    turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    want = ["<|observation|>" if i + 1 < len(conv.messages) and conv.messages[i + 1]["role"] == "tool"
            else "<|user|>" for i in turns]  # fmt: skip
    assert len(samples) == len(turns)
    for s, end in zip(samples, want):
        assert _scored(tok, s).endswith(end) and _scored(tok, s).count(end) == 1
        assert s.ends == {f"stop id {end} (generation_config)": 1}
        assert tok.convert_tokens_to_ids(end) == s.input_ids[-1] and s.loss_mask[-1] == 1
    # without those stop ids (generation_config not read): nothing ends the turn, and that is what is counted
    samples = conversation_samples(tok, conv, {})
    assert [k for s in samples for k, v in s.ends.items() for _ in range(v)] == [
        "none (no stop id ends the turn)"
    ] * len(turns)
    assert not any(_scored(tok, s).endswith(("<|user|>", "<|observation|>")) for s in samples)


@pytest.mark.parametrize("family", ["deepseek_v31", "glm45"])
def test_text_parts_reach_the_template_as_vllm_gives_them(family):
    """A template that takes a string gets the parts joined with a newline (vLLM's join); one that iterates the
    parts (GLM-4.5) gets them as parts and joins them itself."""
    tok, conv, samples = _samples(family, {}, "text parts")
    prompt = decode(tok, samples[0].input_ids[: samples[0].loss_mask.index(1)])
    want = "part one, part two" if family == "glm45" else "part one, \npart two"
    assert want in prompt and ("part one, \npart two" in prompt) is (family != "glm45")


def test_thinking_off_with_reasoning_in_the_data_is_dropped_with_the_reason():
    with pytest.raises(Dropped, match="no prompt leads"):
        _samples("glm45", {"enable_thinking": False}, "reasoning, 3 turns")
    assert NO_PROMPT.startswith("no prompt leads")


#: a thinking switch that keeps only what follows `</think>` in an answer (never reading a reasoning field): with
#: thinking off every assistant turn, history included, opens with the closed empty block the prompt ends with
SPLIT_OFF = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}"
    "{{ '<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and not enable_thinking else '' }}"
    "{% if m.tool_calls %}{{ m.content }}{% for c in m.tool_calls %}{{ '<tool_call>' + c.function.name + '</tool_call>' }}"
    "{% endfor %}{% else %}{{ m.content.split('</think>')[-1] }}{% endif %}{% else %}{{ m.content }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{{ '<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and not enable_thinking else '' }}{% endif %}"
)


@pytest.mark.parametrize("shape", ["reasoning, 3 turns", "tool call + result"])
def test_reasoning_format_think_is_advised_only_where_it_keeps_the_samples_exact(shape, tmp_path, capsys):
    """Thinking off, reasoning in the data, a template that keeps what follows `</think>`: the format would score
    a leading `\\n\\n` (answers) or a `<think>` block after a prompt that switched thinking off (tool calls), so it
    does not hold and prepare does not advise it; on ChatML (the content as given) it holds."""  # noqa: D301
    from conftest import CHATML, build_tokenizer

    from specdraft.data.render import REASONING_LEFT_OUT, format_holds

    off = {"enable_thinking": False}
    tok, conv = build_tokenizer(SPLIT_OFF), _conv(shape)
    notes: list[str] = []
    conversation_samples(tok, conv, off, notes=notes)
    assert REASONING_LEFT_OUT in notes and "format" not in REASONING_LEFT_OUT  # said, with no advice in it
    assert not format_holds(tok, conv, off, "think")
    samples = conversation_samples(
        tok, conv, off, reasoning_format="think"
    )  # what the advice would have made
    bad = ("\n\n", "<think>") if shape.startswith("tool") else ("\n\n",)
    assert any(_scored(tok, s).startswith(bad[-1]) or "<think>" in _scored(tok, s) for s in samples), bad
    # ChatML writes the content as given (it renders no tool calls: that conversation is no sample either way)
    assert format_holds(build_tokenizer(CHATML), conv, {}, "think") is (shape == "reasoning, 3 turns")
    from specdraft.data.prepare import prepare

    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_text(json.dumps(SHAPES[shape]) + "\n")
    prepare(str(tmp_path / "d.jsonl"), str(tmp_path / "ds"), target=str(tmp_path / "tok"), renderer="template",
            chat_template_kwargs=json.dumps(off))  # fmt: skip
    out = capsys.readouterr().out
    assert (
        "--reasoning-format think was tried on 1 and would not keep 1 exact" in out and "trains it" not in out
    )


def test_reasoning_format_think_is_not_advised_for_deepseek_v31_without_thinking():
    """V3.1 with thinking off: answers keep only what follows `</think>`, and a tool call's `<think>` block would
    follow a prompt that closed thinking (`<｜Assistant｜></think>`): the format holds for no conversation."""
    from specdraft.data.render import format_holds

    tok = standin_tokenizer("deepseek_v31")
    for shape in ("reasoning, 3 turns", "tool call + result", "text parts"):
        assert not format_holds(tok, _conv(shape), {}, "think"), shape


# ---------------------------------------------------------------------------------------------------------
# against vLLM's renderer


def client_messages(shape: str) -> list[dict]:
    """The conversation as an OpenAI client sends it back, written out here: reasoning in `reasoning` (inline
    reasoning split as vLLM's reasoning parser splits it), text parts as given, arguments as JSON text."""
    out = []
    for m in SHAPES[shape]["messages"]:
        m = dict(m)
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
        if isinstance(m["content"], str) and m["content"].startswith("<think>"):
            m["reasoning"], m["content"] = m["content"][len("<think>") :].split("</think>", 1)
        if isinstance(m["content"], list):
            m["content"] = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in m["content"]]
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]  # fmt: skip
        out.append(m)
    return out


def vllm_turn(engine, family: str, msgs: list[dict], i: int, kwargs: dict) -> tuple[str, str]:
    """(vLLM's prompt for assistant turn i, the turn the target writes after it), from vLLM's renderings alone:
    the rendering through the turn past the prompt when it extends it; else (DeepSeek-V3.1, whose past turns
    open with `</think>` after the header) the reasoning then the rendering past the header; GLM-4.5's turn then
    the next role marker (a stop id)."""
    tools = TOOLS if any(m.get("tool_calls") for m in msgs) else None
    prompt, _ = engine.render(msgs[:i], tools, True, kwargs)
    upto, _ = engine.render(msgs[: i + 1], tools, False, kwargs)
    reasoning = (msgs[i].get("reasoning") or "").strip()
    if upto.startswith(prompt):
        turn = upto[len(prompt) :].rstrip()
    else:
        assert family == "deepseek_v31" and prompt.endswith("<｜Assistant｜><think>"), (prompt, upto)
        turn = reasoning + upto[upto.rindex("<｜Assistant｜>") + len("<｜Assistant｜>") :]
    if family == "glm45":
        turn += "<|observation|>" if i + 1 < len(msgs) and msgs[i + 1]["role"] == "tool" else "<|user|>"
    return prompt, turn


def _prepare(tmp_path, family: str, kwargs: dict, shapes: list[str]):
    from specdraft.data.prepare import load_dataset, prepare

    target = standin_target(family, tmp_path / f"target-{family}")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(SHAPES[s]) for s in shapes) + "\n")
    out = prepare(str(data), str(tmp_path / "ds"), target=str(target), chat_template_kwargs=json.dumps(kwargs),
                  renderer="vllm", overwrite=True)  # fmt: skip
    return target, load_dataset(out)


@needs_vllm
@pytest.mark.parametrize(("family", "kwargs", "switch"), CONFIGS, ids=IDS)
def test_every_scored_token_is_what_vllm_renders_for_the_turn(tmp_path, family, kwargs, switch):
    from specdraft.data.engine_render import engine_renderer

    target, ds = _prepare(tmp_path, family, kwargs, list(SHAPES))
    man = ds.manifest
    assert man["renderer"].startswith("vllm ")
    engine, _ = engine_renderer(target, None, "vllm")
    records, turn_nos = _records_and_turns(ds)
    n_turns = 0
    for row, (record, turn_no) in enumerate(zip(records, turn_nos)):
        msgs = client_messages(list(SHAPES)[record])
        turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        one = records.count(record) == 1  # one sample for the whole conversation: every turn in it
        done = 0
        for i in turns if one else [turns[turn_no]]:
            prompt, turn = vllm_turn(engine, family, msgs, i, kwargs)
            head, ids = engine.encode(prompt), engine.encode(prompt + turn)
            got, mask = ds.input_ids[row], ds.loss_mask[row]
            assert got[: len(ids)] == ids and (one or len(got) == len(ids)), (record, i, prompt, turn)
            assert mask[done : len(head)] == [0] * (len(head) - done) and all(mask[len(head) : len(ids)]), (
                record,
                i,
            )
            done, n_turns = len(ids), n_turns + 1
        assert not any(ds.loss_mask[row][done:]), (record, turn_no)  # nothing scored past the last turn
    ends = man["turn_ends"]
    if family == "glm45":
        assert set(ends) <= {f"stop id {m} (generation_config)" for m in GENERATION_STOPS["glm45"]}, ends
    else:
        assert set(ends) == {"end token <｜end▁of▁sentence｜>"}, ends
    assert sum(ends.values()) == n_turns  # every scored turn counted once
    dropped = set(man["dropped"])
    assert dropped == ({NO_PROMPT} if (family, switch) == ("glm45", "no thinking") else set()), dropped


def _records_and_turns(ds):
    import pyarrow.parquet as pq

    t = pq.read_table(ds.path / "data.parquet", columns=["record", "turn"])
    return t.column("record").to_pylist(), t.column("turn").to_pylist()


@needs_vllm
def test_the_engine_check_catches_a_doubled_close_tag_doubled_newlines_and_a_part_joined_unlike_vllm(
    tmp_path,
):
    from specdraft.data.engine_render import engine_renderer
    from specdraft.data.render import Sample

    engine, _ = engine_renderer(standin_target("deepseek_v31", tmp_path / "t"), None, "vllm")
    tok, conv, samples = _samples("deepseek_v31", {"thinking": True}, "reasoning, 3 turns", engine=engine)
    assert len(samples) == 3  # kept: vLLM agrees
    t = turn_text(tok, conv, 2, {"thinking": True})
    doubled = replace(t, text="Introduce myself.\n</think>\n\n" + t.text[len("Introduce myself.") :])
    ids = tok(doubled.before + doubled.text, add_special_tokens=False)["input_ids"]
    n = len(tok(doubled.before, add_special_tokens=False)["input_ids"])
    bad = Sample(ids, [0] * n + [1] * (len(ids) - n), prompts=[n])
    with pytest.raises(Dropped, match="^vllm .*scored turn"):
        engine.check(conv, [(2, doubled)], [bad], {"thinking": True})
    # the newlines around the reasoning doubled (no target writes `\n\nR\n\n</think>`)
    spaced = replace(t, text="\n\nIntroduce myself.\n\n" + t.text[len("Introduce myself.") :])
    ids = tok(spaced.before + spaced.text, add_special_tokens=False)["input_ids"]
    with pytest.raises(Dropped, match="^vllm .*scored turn"):
        engine.check(conv, [(2, spaced)], [Sample(ids, [0] * n + [1] * (len(ids) - n), prompts=[n])],
                      {"thinking": True})  # fmt: skip
    # a text part joined with nothing (as prepare joined them before): vLLM joins them with a newline
    conv = _conv("text parts")
    conv.messages[1]["content"] = "part one, part two"
    with pytest.raises(Dropped, match="^vllm .* renders the prompt of a turn unlike the template"):
        conversation_samples(tok, conv, {"thinking": True}, engine=engine)


def table(tmp: Path) -> list[tuple[str, str, int, dict, dict, dict]]:
    rows = []
    for family, kwargs, switch in CONFIGS:
        d = tmp / f"{family}-{switch.replace(' ', '_')}"
        _, ds = _prepare(d, family, kwargs, list(SHAPES))
        m = ds.manifest
        rows.append((family, switch, m["num_conversations"], {k: v["count"] for k, v in m["dropped"].items()},
                     m["turn_ends"], {k: v["count"] for k, v in m["repaired"].items()}))  # fmt: skip
    return rows


if __name__ == "__main__":
    import tempfile

    print(
        "| family | switch | kept (of 5) | dropped (reason: count) | kept with a note | what ends each scored turn |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family, switch, kept, dropped, ends, notes in table(Path(tmp)):
            drops = "; ".join(f"{k[:60]}: {v}" for k, v in dropped.items()) or "-"
            said = "; ".join(f"{k[:60]}: {v}" for k, v in notes.items()) or "-"
            stops = ", ".join(f"{k}: {v}" for k, v in ends.items())
            print(f"| {family} | {switch} | {kept} | {drops} | {said} | {stops} |")

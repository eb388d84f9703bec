"""Samples the serving engine renders (issue 47): reasoning reaches the template under the name it reads.

Templates in the style of gpt-oss (harmony channels, reasoning read from `thinking`, `<|return|>` on the final
turn and `<|end|>` in history, tool calls in the header on the commentary channel, `strftime_now` in the system
preamble) and of Mistral (the system prompt joined to the last user message, `[AVAILABLE_TOOLS]` before it,
`[TOOL_CALLS]` with 9-character ids, reasoning read from `reasoning` in a Magistral-style `[THINK]` block), each
with its markers as special tokens (the tiny tokenizer of conftest) and as plain text (the embedded default's
tokenizer), over multi-turn conversations with reasoning in each of the three field names, inline reasoning,
parallel tool calls and tool results. Every kept sample is decoded and compared, as text, with the template's
own renderings (the messages given to it here by hand, reasoning under the name it reads), independently of
specdraft's renderer; reasoning is kept wherever the template renders it.

`python tests/test_served_samples.py` prints the table: family x markers x data shape -> samples kept, dropped
(by reason), reasoning tokens kept, self-check mismatches.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import build_tokenizer  # noqa: E402
from standin_templates import TEMPLATES, standin_tokenizer  # noqa: E402

from specdraft.data.messages import Dropped, normalize_record  # noqa: E402
from specdraft.data.render import (  # noqa: E402
    REASONING_LEFT_OUT,
    REASONING_LEFT_OUT_CHANNELS,
    conversation_samples,
    decode,
    template_traits,
)

TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {"type": "object"}}}
         for n, d in (("get_weather", "Weather of a city."), ("get_time", "Local time of a city."))]  # fmt: skip
READS = {"gpt_oss": "thinking", "mistral": "reasoning"}  # the field each stand-in renders reasoning from


def _call(i: int, name: str, city: str, id_: str = "") -> dict:
    return {
        "type": "function",
        "id": id_ or f"call{i:05d}",
        "function": {"name": name, "arguments": {"city": city}},
    }


def _fields(name: str) -> dict:
    return {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "I am a helper.", name: "Introduce myself."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue.", name: "Pick one\nquickly."},
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red.", name: "Again."}]}  # fmt: skip


SHAPES = {
    "reasoning_content, 3 turns": _fields("reasoning_content"),
    "reasoning, 3 turns": _fields("reasoning"),
    "thinking, 3 turns": _fields("thinking"),
    "inline reasoning, 2 turns": {"messages": [
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "<think>\nIntroduce myself.\n</think>\n\nI am a helper."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "<think>Pick one.</think>Blue."}]},
    "parallel calls + results": {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Rome?"},
        {"role": "assistant", "content": "", "thinking": "Two tools.",
         "tool_calls": [_call(0, "get_weather", "Rome"), _call(1, "get_time", "Rome")]},
        {"role": "tool", "tool_call_id": "call00000", "name": "get_weather", "content": "rain"},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_time", "content": "noon"},
        {"role": "assistant", "content": "Rain at noon.", "reasoning": "Both came back."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]},
    "tool call, short ids": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [_call(0, "get_weather", "Paris", "call_0")]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool says sunny."}]},
    "no reasoning, 2 turns": {"messages": [
        {"role": "user", "content": "Hi, who are you?"}, {"role": "assistant", "content": "A helper."},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]},
}  # fmt: skip
FAMILIES = sorted(READS)
SHORT_IDS = "chat template error: Tool call IDs should be alphanumeric strings with length 9!"


@functools.cache
def _embedded():
    from specdraft.targets import load_tokenizer

    return load_tokenizer("smollm2-135m")


def tokenizer(family: str, markers: str):
    """The family's template with its markers as special tokens, or as plain text (the embedded default)."""
    if markers == "special":
        return standin_tokenizer(family)
    tok = _embedded()
    tok.chat_template = TEMPLATES[family].read_text()
    return tok


def expected_drop(family: str, shape: str) -> str:
    return SHORT_IDS if family == "mistral" and shape == "tool call, short ids" else ""


def tpl(tok, messages: list[dict], tools, gen: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def parser_split(text: str) -> tuple[str, str]:
    """(reasoning, content) of `<think>R</think>C` as vLLM's reasoning parsers give them to a client."""
    reasoning, _, content = text.partition("<think>")[2].partition("</think>")
    return reasoning, content


def as_read(conv, name: str) -> list[dict]:
    """The conversation's messages as a client sends them back (inline reasoning split as the reasoning parser
    splits it), each turn's reasoning under `name`: written out here, not by specdraft."""
    msgs = [{**m, **dict(zip(("reasoning_content", "content"), parser_split(conv.inline_reasoning[i])))}
            if i in conv.inline_reasoning else m for i, m in enumerate(conv.messages)]  # fmt: skip
    return [{**{k: v for k, v in m.items() if k != "reasoning_content"}, name: m["reasoning_content"]}
            if m.get("reasoning_content") else m for m in msgs]  # fmt: skip


def check(tok, family: str, conv, samples) -> int:
    """Assert every sample is the template's rendering (prompt and turn); returns its reasoning tokens."""
    msgs = as_read(conv, READS[family])
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if len(samples) == 1 and len(turns) > 1:  # one sample: the whole rendering, each turn's loss run its text
        (s,) = samples
        assert decode(tok, s.input_ids) == tpl(tok, msgs, conv.tools, False)
        runs = [m.span() for m in re.finditer("1+", "".join(map(str, s.loss_mask)))]
        assert len(runs) == len(turns)
        for (a, b), i in zip(runs, turns):
            prompt = tpl(tok, msgs[:i], conv.tools, True)
            assert decode(tok, s.input_ids[:a]) == prompt
            assert (
                prompt + decode(tok, s.input_ids[a:b]) == tpl(tok, msgs[: i + 1], conv.tools, False).rstrip()
            )
    else:
        assert len(samples) == len(turns)
        for s, i in zip(samples, turns):
            n = s.loss_mask.index(1)
            assert s.loss_mask == [0] * n + [1] * (len(s.loss_mask) - n)
            prompt, scored = decode(tok, s.input_ids[:n]), decode(tok, s.input_ids[n:])
            assert prompt == tpl(tok, msgs[:i], conv.tools, True)  # the prompt the engine renders
            assert prompt + scored == tpl(tok, msgs[: i + 1], conv.tools, False).rstrip()  # then the turn
    for s, i in zip(samples if len(samples) == len(turns) else samples * len(turns), turns):
        scored = decode(tok, [t for t, m in zip(s.input_ids, s.loss_mask) if m])
        reasoning = (msgs[i].get(READS[family]) or "").strip()
        assert not reasoning or reasoning in scored, (i, scored)  # kept wherever the template renders it
        if family == "gpt_oss" and reasoning and len(samples) == len(turns):
            assert scored.startswith("<|channel|>analysis<|message|>")  # what the target writes first
    return sum(s.kinds.get("reasoning", 0) for s in samples)


def run(family: str, markers: str, shape: str, notes: list | None = None) -> tuple[int, str, int]:
    """(samples kept, the drop reason or '', reasoning tokens kept) of one data shape, every sample checked."""
    tok = tokenizer(family, markers)
    conv, why = normalize_record(SHAPES[shape])
    assert why is None, why
    try:
        samples = conversation_samples(tok, conv, template=f"the {family} template", notes=notes)
    except Dropped as e:
        return 0, str(e), 0
    return len(samples), "", check(tok, family, conv, samples)


@pytest.mark.parametrize("markers", ["special", "text"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_sample_is_the_rendering_and_keeps_the_reasoning(family, markers):
    for shape in SHAPES:
        notes: list[str] = []
        kept, why, reasoning = run(family, markers, shape, notes)
        want = expected_drop(family, shape)
        assert why == want, (shape, why)
        assert kept or want, shape
        assert not notes, (shape, notes)  # the template renders reasoning: nothing is said to be left out
        has_reasoning = shape not in ("no reasoning, 2 turns",)
        assert (reasoning > 0) == (has_reasoning and not want), (shape, reasoning)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_finds_the_name_each_template_reads(family):
    traits = template_traits(standin_tokenizer(family), {})
    assert traits.name == READS[family] and traits.think is None
    assert traits.channels is (family == "gpt_oss")


def test_a_channel_template_never_gets_think_advice():
    """A harmony template that reads none of the three names: the reasoning is left out and said so, without
    `<think>` advice, and `--reasoning-format think` (which would put <think> tags in its turns) is refused."""
    text = TEMPLATES["gpt_oss"].read_text().replace("m.thinking", "m.analysis")
    tok = build_tokenizer(text)
    conv, _ = normalize_record(SHAPES["thinking, 3 turns"])
    notes: list[str] = []
    samples = conversation_samples(tok, conv, notes=notes)
    assert notes == [REASONING_LEFT_OUT_CHANNELS] * 3 and REASONING_LEFT_OUT not in notes
    assert "think" not in REASONING_LEFT_OUT_CHANNELS.replace("thinking", "")
    assert all("Pick one" not in decode(tok, s.input_ids) for s in samples)
    with pytest.raises(ValueError, match="channel template"):
        conversation_samples(tok, conv, reasoning_format="think")


def table() -> list[tuple[str, str, str, int, str, int]]:
    rows = []
    for family in FAMILIES:
        for markers in ("special", "text"):
            for shape in SHAPES:
                kept, why, reasoning = run(family, markers, shape)
                rows.append((family, markers, shape, kept, why, reasoning))
    return rows


if __name__ == "__main__":
    print("| template | markers | data shape | samples kept | dropped (reason) | reasoning tokens kept "
          "| self-check mismatches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for family, markers, shape, kept, why, reasoning in table():
        print(f"| {family} | {markers} | {shape} | {kept} | {why[:70] or '-'} | {reasoning} "
              f"| {int(why.startswith('self-check'))} |")  # fmt: skip

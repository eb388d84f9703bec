"""Loss spans through the three stand-in families (tests/templates): what each assistant turn's sample holds,
token by token, worked out by hand from the renderings pinned in tests/test_standin_templates.py."""

from __future__ import annotations

import json

import pytest
from conftest import CHATML, build_tokenizer
from standin_templates import standin_tokenizer

from specdraft.data.messages import Dropped, normalize_record
from specdraft.data.render import conversation_samples, think_format, turn_text

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": {"type": "object"}}}]  # fmt: skip
CALL = {
    "type": "function",
    "id": "call_0",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CHAT = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool says sunny."}]}  # fmt: skip

#: family -> what the target generates for each assistant turn (the scored text of each sample), by hand
EXPECTED = {
    "hybrid_thinking": [
        "<think>\nGreet back.\n</think>\n\nHello!<|im_end|>",
        '<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>",
        "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny.<|im_end|>",
    ],
    "deepseek_r1": [  # the prompt opens <think>\n; R1 renders no reasoning, the completion is built
        "Greet back.\n</think>\n\nHello!<｜end▁of▁sentence｜>",
        "Need the tool.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        # after tool outputs the prompt opens no think block and R1 renders no reasoning: it is left out (never
        # invented), and the turn is what the template renders
        "It is sunny.<｜end▁of▁sentence｜>",
    ],
    "kimi_k2_thinking": [
        "<think>Greet back.</think>Hello!<|im_end|>",
        "<think>Need the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "<think>The tool says sunny.</think>It is sunny.<|im_end|>",
    ],
}


def _args_as_text(messages: list[dict]) -> list[dict]:
    """The messages with each tool call's arguments as JSON text (what R1's template concatenates)."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]  # fmt: skip


def _scored(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_each_turn_scored_after_its_own_prompt(family):
    tok = standin_tokenizer(family)
    conv, why = normalize_record(CHAT)
    assert why is None
    samples = conversation_samples(tok, conv)
    assert [_scored(tok, s) for s in samples] == EXPECTED[family]  # one sample per turn: history is rewritten
    for k, (i, s) in enumerate(zip((1, 3, 5), samples)):
        msgs = _args_as_text(conv.messages) if family == "deepseek_r1" else conv.messages  # R1 concatenates
        prompt = tok.apply_chat_template(msgs[:i], tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]  # fmt: skip
        # token for token: the prompt the template builds to generate turn k, then that turn's tokens
        assert s.input_ids[: len(prompt)] == list(prompt), (family, k)
        assert not any(s.loss_mask[: len(prompt)]) and all(s.loss_mask[len(prompt) :]), (family, k)
        assert tok.decode(s.input_ids[len(prompt) :]) == EXPECTED[family][k]


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_kinds_are_counted_and_reasoning_can_be_left_out(family):
    tok = standin_tokenizer(family)
    conv, _ = normalize_record(CHAT)
    full, bare = conversation_samples(tok, conv), conversation_samples(tok, conv, reasoning_loss=False)
    assert [s.input_ids for s in full] == [s.input_ids for s in bare]
    left_out = family == "deepseek_r1"  # the turn after tool outputs: no think block, its reasoning left out
    assert [s.kinds["reasoning"] > 0 for s in full] == [True, True, not left_out]
    assert all(s.kinds["reasoning"] == 0 for s in bare)
    assert full[1].kinds["tool_call"] > 0 and full[0].kinds["tool_call"] == 0
    for f, b in zip(full, bare):  # leaving reasoning out removes exactly the reasoning tokens
        assert sum(f.loss_mask) - sum(b.loss_mask) == f.kinds["reasoning"]
        assert "Greet back." not in _scored(tok, b) and "The tool says" not in _scored(tok, b)


def test_think_format_is_learned_from_the_template():
    assert think_format(standin_tokenizer("hybrid_thinking"), {}) == ("<think>\n", "\n</think>\n\n")
    assert think_format(standin_tokenizer("kimi_k2_thinking"), {}) == ("<think>", "</think>")
    assert think_format(standin_tokenizer("deepseek_r1"), {}) is None  # R1 renders no reasoning: no default


def test_hybrid_thinking_off_answers_after_the_empty_think_block():
    tok = standin_tokenizer("hybrid_thinking")
    conv, _ = normalize_record(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    )
    turn = turn_text(tok, conv, 1, {"enable_thinking": False})
    before, done = turn.before, turn.text
    assert before.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and done.startswith("Hello!")


def test_stable_template_keeps_one_sample_per_conversation():
    tok = build_tokenizer(CHATML)
    conv, _ = normalize_record({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]})  # fmt: skip
    (s,) = conversation_samples(tok, conv)
    assert _scored(tok, s) == "Hello!<|im_end|>Bye!<|im_end|>"


def test_a_template_that_renders_no_assistant_text_is_dropped():
    tok = build_tokenizer(
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    conv, _ = normalize_record(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    )
    with pytest.raises(Dropped, match="unlike its own generation prompt"):
        conversation_samples(tok, conv)

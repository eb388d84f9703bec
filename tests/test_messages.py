"""Record shapes -> normalised conversations: content parts, tool calls, tool results, reasoning, ShareGPT
function calling, and a true reason for every record dropped."""

from __future__ import annotations

import pytest

from specdraft.data.messages import LEADING_DROPPED, normalize_record

USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"type": "function", "id": "c1", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def test_content_parts_are_joined_as_vllm_joins_them_and_kept_as_given():
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    conv, why = normalize_record({"messages": [
        {"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}]})  # fmt: skip
    assert why is None
    assert [m["content"] for m in conv.messages] == [
        "Hi \nthere",
        "Hello.",
    ]  # vLLM's join for a string template
    assert conv.parts == {0: parts, 1: [{"type": "text", "text": "Hello."}]}  # what a client sends


def test_tool_calls_results_and_tools_reach_the_template():
    conv, why = normalize_record({"tools": TOOLS, "messages": [
        USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "assistant", "content": "18 C in Paris."}]})  # fmt: skip
    assert why is None
    assert conv.tools == TOOLS
    call = conv.messages[1]["tool_calls"][0]
    assert call == {
        "type": "function",
        "id": "c1",
        "function": {"name": "weather", "arguments": {"city": "Paris"}},
    }
    assert conv.messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    "turn, reasoning, content",
    [
        ({"reasoning_content": "It is sunny."}, "It is sunny.", "Sunny."),
        ({"reasoning": "It is sunny."}, "It is sunny.", "Sunny."),
        ({"thinking": "It is sunny."}, "It is sunny.", "Sunny."),
        ({"content": "<think>\nIt is sunny.\n</think>\n\nSunny."}, "It is sunny.", "Sunny."),
    ],
)
def test_reasoning_as_a_field_or_inline_becomes_reasoning_content(turn, reasoning, content):
    conv, why = normalize_record({"messages": [USER, {"role": "assistant", "content": "Sunny.", **turn}]})
    assert why is None
    assert conv.messages[1]["reasoning_content"] == reasoning
    assert conv.messages[1]["content"] == content
    assert conv.has_reasoning


def test_sharegpt_function_calling_turns():
    conv, why = normalize_record({"tools": '[{"name": "weather", "parameters": {}}]', "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": "18 C"},
        {"from": "gpt", "value": "18 C."}]})  # fmt: skip
    assert why is None
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[1]["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": {"city": "Paris"},
    }
    assert conv.tools == [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


def test_sharegpt_function_call_joins_the_assistant_text_before_it():
    conv, why = normalize_record({"conversations": [
        {"from": "human", "value": "Weather?"}, {"from": "gpt", "value": "Let me check."},
        {"from": "function_call", "value": '{"name": "weather", "arguments": "{}"}'},
        {"from": "observation", "value": "18 C"}, {"from": "gpt", "value": "18 C."}]})  # fmt: skip
    assert why is None
    assert conv.messages[1]["content"] == "Let me check." and conv.messages[1]["tool_calls"]


@pytest.mark.parametrize(
    "messages, reason",
    [
        (
            [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": "A cat."},
            ],
            "image part",
        ),
        (
            [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
                {"role": "assistant", "content": "Hi."},
            ],
            "audio part",
        ),
        (
            [
                USER,
                {"role": "assistant", "content": "x"},
                {"role": "tool", "content": "18 C"},
                {"role": "assistant", "content": "y"},
            ],
            "tool result with no call before it",
        ),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "weather", "arguments": "{city: Paris"}}
                    ],
                },
            ],
            "tool-call arguments are not JSON",
        ),
        (
            [USER, {"role": "assistant", "content": "<think>a</think>b", "reasoning_content": "a"}],
            "reasoning given twice",
        ),
        (
            [USER, {"role": "assistant", "content": "b", "reasoning_content": "a", "reasoning": "c"}],
            "reasoning given twice",
        ),
        ([USER, {"role": "assistant", "content": " "}], "empty content"),
        ([USER, USER, {"role": "assistant", "content": "x"}], "roles do not alternate"),
        (
            [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                USER,
                {"role": "assistant", "content": "x"},
            ],
            "tool call with no result after it",
        ),
    ],
)
def test_every_drop_keeps_a_true_reason(messages, reason):
    assert normalize_record({"messages": messages}) == (None, reason)


def test_leading_assistant_turn_is_a_counted_repair():
    repairs: list[str] = []
    conv, why = normalize_record({"messages": [{"role": "assistant", "content": "Hi"}, USER,
                                               {"role": "assistant", "content": "Sunny."}]}, repairs)  # fmt: skip
    assert why is None and repairs == [LEADING_DROPPED]
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]


def test_hermes_inline_tool_calls_and_responses_are_read_as_tool_calls():
    """Issue 36 item 6: Hermes-style `<tool_call>` JSON in a gpt turn, `<tool_response>` in a tool (or human)
    turn: read as tool calls and tool results, not dropped nor scored as plain text."""
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for result_from in ("tool", "human"):
        conv, why = normalize_record({"conversations": [
            {"from": "human", "value": "Weather in Oslo and Rome?"},
            {"from": "gpt", "value": "Checking.\n" + call + "\n" + call.replace("Oslo", "Rome")},
            {"from": result_from, "value": "<tool_response>\nsnow\n</tool_response>\n<tool_response>\nrain\n</tool_response>"},
            {"from": "gpt", "value": "Snow and rain."}]})  # fmt: skip
        assert why is None, why
        assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "tool", "assistant"]
        assert conv.messages[1]["content"] == "Checking."
        assert [c["function"] for c in conv.messages[1]["tool_calls"]] == [
            {"name": "weather", "arguments": {"city": "Oslo"}},
            {"name": "weather", "arguments": {"city": "Rome"}},
        ]
        assert [m["content"] for m in conv.messages[2:4]] == ["snow", "rain"]


@pytest.mark.parametrize(
    "value, reason",
    [
        ('<functioncall> {"name": "weather", "arguments": "{}"}', "Glaive-style inline <functioncall>"),
        ("<tool_call>\nnot json\n</tool_call>", "Hermes-style inline <tool_call> that is not JSON"),
        (
            '<tool_call>{"name": "w", "arguments": {}}</tool_call> and more',
            "Hermes-style inline <tool_call> text",
        ),
    ],
)
def test_inline_call_formats_that_cannot_be_read_are_refused_naming_the_format(value, reason):
    conv, why = normalize_record(
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": value}]}
    )
    assert conv is None and why.startswith(reason)


def test_the_arguments_and_inline_reasoning_as_the_data_gave_them_are_kept_aside():
    conv, why = normalize_record({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "<think>Hot.</think>18 C."}]})  # fmt: skip
    assert why is None
    assert conv.arguments_text == {(1, 0): '{"city": "Paris"}'}
    assert conv.inline_reasoning == {3: "<think>Hot.</think>18 C."} and conv.messages[3]["content"] == "18 C."

"""The stand-in chat templates (tests/templates/) render the shapes of the families they stand in for.

Expected renderings are written out by hand from tests/templates/README.md, not produced by the templates.
"""

from __future__ import annotations

import functools
import json

import pytest
from standin_templates import SPECIAL_TOKENS, TEMPLATES, standin_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue.", "reasoning_content": "Pick one."},
]
CALL = {
    "type": "function",
    "id": "call_0",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool says sunny."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
)


@functools.cache
def _tok(name: str):
    return standin_tokenizer(name)


def render(name: str, messages: list[dict], gen: bool = False, **kwargs) -> str:
    if name in (
        "deepseek_r1",
        "deepseek_v31",
    ):  # R1's template concatenates the arguments: it takes them as JSON text
        messages = args_as_text(messages)
    return _tok(name).apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)


def args_as_text(messages: list[dict]) -> list[dict]:
    """The messages with each tool call's arguments as JSON text."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# hybrid_thinking (Qwen3-style)
# ---------------------------------------------------------------------------------------------------------
def test_hybrid_drops_reasoning_before_the_last_user_query():
    assert render("hybrid_thinking", [SYSTEM, *CHAT]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nName a color.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nPick one.\n</think>\n\nBlue.<|im_end|>\n"
    )


def test_hybrid_tools_in_the_system_block_and_tool_call_blocks():
    system = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou can call the functions below to help with the request. "
        "Each signature is a JSON object on its own line inside <tools></tools> tags:\n"
        f"<tools>\n{TOOL_JSON}\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    assert render("hybrid_thinking", [SYSTEM, *TOOL_CHAT], tools=TOOLS) == system + (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"  # both turns follow the last query
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nThe tool says sunny.\n</think>\n\nIt is sunny.<|im_end|>\n"
    )
    # without a system message the tools still open a system turn
    assert render("hybrid_thinking", TOOL_CHAT[:1], tools=TOOLS).startswith(
        "<|im_start|>system\n# Tools\n\nYou can call"
    )


@pytest.mark.parametrize(
    "kwargs, tail",
    [
        ({}, "<|im_start|>assistant\n"),
        ({"enable_thinking": True}, "<|im_start|>assistant\n"),
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)
def test_hybrid_generation_prompt_follows_enable_thinking(kwargs, tail):
    head = (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nName a color.<|im_end|>\n"
    )
    assert render("hybrid_thinking", CHAT[:3], gen=True, **kwargs) == head + tail


def test_hybrid_non_thinking_answer_extends_its_prompt():
    """With enable_thinking=False the last turn renders the same empty think block the prompt ends with."""
    msgs = [*CHAT[:3], {"role": "assistant", "content": "Blue."}]
    prompt = render("hybrid_thinking", msgs[:3], gen=True, enable_thinking=False)
    assert render("hybrid_thinking", msgs, enable_thinking=False) == prompt + "Blue.<|im_end|>\n"


# ---------------------------------------------------------------------------------------------------------
# deepseek_r1
# ---------------------------------------------------------------------------------------------------------
def test_deepseek_drops_reasoning_from_every_assistant_turn():
    assert render("deepseek_r1", [SYSTEM, *CHAT]) == (
        "<｜begin▁of▁sentence｜>Be brief."
        "<｜User｜>Hi<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>Name a color.<｜Assistant｜>Blue.<｜end▁of▁sentence｜>"
    )


def test_deepseek_tool_call_tokens_and_ignored_tools():
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        "It is sunny.<｜end▁of▁sentence｜>"  # no <｜Assistant｜> after tool outputs
    )
    assert render("deepseek_r1", TOOL_CHAT, tools=TOOLS) == expected
    assert render("deepseek_r1", TOOL_CHAT) == expected  # R1's template does not render `tools`


def test_deepseek_generation_prompt_forces_thinking_except_after_tool_outputs():
    assert (
        render("deepseek_r1", CHAT[:1], gen=True)
        == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
    )
    after_tool = render("deepseek_r1", TOOL_CHAT[:3], gen=True)
    assert after_tool.endswith("<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    assert after_tool == render("deepseek_r1", TOOL_CHAT[:3])


def test_deepseek_multiple_tool_outputs_share_one_block():
    calls = [
        CALL,
        {**CALL, "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
    ]
    msgs = [
        TOOL_CHAT[0],
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
        {"role": "user", "content": "Thanks"},
    ]
    assert render("deepseek_r1", msgs) == (
        "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜>Checking.<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny"
        "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>rainy<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜User｜>Thanks"
    )


# ---------------------------------------------------------------------------------------------------------
# kimi_k2_thinking
# ---------------------------------------------------------------------------------------------------------
KIMI_SYSTEM = (
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
)
KIMI_DECLARE = (
    '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
    '"description":"Weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},'
    '"required":["city"]}}}]<|im_end|>'
)
KIMI_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def test_kimi_full_conversation_drops_all_reasoning():
    """Everything up to the last answer without tool calls is history: even that answer loses its reasoning."""
    assert render("kimi_k2_thinking", CHAT) == KIMI_SYSTEM + (
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Name a color.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Blue.<|im_end|>"
    )


def test_kimi_keeps_reasoning_after_the_last_final_answer():
    head = KIMI_DECLARE + "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
    user = "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    result = "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
    # mid tool chain (no final answer yet): the tool-calling turn keeps its reasoning
    assert render("kimi_k2_thinking", [SYSTEM, *TOOL_CHAT[:3]], gen=True, tools=TOOLS) == head + user + (
        f"<|im_assistant|>assistant<|im_middle|><think>Need the tool.</think>{KIMI_CALL}<|im_end|>"
        f"{result}<|im_assistant|>assistant<|im_middle|>"
    )
    # once the final answer is in, the whole chain is history
    assert render("kimi_k2_thinking", [SYSTEM, *TOOL_CHAT], tools=TOOLS) == head + user + (
        f"<|im_assistant|>assistant<|im_middle|><think></think>{KIMI_CALL}<|im_end|>"
        f"{result}<|im_assistant|>assistant<|im_middle|><think></think>It is sunny.<|im_end|>"
    )


def test_kimi_call_ids_count_over_the_conversation():
    """OpenAI-style ids become functions.NAME:IDX (IDX over the whole conversation); Kimi-shaped ids are kept."""
    second = {"type": "function", "id": "call_9", "function": {"name": "get_time", "arguments": {}}}
    kept = {
        "type": "function",
        "id": "functions.get_time:7",
        "function": {"name": "get_time", "arguments": {}},
    }
    msgs = [
        TOOL_CHAT[0],
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "assistant", "content": "And the time.", "tool_calls": [second, kept]},
        {"role": "tool", "tool_call_id": "call_9", "content": "noon"},
        {"role": "tool", "tool_call_id": "functions.get_time:7", "content": "noon"},
    ]
    out = render("kimi_k2_thinking", msgs, gen=True)
    assert out.endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>And the time.<|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_call_begin|>functions.get_time:7<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\nnoon<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_time:7\nnoon<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert "## Return of functions.get_weather:0\nsunny" in out


# ---------------------------------------------------------------------------------------------------------
# all three: the prompt of the last turn vs that turn rendered, and one token per special marker
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, conv, extends",
    [
        ("hybrid_thinking", CHAT, True),
        ("hybrid_thinking", TOOL_CHAT, True),
        ("kimi_k2_thinking", CHAT, True),
        ("kimi_k2_thinking", TOOL_CHAT, False),  # the final answer turns the tool-calling turn into history
        ("deepseek_r1", CHAT, False),  # prompt ends <think>\n, the rendered turn has no reasoning
        ("deepseek_r1", TOOL_CHAT, True),  # after tool outputs there is no prompt to contradict
    ],
)
def test_last_turn_extends_its_generation_prompt(name, conv, extends):
    k = len(conv) - 1
    prompt = render(name, conv[:k], gen=True, tools=TOOLS)
    full = render(name, conv, tools=TOOLS)
    assert full.startswith(prompt) is extends
    if name == "deepseek_r1" and not extends:
        assert prompt.endswith("<｜Assistant｜><think>\n") and full.endswith(
            "<｜Assistant｜>Blue.<｜end▁of▁sentence｜>"
        )
    if name == "kimi_k2_thinking" and not extends:  # the earlier tool-calling turn loses its reasoning
        assert "<think>Need the tool.</think>" in prompt and "<think>Need the tool.</think>" not in full


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_special_markers_are_one_token_each(name):
    tok = _tok(name)
    for marker in SPECIAL_TOKENS[name]:
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [marker], marker
    msgs = args_as_text(TOOL_CHAT) if name in ("deepseek_r1", "deepseek_v31") else nine_char_ids(TOOL_CHAT)
    ids = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == render(name, nine_char_ids(TOOL_CHAT), tools=TOOLS)


def nine_char_ids(messages: list[dict]) -> list[dict]:
    """The messages with call ids Mistral's templates take (9 characters: call_0 -> call00000)."""
    fix = {"call_0": "call00000", "call_1": "call00001"}
    return [{**m, **({"tool_call_id": fix.get(m["tool_call_id"], m["tool_call_id"])} if "tool_call_id" in m else {}),
             **({"tool_calls": [{**c, "id": fix.get(c["id"], c["id"])} for c in m["tool_calls"]]}
                if m.get("tool_calls") else {})} for m in messages]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# gpt_oss (harmony) and mistral
# ---------------------------------------------------------------------------------------------------------
def _as(name: str, messages: list[dict]) -> list[dict]:
    return [{**{k: v for k, v in m.items() if k != "reasoning_content"}, name: m["reasoning_content"]}
            if "reasoning_content" in m else m for m in messages]  # fmt: skip


def test_gpt_oss_analysis_on_the_last_turn_only_and_tool_calls_on_commentary():
    import datetime

    today = datetime.date.today().strftime("%Y-%m-%d")  # strftime_now in the system preamble
    head = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n# Valid channels: "
        "analysis, commentary, final. Channel must be included for every message.<|end|>"
    )
    out = render("gpt_oss", _as("thinking", CHAT))
    if today in out:  # not across midnight
        assert out == head + (
            "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
            "<|start|>user<|message|>Name a color.<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>Pick one.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Blue.<|return|>"
        )
    assert "<|channel|>analysis" not in render(
        "gpt_oss", _as("reasoning_content", CHAT)
    )  # it reads `thinking`
    assert render("gpt_oss", _as("thinking", CHAT[:3]), gen=True).endswith(
        "<|start|>user<|message|>Name a color.<|end|><|start|>assistant"
    )
    assert render("gpt_oss", _as("thinking", TOOL_CHAT), tools=TOOLS).endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>The tool says sunny.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    )


def test_mistral_system_joins_the_last_user_message_and_ids_are_nine_characters():
    tool_json = (
        '[{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]'
    )
    assert render("mistral", [SYSTEM, *_as("reasoning", CHAT)], tools=TOOLS) == (
        "<s>[INST]Hi[/INST][THINK]Greet back.[/THINK]Hello!</s>"
        f"[AVAILABLE_TOOLS]{tool_json}[/AVAILABLE_TOOLS][INST]Be brief.\n\nName a color.[/INST]"
        "[THINK]Pick one.[/THINK]Blue.</s>"
    )
    assert render("mistral", nine_char_ids(TOOL_CHAT)).endswith(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00000"}]</s>'
        '[TOOL_RESULTS]{"content": "sunny", "call_id": "call00000"}[/TOOL_RESULTS]It is sunny.</s>'
    )
    with pytest.raises(Exception, match="length 9"):
        render("mistral", TOOL_CHAT)

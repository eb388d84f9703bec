"""Every sample is what the target generates (issue 36): templates in the style of five families, each run with
its markers as special tokens (the tiny tokenizer of conftest) and as ordinary text (the embedded default's
tokenizer), over every data shape; each written sample decoded and compared, as text, with the template's own
renderings, asserted here independently of specdraft's renderer.

`python tests/test_exact_samples.py` prints the table: family x data shape -> samples kept, dropped (by reason),
self-check mismatches.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import CHATML, build_tokenizer  # noqa: E402
from standin_templates import TEMPLATES, standin_tokenizer  # noqa: E402

from specdraft.data.messages import Dropped, normalize_record  # noqa: E402
from specdraft.data.render import (  # noqa: E402
    NO_PROMPT,
    REASONING_LEFT_OUT,
    _straddled,
    choose_template,
    conversation_samples,
    decode,
    template_identity,
)

TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {"type": "object"}}}
         for n, d in (("get_weather", "Weather of a city."), ("get_time", "Local time of a city."))]  # fmt: skip


def _call(i: int, name: str, city: str) -> dict:
    return {"type": "function", "id": f"call_{i}", "function": {"name": name, "arguments": {"city": city}}}


USER = {"role": "user", "content": "Hi, who are you?"}
SHAPES = {
    "reasoning fields, 2 turns": {"messages": [
        {"role": "system", "content": "Be brief."}, USER,
        {"role": "assistant", "content": "I am a helper.", "reasoning_content": "Introduce myself."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Pick one\nquickly."}]},
    "inline reasoning, 2 turns": {"messages": [
        USER, {"role": "assistant", "content": "<think>\nIntroduce myself.\n</think>\n\nI am a helper."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "<think>Pick one.</think>Blue."}]},
    "tool call + result": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [_call(0, "get_weather", "Paris")]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool says sunny."}]},
    "parallel calls + results": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather and time in Rome?"},
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two tools.",
         "tool_calls": [_call(0, "get_weather", "Rome"), _call(1, "get_time", "Rome")]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "noon"},
        {"role": "assistant", "content": "Rain at noon.", "reasoning_content": "Both came back."},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]},
    "no reasoning, 2 turns": {"messages": [
        {"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "A helper."},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]},
    "ShareGPT function_call": {"tools": json.dumps([TOOLS[0]["function"]]), "conversations": [
        {"from": "human", "value": "Weather in Lima?"}, {"from": "gpt", "value": "One moment."},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}'},
        {"from": "observation", "value": "fog"}, {"from": "gpt", "value": [{"type": "text", "text": "Fog."}]}]},
    "Hermes inline calls": {"conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "gpt", "value": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                 "\n</tool_call>"},
        {"from": "tool", "value": "<tool_response>\nsnow\n</tool_response>"},
        {"from": "gpt", "value": "Snow in Oslo."}]},
}  # fmt: skip
#: (family, template kwargs): the four families of the issue (two with thinking on and off) and ChatML
CONFIGS = [("deepseek_r1", {}), ("llama31_tools", {}), ("kimi_k2_thinking", {}),
           ("kimi_k2_thinking", {"thinking": False}), ("hybrid_thinking", {}),
           ("hybrid_thinking", {"enable_thinking": False}), ("chatml", {})]  # fmt: skip
THINKING_OFF = [c for c in CONFIGS if False in c[1].values()]


def _template(family: str) -> str:
    return CHATML if family == "chatml" else TEMPLATES[family].read_text()


@functools.cache
def _embedded():
    from specdraft.targets import load_tokenizer

    return load_tokenizer("smollm2-135m")


def tokenizer(family: str, markers: str):
    """The family's template on a tokenizer where its markers are special tokens, or ordinary text."""
    if markers == "special":
        return build_tokenizer(CHATML) if family == "chatml" else standin_tokenizer(family)
    tok = _embedded()
    tok.chat_template = _template(family)
    return tok


def tpl(tok, messages, tools, gen: bool, kwargs: dict) -> str:
    """The template's own rendering (tool-call arguments as JSON text when it fails on objects, as R1's does)."""
    try:
        return tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
        )
    except TypeError:
        text = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                    c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in messages]  # fmt: skip
        return tok.apply_chat_template(text, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs)


def _no_think(text: str) -> str:
    """The text without think blocks (open or empty), to compare a turn with its reasoning-free rendering."""
    return re.sub(r"<think>.*?</think>\s*", "", text, flags=re.S)


def _parser_split(text: str) -> tuple[str, str]:
    """(reasoning, content) of `<think>R</think>C` as vLLM's reasoning parsers give them to a client (the
    whitespace rule of issue 47: what a multi-turn client sends back)."""
    reasoning, _, content = text.partition("<think>")[2].partition("</think>")
    return reasoning, content


def _bare(msg: dict, conv, i: int, as_given: bool) -> dict:
    """The turn without its reasoning field; with `as_given`, inline reasoning stays in the content as given."""
    bare = {k: v for k, v in msg.items() if k != "reasoning_content"}
    return {**bare, "content": conv.inline_reasoning[i]} if as_given and i in conv.inline_reasoning else bare


def check_samples(tok, conv, samples, kwargs: dict, renders_reasoning: bool = True) -> None:
    """Assert, from the template's own renderings alone, that every sample is what the target generates.

    `renders_reasoning`: the template gives reasoning a form; when it does not, the messages it renders are
    the data's without reasoning fields, inline reasoning in the content as given."""
    tools = conv.tools
    sent = [{**m, **dict(zip(("reasoning_content", "content"), _parser_split(conv.inline_reasoning[i])))}
            if i in conv.inline_reasoning else m for i, m in enumerate(conv.messages)]  # fmt: skip
    msgs = sent if renders_reasoning else [_bare(m, conv, i, True) for i, m in enumerate(conv.messages)]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    full = tpl(tok, msgs, tools, False, kwargs)
    if len(samples) == 1 and decode(tok, samples[0].input_ids) == full:  # one sample: the whole rendering
        (s,) = samples
        runs = [m.span() for m in re.finditer("1+", "".join(map(str, s.loss_mask)))]
        assert len(runs) == len(turns)
        for (a, b), i in zip(runs, turns):
            prompt = tpl(tok, msgs[:i], tools, True, kwargs)
            turn = tpl(tok, msgs[: i + 1], tools, False, kwargs)[len(prompt) :].rstrip()
            assert decode(tok, s.input_ids[:a]).startswith(prompt)
            assert decode(tok, s.input_ids[a:b]) == turn, (i, decode(tok, s.input_ids[a:b]), turn)
        return
    assert len(samples) == len(turns)
    for s, i in zip(samples, turns):
        n = s.loss_mask.index(1)
        assert s.loss_mask == [0] * n + [1] * (len(s.loss_mask) - n)
        prompt, scored = decode(tok, s.input_ids[:n]), decode(tok, s.input_ids[n:])
        assert prompt == tpl(
            tok, msgs[:i], tools, True, kwargs
        )  # the prompt exactly as the engine renders it
        # the turn is the template's rendering of it, apart from the reasoning it was given
        bare = tpl(
            tok, msgs[:i] + [_bare(msgs[i], conv, i, not renders_reasoning)], tools, False, kwargs
        ).rstrip()
        # (whitespace aside: where specdraft builds the turn, the whitespace rule decides it; tested exactly in
        # test_the_whitespace_rule_after_inline_reasoning)
        assert re.sub(r"\s+", "", _no_think(prompt + scored)) == re.sub(r"\s+", "", _no_think(bare)), (
            prompt + scored,
            bare,
        )
        assert not re.search(r"<think>.*<think>", prompt[-12:] + scored, re.S)  # no think block opened twice
        for call in msgs[i].get("tool_calls") or []:
            assert call["function"]["name"] in scored


def run(family: str, kwargs: dict, markers: str, shape: str, notes: list | None = None) -> tuple[int, str]:
    """(samples kept, the drop reason or '') of one data shape, every kept sample checked; `notes` gets what
    was left out to follow the template."""
    tok = tokenizer(family, markers)
    conv, why = normalize_record(SHAPES[shape])
    assert why is None, why
    try:
        samples = conversation_samples(tok, conv, kwargs, template=f"the {family} template", notes=notes)
    except Dropped as e:
        return 0, str(e)
    check_samples(tok, conv, samples, kwargs, renders_reasoning=family not in ("llama31_tools", "chatml"))
    return len(samples), ""


def expected_drop(family: str, kwargs: dict, shape: str) -> str:
    """The reason each family gives for a shape it cannot train as its target writes it ('' = kept)."""
    has_reasoning = shape.startswith(("reasoning", "inline", "tool call", "parallel"))
    if (family, kwargs) in THINKING_OFF and has_reasoning:
        return NO_PROMPT
    if family == "llama31_tools" and shape == "parallel calls + results":
        return "chat template error: This template takes one tool call per assistant turn."
    if family == "chatml" and ("call" in shape or shape.startswith("Hermes")):
        return "the chatml template renders no tool calls"
    return ""


@pytest.mark.parametrize("markers", ["special", "text"])
@pytest.mark.parametrize("family, kwargs", CONFIGS, ids=[f"{f}{'-off' if k else ''}" for f, k in CONFIGS])
def test_every_sample_is_the_templates_rendering(family, kwargs, markers):
    for shape in SHAPES:
        kept, why = run(family, kwargs, markers, shape)
        want = expected_drop(family, kwargs, shape)
        assert why.startswith(want) if want else why == "", (shape, why)
        assert kept or want, shape
        assert not why.startswith("self-check"), (shape, why)


@pytest.mark.parametrize("family", ["deepseek_r1", "kimi_k2_thinking", "hybrid_thinking"])
def test_no_character_lost_or_doubled_at_the_boundary_with_markers_as_text(family):
    """Issue item 1: on a tokenizer where `<think>` is ordinary text, the turn after its prompt is exact."""
    tok = tokenizer(family, "text")
    conv, _ = normalize_record(SHAPES["reasoning fields, 2 turns"])
    samples = conversation_samples(tok, conv)
    scored = [decode(tok, [t for t, m in zip(s.input_ids, s.loss_mask) if m]) for s in samples]
    want = {
        "deepseek_r1": ["Introduce myself.\n</think>\n\nI am a helper.<｜end▁of▁sentence｜>",
                        "Pick one\nquickly.\n</think>\n\nBlue.<｜end▁of▁sentence｜>"],
        "kimi_k2_thinking": ["<think>Introduce myself.</think>I am a helper.<|im_end|>",
                             "<think>Pick one\nquickly.</think>Blue.<|im_end|>"],
        "hybrid_thinking": ["<think>\nIntroduce myself.\n</think>\n\nI am a helper.<|im_end|>",
                            "<think>\nPick one\nquickly.\n</think>\n\nBlue.<|im_end|>"],
    }  # fmt: skip
    assert scored == want[family]


def table() -> list[tuple[str, str, str, int, str, int]]:
    rows = []
    for family, kwargs in CONFIGS:
        for markers in ("special", "text"):
            for shape in SHAPES:
                notes: list[str] = []
                kept, why = run(family, kwargs, markers, shape, notes)
                name = family + ("" if not kwargs else f" {json.dumps(kwargs)}")
                rows.append((name, markers, shape, kept, why, len(notes)))
    return rows


# ---------------------------------------------------------------------------------------------------------
# one test per item of issue 36 (item 1 above; 5 in test_sources, 6 in test_messages)
# ---------------------------------------------------------------------------------------------------------
def _scored(tok, samples) -> list[str]:
    return [decode(tok, [t for t, m in zip(s.input_ids, s.loss_mask) if m]) for s in samples]


def test_item2_a_template_without_reasoning_never_gets_an_invented_think_block():
    tok = tokenizer("chatml", "special")
    conv, _ = normalize_record(SHAPES["reasoning fields, 2 turns"])
    notes: list[str] = []
    assert _scored(tok, conversation_samples(tok, conv, notes=notes)) == [
        "I am a helper.<|im_end|>Blue.<|im_end|>"
    ]
    assert notes == [REASONING_LEFT_OUT] * 2  # left out, and said
    kept = conversation_samples(tok, conv, reasoning_format="think")  # the option that names the format
    assert _scored(tok, kept) == ["<think>\nIntroduce myself.\n</think>\n\nI am a helper.<|im_end|>"
                                  "<think>\nPick one\nquickly.\n</think>\n\nBlue.<|im_end|>"]  # fmt: skip
    inline, _ = normalize_record(SHAPES["inline reasoning, 2 turns"])  # stays in the content as given
    assert _scored(tok, conversation_samples(tok, inline)) == [
        "<think>\nIntroduce myself.\n</think>\n\nI am a helper.<|im_end|><think>Pick one.</think>Blue.<|im_end|>"
    ]
    calls, _ = normalize_record(
        SHAPES["tool call + result"]
    )  # never an empty turn for a call it cannot write
    with pytest.raises(Dropped, match="^the chatml template renders no tool calls"):
        conversation_samples(tok, calls, template="the chatml template")


@pytest.mark.parametrize("family, kwargs", THINKING_OFF)
def test_item3_thinking_off_with_reasoning_in_the_data_is_dropped(family, kwargs):
    tok = tokenizer(family, "text")
    conv, _ = normalize_record(SHAPES["reasoning fields, 2 turns"])
    with pytest.raises(Dropped, match="^no prompt leads to this turn"):
        conversation_samples(tok, conv, kwargs)
    plain, _ = normalize_record(
        SHAPES["no reasoning, 2 turns"]
    )  # without reasoning: kept, after the empty block
    assert all(s.endswith(("A helper.<|im_end|>", "Bye!<|im_end|>")) for s in _scored(tok, conversation_samples(
        tok, plain, kwargs)))  # fmt: skip


def _write(tmp_path, name: str, rows: list) -> Path:
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A target directory holding only the tiny tokenizer (prepare reads nothing else)."""
    d = tmp_path_factory.mktemp("tok")
    tok = build_tokenizer(CHATML)
    tok.bos_token = "<|begin_of_text|>"  # Llama's and R1's templates render one
    tok.save_pretrained(d)
    return d


def test_item4_template_errors_are_per_record(tmp_path, tokenizer_dir):
    from specdraft.data.prepare import prepare

    rows = [SHAPES["parallel calls + results"], SHAPES["tool call + result"], SHAPES["no reasoning, 2 turns"]]
    data = _write(tmp_path, "d.jsonl", rows)
    out = prepare(str(data), str(tmp_path / "ds"), target=str(tokenizer_dir),
                  chat_template=str(TEMPLATES["llama31_tools"]))  # fmt: skip
    man = json.loads((out / "manifest.json").read_text())
    assert man["num_conversations"] == 2
    assert man["dropped"] == {"chat template error: This template takes one tool call per assistant turn.": {
        "count": 1, "records": [0]}}  # fmt: skip
    # R1 concatenates the arguments: they reach it as the data gave them (text), no traceback
    out = prepare(str(data), str(tmp_path / "r1"), target=str(tokenizer_dir),
                  chat_template=str(TEMPLATES["deepseek_r1"]))  # fmt: skip
    assert json.loads((out / "manifest.json").read_text())["num_conversations"] == 3
    with pytest.raises(ValueError, match=r"^--chat-template does not compile: .*\(template line 1\)"):
        prepare(str(tmp_path / "never-read.jsonl"), str(tmp_path / "bad"), target=str(tokenizer_dir),
                chat_template="{% for m in messages %}{{ m.content }")  # fmt: skip


def test_reasoning_left_out_is_counted_and_said_with_the_option(tmp_path, tokenizer_dir, capsys):
    from specdraft.data.prepare import prepare

    data = _write(tmp_path, "d.jsonl", [SHAPES["reasoning fields, 2 turns"], SHAPES["no reasoning, 2 turns"]])
    out = prepare(str(data), str(tmp_path / "ds"), target=str(tokenizer_dir))
    man = json.loads((out / "manifest.json").read_text())
    assert (
        man["repaired"][REASONING_LEFT_OUT] == {"count": 1, "records": [0]} and man["reasoning_format"] == ""
    )
    assert "--reasoning-format think" in capsys.readouterr().out
    out = prepare(str(data), str(tmp_path / "ds2"), target=str(tokenizer_dir), reasoning_format="think")
    assert REASONING_LEFT_OUT not in json.loads((out / "manifest.json").read_text())["repaired"]


def test_item7_one_template_one_identity_as_a_file_or_inline(tmp_path):
    text = TEMPLATES["hybrid_thinking"].read_text()
    assert text.endswith("\n")
    ids = []
    for given in (str(TEMPLATES["hybrid_thinking"]), text.rstrip("\n")):
        tok = build_tokenizer(CHATML)
        kwargs = choose_template(tok, given, '{"enable_thinking": false}')
        ids.append(template_identity(tok, kwargs))
    assert ids[0] == ids[1] and ids[0]["chat_template_sha256"]


def test_an_empty_chat_template_file_is_refused_with_the_fix(tmp_path):
    empty = tmp_path / "template.jinja"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="template.jinja: the file is empty: pass a file holding a Jinja"):
        choose_template(build_tokenizer(CHATML), str(empty))


def test_the_self_check_drops_a_sample_that_does_not_decode_to_the_rendering():
    from tokenizers import normalizers

    tok = build_tokenizer(CHATML)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()  # its tokens no longer spell the rendering
    conv, _ = normalize_record(SHAPES["no reasoning, 2 turns"])
    with pytest.raises(Dropped, match="^self-check: "):
        conversation_samples(tok, conv)


def test_straddle_rule_a_token_across_a_turn_edge_makes_the_conversation_per_turn():
    """Kimi's `<|im_middle|><think>` on a tokenizer where the markers are text has a token `|><` across the
    turn's start: the conversation is made per turn, the prompt tokenized alone; with the markers as special
    tokens no token straddles, and it stays one sample."""
    conv, _ = normalize_record(SHAPES["no reasoning, 2 turns"])
    text = tokenizer("kimi_k2_thinking", "text")
    assert _straddled(text(tpl(text, conv.messages, None, False, {}), return_offsets_mapping=True)["offset_mapping"],
                      [len(tpl(text, conv.messages[:2], None, True, {}))])  # fmt: skip
    assert _scored(text, conversation_samples(text, conv)) == ["<think></think>A helper.<|im_end|>",
                                                               "<think></think>Bye!<|im_end|>"]  # fmt: skip
    special = tokenizer("kimi_k2_thinking", "special")
    assert _scored(special, conversation_samples(special, conv)) == [
        "<think></think>A helper.<|im_end|><think></think>Bye!<|im_end|>"
    ]


@pytest.mark.parametrize("family", ["deepseek_r1", "kimi_k2_thinking", "hybrid_thinking"])
def test_the_whitespace_rule_after_inline_reasoning(family):
    """Inline `<think>R</think>C` reaches the template as vLLM's reasoning parser gives it to a client (R as
    written, C with its leading whitespace); where specdraft builds the turn (R1's open prompt, Kimi's empty
    block) the content's whitespace follows `</think>`, never doubled: the turn is the text the target wrote."""
    tok = tokenizer(family, "special")
    conv, _ = normalize_record(SHAPES["inline reasoning, 2 turns"])
    want = {
        "deepseek_r1": ["Introduce myself.\n</think>\n\nI am a helper.<｜end▁of▁sentence｜>",
                        "Pick one.\n</think>\n\nBlue.<｜end▁of▁sentence｜>"],
        "kimi_k2_thinking": ["<think>\nIntroduce myself.\n</think>\n\nI am a helper.<|im_end|>",
                             "<think>Pick one.</think>Blue.<|im_end|>"],
        "hybrid_thinking": ["<think>\nIntroduce myself.\n</think>\n\nI am a helper.<|im_end|>",
                            "<think>\nPick one.\n</think>\n\nBlue.<|im_end|>"],
    }  # fmt: skip
    assert _scored(tok, conversation_samples(tok, conv)) == want[family]
    # the history the next turn's prompt shows holds the content as the client sends it back
    if family == "kimi_k2_thinking":
        (_, second) = conversation_samples(tok, conv)
        assert "<think></think>\n\nI am a helper.<|im_end|>" in decode(tok, second.input_ids)


if __name__ == "__main__":
    print("| template | markers | data shape | samples kept | dropped (reason) | turns' reasoning left out "
          "| self-check mismatches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, markers, shape, kept, why, left in table():
        print(f"| {name} | {markers} | {shape} | {kept} | {why[:70] or '-'} | {left} "
              f"| {int(why.startswith('self-check'))} |")  # fmt: skip

"""A conversation rendered by the chat template into samples (token ids, loss mask), each checked against it.

A sample is the text the target sees and writes when serving, nothing else. For assistant turn i, `before` is
the template's rendering of messages[:i] with the generation prompt (the prompt the serving engine renders and
tokenizes) and the turn is the text the target writes after it, found by string positions in the template's
renderings, never where token sequences diverge:
- when the rendering of messages[:i+1] (`upto`) extends `before`, the turn is the rest of it (whitespace
  after the end-of-turn marker excluded);
- else the generation prompt is `before` past the history (messages[:i] rendered without it); the turn is
  `upto` past the history (or, when the template re-renders earlier turns once this one follows, as Kimi-K2
  does for a final answer, past the last occurrence of the prompt's header) and must start with that prompt.
  A prompt tail the turn's rendering lacks is accepted only when it opens a think block (DeepSeek-R1's
  convention); any other means no prompt leads to the turn: the conversation is dropped. So is a turn with
  reasoning after a prompt that closes an empty think block (thinking switched off, reasoning in the data).

Reasoning reaches the template under the name it reads: each of `reasoning_content`, `reasoning` and
`thinking` (gpt-oss's template reads `message.thinking`) is probed, and the first the template renders is the
one every message carries (`Conversation.reasoning_name`); "the chat template renders no reasoning" is said only
when none renders, and a template that writes channels (harmony's `<|channel|>analysis`) never gets `<think>`
advice or a `<think>` block.

Reasoning, never in a form the template does not give: rendered by the template (the turn shows it); else,
when the prompt opens a think block, the reasoning then the closing tag (the template's own, else R1's
`\n</think>\n\n`); else, when the turn's rendering holds an empty think block and the template shows reasoning
elsewhere (Kimi-K2's final answer), the reasoning inside the block as the template wraps it (`think_format`).
A template that renders no reasoning and opens no think block (Llama-3.1-like, ChatML) keeps inline reasoning
in the content as given, and leaves reasoning given as a field out, said in `notes` (`reasoning_format="think"`
puts it in the content as `<think>\n...\n</think>\n\n` instead). Tool calls the template does not render drop
the conversation with a reason naming the template. A template error drops the conversation with the template's
message; a template that cannot take tool-call arguments as objects gets them as the data gave them (text).

The whitespace rule around inline reasoning: the data's `<think>R</think>C` is split as vLLM's reasoning parsers
split what the target writes, the reasoning field a multi-turn client sends back (R, as written between the
tags) and the content (C, all after `</think>`, its leading whitespace included); the template then renders
both as it renders any client's messages. Where specdraft builds the turn itself (after a prompt that opens a
think block, or around Kimi's empty block), the content's own leading whitespace follows the closing tag and
the tag's trailing whitespace is dropped (`</think>\n\nC` as the target wrote it, never `</think>\n\n\n\nC`), and
the reasoning's edge whitespace gives way to the template's open/close whitespace.

Samples: when every turn is the template's own rendering and every `before` + turn is a prefix of the whole
conversation's rendering (a stable template), the conversation is one sample: that rendering tokenized once,
each turn's span mapped through the fast tokenizer's offsets. The straddle rule: no token of a one-sample
conversation may straddle a turn's edge (start before it and end after it, as `|><` does when markers are
ordinary text); a conversation where one does is made per turn instead, where no token can. (Within a turn, a
token belongs to the kind of its first character.) Otherwise one sample per assistant turn: `before`
tokenized alone (as the serving engine tokenizes the prompt) followed by the turn's text tokenized alone, that
part scored.

A turn the template opens with its own closing tag after a prompt that opens a think block (DeepSeek-V3.1:
`<think>` in the prompt, `</think>ANSWER` in the turn) is the reasoning then that rendering: one `</think>`.

What ends a turn (`stops`, the target's stop ids: its eos and generation_config's `eos_token_id`): a turn the
template ends with none of them, where the next role marker is one (GLM-4.5's `<|user|>`, `<|observation|>`),
gets that marker (`Turn.stop`): what the target writes to stop. Each turn is counted by what ends it
(`turn_end`: the template's end token, a stop id added, or none) in `Sample.ends`, the manifest's `turn_ends`.

The self-check (`_check_turn`, `_check_whole`): before a sample is kept it is decoded and compared, as text,
with the template's renderings: the prompt part with `before` (or the whole sample with the conversation's
rendering), the scored part with the turn's text, and that text with the template's rendering of the turn
(`upto`). A mismatch drops the conversation with a reason that starts "self-check". The engine check
(`engine_render.check_samples`, with vLLM) renders the client's messages itself: the prompt, the turn, and the
scored turn (vLLM's text of the turn ends it, only the reasoning and its tags before it, vLLM's tokenizer gives
the same ids).

Kinds, for the manifest's counts and `--no-reasoning-loss`: within a turn, `reasoning` runs from the turn's
start through its reasoning text and the closing think tag; `tool_call` from the end of the content (or of
the reasoning) to the end of the turn when the turn calls tools; `content` is the rest. The end-of-turn
token counts with the turn's last part.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field, replace

from specdraft.data.messages import REASONING_FIELDS, Conversation, Dropped
from specdraft.targets import CHAT_TEMPLATE_FIX, has_chat_template

KINDS = ("reasoning", "content", "tool_call")
REASONING_FORMATS = {"think": ("<think>\n", "\n</think>\n\n")}  # reasoning_format -> (open, close) in content
R1_CLOSE = (
    "\n</think>\n\n"  # after a prompt that opens a think block, when the template shows no close of its own
)
REASONING_LEFT_OUT = (
    "reasoning field left out: the chat template renders no reasoning"  # advice: `format_holds`
)
REASONING_LEFT_OUT_CHANNELS = ("reasoning field left out: the chat template renders no reasoning under "
                               f"{', '.join(REASONING_FIELDS)} (it writes channels: give the reasoning under the field it reads)")  # fmt: skip
REASONING_LEFT_OUT_HERE = "reasoning field left out of a turn whose prompt the template gives no think block"
NO_PROMPT = ("no prompt leads to this turn: the template renders it unlike the generation prompt it builds for "
             "it (thinking switched off with reasoning in the data? check --chat-template-kwargs)")  # fmt: skip
NO_TEXT = ("the template renders an assistant turn unlike its own generation prompt, or no text for it "
           "(check --chat-template-kwargs, e.g. enable_thinking, against the data)")  # fmt: skip
_CLOSE_THINK = re.compile(r"\s*</think>\s*")
_EMPTY_THINK = re.compile(r"^\s*<think>\s*</think>\s*")
_EMPTY_BLOCK = re.compile(r"^\s*<think>\s*</think>")  # the block alone, the content's whitespace left to it
_OPEN_THINK = re.compile(r"\s*<think>")
_OPENS_WITH_CLOSE = re.compile(r"</think>")  # a turn that starts with its own close tag
_OPENS_THINK = re.compile(r"<think>\s*$")
_THINKING_OFF = re.compile(r"<think>\s*</think>\s*$")  # a prompt that closes an empty think block
_CLOSES_THINK = re.compile(r"</think>\s*$")  # a prompt that switches thinking off, with or without `<think>`
_PROBE = "SPECDRAFT-REASONING-PROBE"
_CHANNELS = re.compile(
    r"<\|channel\|>"
)  # harmony-style turns (gpt-oss): analysis / commentary / final channels


@dataclass
class Sample:
    """One training sample: token ids, the loss mask, and the loss tokens counted per kind."""

    input_ids: list[int]
    loss_mask: list[int]
    kinds: dict[str, int] = field(default_factory=dict)
    prompts: list[int] = field(default_factory=list)  # tokens before each of its turns (the prompt's length)
    ends: dict[str, int] = field(default_factory=dict)  # what ends its turns (`turn_end`), counted


@dataclass
class Turn:
    """An assistant turn as the target writes it: `text` after the prompt `before`; `verbatim`, the end of
    `text` taken unchanged from `upto` (the template's rendering up to this turn); `rendered`: `text` is all
    verbatim and `before + text` is `upto`."""

    before: str
    text: str
    upto: str
    verbatim: str
    rendered: bool
    notes: list[str] = field(default_factory=list)
    stop: str = ""  # a stop id's text written after `text` to end a turn the template ends with none


@dataclass(frozen=True)
class Traits:
    """What a template does with reasoning, learned from probe renderings: `think`, (open, close) `<think>`
    tags around the reasoning of a turn it renders it for (None: it renders none, or not in think tags);
    `opens_think`, its generation prompt ends with an open think block; `name`, the message field it renders
    reasoning from (None: none of `REASONING_FIELDS`); `channels`, it writes harmony-style channels."""

    think: tuple[str, str] | None
    opens_think: bool
    name: str | None = None
    channels: bool = False
    parts: bool = False  # it iterates a message's text parts (vLLM then gives them as a list, not joined)


def has_generation_markers(tokenizer) -> bool:
    tpl = getattr(tokenizer, "chat_template", None) or ""
    return "{% generation %}" in tpl or "{%- generation %}" in tpl


def render(tokenizer, conv: Conversation, n: int, generation_prompt: bool, kwargs: dict) -> str:
    """The template's text for the first `n` messages (with the tools and template kwargs); an error the
    template raises becomes `Dropped` with its message."""
    try:
        return tokenizer.apply_chat_template(as_sent(conv, n), tools=conv.tools,
                                             tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)  # fmt: skip
    except Exception as e:  # anything a template raises is about this conversation: drop it, say why
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Dropped(f"chat template error: {msg}") from e


def as_sent(conv: Conversation, n: int) -> list[dict]:
    """The first `n` messages as a client sends them back and the template reads them: inline reasoning split
    as the reasoning parser splits it (`Conversation.parsed`, the whitespace rule), each turn's reasoning under
    the field the template reads (`Conversation.reasoning_name`) instead of `reasoning_content`."""
    msgs = conv.messages[:n]
    if (
        conv.sends_parts and conv.parts
    ):  # as vLLM gives them to a template that iterates them (not tool results)
        msgs = [{**m, "content": conv.parts[i]} if i in conv.parts and m["role"] != "tool" else m
                for i, m in enumerate(msgs)]  # fmt: skip
    if conv.parsed:
        msgs = [{**m, "reasoning_content": conv.parsed[i][0], "content": conv.parsed[i][1]}
                if i in conv.parsed and "reasoning_content" in m else m for i, m in enumerate(msgs)]  # fmt: skip
    name = conv.reasoning_name
    if name == "reasoning_content":
        return msgs
    return [{**{k: v for k, v in m.items() if k != "reasoning_content"}, name: m["reasoning_content"]}
            if "reasoning_content" in m else m for m in msgs]  # fmt: skip


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def conversation_samples(tokenizer, conv: Conversation, kwargs: dict | None = None, reasoning_loss: bool = True,
                         reasoning_format: str = "", template: str = "the chat template",
                         notes: list[str] | None = None, engine=None,
                         stops: tuple[int, ...] | None = None) -> list[Sample]:  # fmt: skip
    """The samples of one conversation (one when the template is stable, else one per assistant turn), each
    checked against the template's rendering. `template` names the template in reasons; `notes` gets what was
    left out to follow the template (reasoning it renders none of); `engine` (an `engine_render.EngineRenderer`)
    checks every prompt and turn against the serving engine's own rendering too (`EngineRenderer.check`); `stops`:
    the target's stop ids (`targets.stop_ids`: the tokenizer's eos and generation_config's `eos_token_id`), what
    ends a turn the template ends with no marker of its own (`_stop_after`); None: the tokenizer's eos.

    Raises `Dropped` (with the reason) for a conversation no true sample can be made of."""
    kwargs = kwargs or {}
    conv = _takes_arguments(tokenizer, conv, kwargs)
    traits = template_traits(tokenizer, kwargs)
    conv = replace(conv, reasoning_name=traits.name or "reasoning_content", sends_parts=traits.parts)
    conv, left_out = _reasoning_as_the_template_shows_it(conv, traits, reasoning_format)
    said = [REASONING_LEFT_OUT_CHANNELS if traits.channels else REASONING_LEFT_OUT] * left_out
    if has_generation_markers(tokenizer) and not conv.tools and not conv.has_reasoning:
        out = tokenizer.apply_chat_template(conv.messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kwargs)  # fmt: skip
        ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        if decode(tokenizer, ids) != render(tokenizer, conv, len(conv.messages), False, kwargs):
            raise Dropped("self-check: the sample does not decode to the template's rendering")
        return _noted(notes, said, [Sample(ids, mask, {"content": sum(mask)})])
    turns = [(i, turn_text(tokenizer, conv, i, kwargs, traits, template)) for i, m in enumerate(conv.messages)
             if m["role"] == "assistant"]  # fmt: skip
    said += [n for _, t in turns for n in t.notes]
    markers = stop_texts(tokenizer, stops)
    turns = [(i, _stop_after(tokenizer, conv, i, t, kwargs, markers)) for i, t in turns]
    ends = _count_ends([t for _, t in turns], markers)
    full = render(tokenizer, conv, len(conv.messages), False, kwargs)
    stable = all(t.rendered and not t.stop and full.startswith(t.upto) for _, t in turns)
    if stable:  # one sample, unless a token
        spans = [  # straddles a turn's edge (then the prompt tokenized alone would not be its tokens here)
            _turn_kinds(conv.messages[i], full, len(t.before), len(t.before) + len(t.text)) for i, t in turns
        ]
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        edges = [(s[0][0], s[-1][1]) for s in spans]
        if not _straddled(enc["offset_mapping"], [x for edge in edges for x in edge]):
            sample = _sample(list(enc["input_ids"]), enc["offset_mapping"], spans, reasoning_loss)
            _check_whole(tokenizer, full, sample, enc["offset_mapping"], edges)
            sample.prompts = [next(k for k, (s, e) in enumerate(enc["offset_mapping"]) if s >= a and e > s)
                              for a, _ in edges]  # fmt: skip
            if engine is not None:
                engine.check(conv, turns, [sample] * len(turns), kwargs)
            sample.ends = ends
            return _noted(notes, said, [sample])
    out = []
    for i, t in turns:  # each turn after the prompt the template builds for it, tokenized alone, scored alone
        head = tokenizer(t.before, add_special_tokens=False)["input_ids"]
        tail = tokenizer(t.text + t.stop, add_special_tokens=False, return_offsets_mapping=True)
        n = len(t.before)
        offsets = [(0, 0)] * len(head) + [(s + n, e + n) for s, e in tail["offset_mapping"]]
        spans = [_turn_kinds(conv.messages[i], t.before + t.text + t.stop, n, n + len(t.text + t.stop))]
        sample = _sample(list(head) + list(tail["input_ids"]), offsets, spans, reasoning_loss)
        _check_turn(tokenizer, t, sample, len(head))
        sample.prompts = [len(head)]
        out.append(sample)
    if engine is not None:
        engine.check(conv, turns, out, kwargs)
    for sample, (_, t) in zip(out, turns):
        sample.ends = _count_ends([t], markers)
    return _noted(notes, said, out)


def stop_texts(tokenizer, stops: tuple[int, ...] | None) -> dict[str, int]:
    """{text: id} of the stop ids that are one token of their own (a special token such as `<|user|>`)."""
    ids = stops if stops is not None else (tokenizer.eos_token_id,)
    out = {}
    for k in ids:
        if isinstance(k, int) and 0 <= k < len(tokenizer):
            text = decode(tokenizer, [k])
            if text and tokenizer(text, add_special_tokens=False)["input_ids"] == [k]:
                out[text] = k
    return out


def turn_end(t: Turn, markers: dict[str, int]) -> str:
    """What ends turn `t`, named for the manifest: the template's end token (a stop id it renders), a stop id the
    target writes where the template renders none (`Turn.stop`), or none."""
    if t.stop:
        return f"stop id {t.stop.strip()} (generation_config)"
    end = next((m for m in markers if t.text.endswith(m)), None)
    return f"end token {end}" if end else "none (no stop id ends the turn)"


def _count_ends(turns: list[Turn], markers: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in turns:
        out[turn_end(t, markers)] = out.get(turn_end(t, markers), 0) + 1
    return out


def _stop_after(
    tokenizer, conv: Conversation, i: int, t: Turn, kwargs: dict, markers: dict[str, int]
) -> Turn:
    """`t` with the stop id the target writes to end it (`Turn.stop`) when the template ends the turn with none
    of the stop ids but the next turn's marker is one (GLM-4.5: `<|user|>`, `<|observation|>`): the text the
    template renders between the turn and the next message (a user message when the turn is the last), through
    that marker. Found on the conversation without reasoning (a template may drop it from history there)."""
    if not markers or any(t.text.endswith(m) for m in markers):
        return t
    msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in conv.messages]
    nxt = msgs[i + 1] if i + 1 < len(msgs) else {"role": "user", "content": "Q"}
    plain = replace(conv, messages=msgs[: i + 1] + [nxt], parsed={})
    try:
        upto, more = (
            render(tokenizer, plain, i + 1, False, kwargs),
            render(tokenizer, plain, i + 2, False, kwargs),
        )
    except Dropped:
        return t
    if not more.startswith(upto.rstrip()):
        return t
    after = more[len(upto.rstrip()) :]
    ws = after[: len(after) - len(after.lstrip())]
    mark = next((m for m in sorted(markers, key=len, reverse=True) if after.lstrip().startswith(m)), None)
    return replace(t, stop=ws + mark) if mark else t


def _straddled(offsets, points: list[int]) -> bool:
    """Whether a token spans across one of the character positions `points` (starts before, ends after)."""
    inside = sorted(points)
    for s, e in offsets:
        k = bisect.bisect_right(inside, s)
        if k < len(inside) and inside[k] < e:
            return True
    return False


def _noted(notes: list[str] | None, said: list[str], samples: list[Sample]) -> list[Sample]:
    if notes is not None:
        notes.extend(said)
    return samples


def _takes_arguments(tokenizer, conv: Conversation, kwargs: dict) -> Conversation:
    """`conv`, or, when the template fails on tool-call arguments given as objects and renders them given as
    text, `conv` with each call's arguments as the data gave them (R1's template concatenates strings)."""
    try:
        render(tokenizer, conv, len(conv.messages), False, kwargs)
        return conv
    except Dropped as first:
        if not conv.has_tool_calls:
            raise
        msgs = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": conv.arguments_text.get(
                    (i, j), c["function"]["arguments"])}} for j, c in enumerate(m["tool_calls"])]}
                if m.get("tool_calls") else m for i, m in enumerate(conv.messages)]  # fmt: skip
        as_text = replace(conv, messages=msgs)
        try:
            render(tokenizer, as_text, len(msgs), False, kwargs)
        except Dropped:
            raise first from None
        return as_text


def _reasoning_as_the_template_shows_it(
    conv: Conversation, traits: Traits, fmt: str
) -> tuple[Conversation, int]:
    """`conv` unchanged for a template that gives reasoning a form (renders it, or its prompt opens a think
    block); else with inline reasoning back in the content as given, reasoning fields in the content in the
    named `fmt`, or left out: (conversation, how many turns' reasoning was left out)."""
    if traits.think or traits.opens_think or traits.name or not conv.has_reasoning:
        return conv, 0
    if fmt and fmt not in REASONING_FORMATS:
        raise ValueError(f"reasoning format {fmt!r}: choose one of {sorted(REASONING_FORMATS)}")
    if fmt and traits.channels:
        raise ValueError(f"reasoning format {fmt!r} puts <think> tags in the content, which a channel template "
                         "(harmony) never writes: give the reasoning under the name the template reads")  # fmt: skip
    msgs, left_out = [], 0
    for i, m in enumerate(conv.messages):
        reasoning = m.get("reasoning_content")
        if reasoning:
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            if i in conv.inline_reasoning:
                m["content"] = conv.inline_reasoning[i]
            elif fmt:
                open_, close = REASONING_FORMATS[fmt]
                m["content"] = open_ + reasoning + close + m["content"]
            else:
                left_out += 1
        msgs.append(m)
    parts = {i: p for i, p in conv.parts.items() if msgs[i]["content"] == conv.messages[i]["content"]}
    return replace(conv, messages=msgs, inline_reasoning={}, parsed={}, parts=parts), left_out


def turn_text(tokenizer, conv: Conversation, i: int, kwargs: dict, traits: Traits | None = None,
              template: str = "the chat template") -> Turn:  # fmt: skip
    """Assistant turn `i` as the target writes it after the prompt the template builds for it (see the module
    docstring); raises `Dropped` when no prompt leads to it or the template cannot render its tool calls."""
    traits = traits or template_traits(tokenizer, kwargs)
    if traits.name and conv.reasoning_name != traits.name:
        conv = replace(conv, reasoning_name=traits.name)
    msg = conv.messages[i]
    reasoning = (msg.get("reasoning_content") or "").strip()
    before, upto = render(tokenizer, conv, i, True, kwargs), render(tokenizer, conv, i + 1, False, kwargs)
    if reasoning and _THINKING_OFF.search(
        before
    ):  # the prompt switched thinking off: no reasoning follows it
        raise Dropped(NO_PROMPT)
    if upto.startswith(before):
        raw, extra = upto[len(before) :], ""
    else:
        raw, extra = _turn_after_history(tokenizer, conv, i, kwargs, before, upto)
    text = raw.rstrip()
    if not text.strip():
        raise Dropped(NO_TEXT)
    for call in msg.get("tool_calls") or []:
        if call["function"]["name"] not in text:
            raise Dropped(f"{template} renders no tool calls: a turn that calls tools cannot be trained as the "
                          "target writes it")  # fmt: skip
    verbatim, notes = text, []
    if extra:  # the prompt opened a think block: the turn goes on inside it
        empty = _EMPTY_THINK.match(text)
        opened = _OPEN_THINK.match(text)
        if empty:
            text = verbatim = text[empty.end() :]
        elif opened and reasoning and reasoning in text:
            text = verbatim = text[opened.end() :].removeprefix(extra[len(extra.rstrip()) :])
        if _OPENS_WITH_CLOSE.match(text):  # the template's own close opens the turn (DeepSeek-V3.1)
            text = reasoning + text
        elif not (reasoning and reasoning in text):
            text = reasoning + _close_before(traits.think[1] if traits.think else R1_CLOSE, text) + text
    elif reasoning and reasoning not in text:
        empty = _EMPTY_BLOCK.match(text)
        if empty and traits.think:  # an empty think block where the template shows reasoning elsewhere
            verbatim = text[empty.end() :]
            open_, close = traits.think
            wrapped = conv.parsed[i][0] if i in conv.parsed else msg["reasoning_content"]
            wrapped = wrapped.lstrip() if open_[-1:].isspace() else wrapped
            wrapped = wrapped.rstrip() if close[:1].isspace() else wrapped
            text = open_ + wrapped + _close_before(close, verbatim) + verbatim
        else:
            notes.append(REASONING_LEFT_OUT_HERE)
    return Turn(before, text, upto, verbatim, text == raw.rstrip() and not extra, notes)


def format_holds(tokenizer, conv: Conversation, kwargs: dict, fmt: str, engine=None, stops=None) -> bool:
    """Whether `reasoning_format=fmt` keeps this conversation exact, tried before it is advised: its samples are
    made and pass every check, and each turn with reasoning is scored with its content as the format writes it
    (the reasoning's block included: not a template that keeps only what follows `</think>`) after a prompt that
    does not switch thinking off (ends with `</think>`: an empty block closed, or DeepSeek-V3.1's bare close)."""
    try:
        conversation_samples(tokenizer, conv, kwargs, reasoning_format=fmt, engine=engine, stops=stops)
        traits = template_traits(tokenizer, kwargs)
        named = replace(conv, reasoning_name=traits.name or "reasoning_content", sends_parts=traits.parts)
        formatted, _ = _reasoning_as_the_template_shows_it(named, traits, fmt)
        for i, m in enumerate(formatted.messages):
            if m["role"] == "assistant" and conv.messages[i].get("reasoning_content"):
                t = turn_text(tokenizer, formatted, i, kwargs, traits)
                if _CLOSES_THINK.search(t.before) or m["content"].strip() not in t.text:
                    return False
    except ValueError:  # Dropped, or a format the template refuses
        return False
    return True


def _close_before(close: str, content: str) -> str:
    """The closing think tag before `content`: without its trailing whitespace when the content brings its own
    (the whitespace rule: the content as the reasoning parser gives it follows `</think>`)."""
    return close.rstrip() if content[:1].isspace() else close


def _turn_after_history(tokenizer, conv: Conversation, i: int, kwargs: dict, before: str, upto: str):
    """(the turn's rendering past the generation prompt, the prompt's think opening the turn lacks or '') for a
    turn whose rendering does not extend its prompt."""
    history = render(tokenizer, conv, i, False, kwargs)
    if not before.startswith(history):
        raise Dropped("the template's generation prompt does not extend its rendering of the conversation")
    gen = before[len(history) :]
    opens = _OPENS_THINK.search(gen)
    header, extra = (gen[: opens.start()], gen[opens.start() :]) if opens else (gen, "")
    if upto.startswith(history):
        at = len(history)
    else:  # the template re-rendered earlier turns once this one follows: the turn is after the last header
        at = upto.rfind(header) if header else -1
    if at < 0 or not upto.startswith(header, at):
        raise Dropped(NO_PROMPT)
    return upto[at + len(header) :], extra


def template_traits(tokenizer, kwargs: dict) -> Traits:
    """The template's `Traits`, from probe renderings (cached per template and kwargs)."""
    key = (getattr(tokenizer, "chat_template", None), repr(sorted(kwargs.items())))
    cache = tokenizer.__dict__.setdefault("_specdraft_traits", {})
    if key not in cache:
        cache[key] = _probe(tokenizer, kwargs)
    return cache[key]


def think_format(tokenizer, kwargs: dict) -> tuple[str, str] | None:
    """(open, close): how the template wraps the reasoning of a turn it renders it for; None when it renders
    none (learned from a final answer, then a tool-calling turn, as the last turn)."""
    return template_traits(tokenizer, kwargs).think


def _probe(tokenizer, kwargs: dict) -> Traits:
    """Each reasoning name in turn (`REASONING_FIELDS`), on a final answer then a tool-calling turn (with a
    9-character call id, which Mistral's templates require): the first name the template renders, and how."""
    user = {"role": "user", "content": "Q"}
    call = {"type": "function", "id": "call00000", "function": {"name": "f", "arguments": {}}}
    opens, think, name, channels = False, None, None, False
    for field_name in REASONING_FIELDS:
        for turn in ({"content": "ANSWER"}, {"content": "", "tool_calls": [call]}):
            conv = Conversation([user, {"role": "assistant", "reasoning_content": _PROBE, **turn}],
                                reasoning_name=field_name)  # fmt: skip
            try:
                prompt, text = (
                    render(tokenizer, conv, 1, True, kwargs),
                    render(tokenizer, conv, 2, False, kwargs),
                )
            except Dropped:  # a template that refuses the probe teaches nothing
                continue
            opens = opens or bool(_OPENS_THINK.search(prompt))
            channels = channels or bool(_CHANNELS.search(text))
            at = text.find(_PROBE)
            if at < 0:
                continue
            name = name or field_name
            open_ = _OPENS_THINK.search(text, 0, at)
            close = _CLOSE_THINK.match(text, at + len(_PROBE))
            if think is None and open_ and close and field_name == name:
                think = (open_.group(0), close.group(0))
    return Traits(think, opens, name, channels, _iterates_parts(tokenizer, kwargs))


def _iterates_parts(tokenizer, kwargs: dict) -> bool:
    """Whether the template renders a user message's text parts given as a list (as vLLM gives them to a
    template that iterates `content`): each part's text, and no trace of the list itself."""
    parts = [{"type": "text", "text": f"{_PROBE}-{k}"} for k in "AB"]
    conv = Conversation([{"role": "user", "content": "\n".join(p["text"] for p in parts)}], parts={0: parts},
                        sends_parts=True)  # fmt: skip
    try:
        text = render(tokenizer, conv, 1, True, kwargs)
    except Dropped:
        return False
    return all(p["text"] in text for p in parts) and "'text'" not in text and '"text"' not in text


def _check_turn(tokenizer, t: Turn, sample: Sample, n_prompt: int) -> None:
    """The self-check of a per-turn sample: its prompt decodes to `before`, its scored part to the turn's text,
    and that text ends with the template's own rendering of the turn (all of it when `rendered`)."""
    if decode(tokenizer, sample.input_ids[:n_prompt]) != t.before:
        raise Dropped("self-check: the prompt's tokens do not decode to the template's prompt")
    if decode(tokenizer, sample.input_ids[n_prompt:]) != t.text + t.stop:
        raise Dropped("self-check: the turn's tokens do not decode to the turn as the template renders it")
    if not (t.text.endswith(t.verbatim) and t.upto.rstrip().endswith(t.verbatim)) or (
        t.rendered and t.before + t.text != t.upto.rstrip()
    ):
        raise Dropped("self-check: the turn's text is not the template's rendering of it")


def _check_whole(tokenizer, full: str, sample: Sample, offsets, turns: list[tuple[int, int]]) -> None:
    """The self-check of a one-sample conversation: it decodes to the template's rendering, and the tokens of
    each turn (by the straddle rule) decode to the rendering's text under them, from the turn's first token
    (the one holding the turn's first character) through the one holding its last."""
    if decode(tokenizer, sample.input_ids) != full:
        raise Dropped("self-check: the sample does not decode to the template's rendering")
    for a, b in turns:
        idx = [k for k, (s, e) in enumerate(offsets) if a <= s < b and e > s]
        if not idx:
            continue
        x, y = offsets[idx[0]][0], offsets[idx[-1]][1]
        first = next((k for k, (s, e) in enumerate(offsets) if s <= a < e), idx[0])
        ok = idx == list(range(idx[0], idx[-1] + 1)) and y >= b and (first == idx[0] or first == idx[0] - 1)
        if not ok or decode(tokenizer, sample.input_ids[idx[0] : idx[-1] + 1]) != full[x:y]:
            raise Dropped("self-check: a turn's tokens do not decode to the turn as the template renders it")


def text_sample(tokenizer, text: str) -> Sample:
    """Raw-text mode (base models): a document, with the loss on every token."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = list(ids) + [tokenizer.eos_token_id]
    return Sample(list(ids), [1] * len(ids), {"content": len(ids)})


def _turn_kinds(msg: dict, text: str, start: int, end: int) -> list[tuple[int, int, str]]:
    """[(start, end, kind)] character ranges covering one assistant turn's span [start, end) of `text`."""
    cut = start
    ranges = []
    reasoning = (msg.get("reasoning_content") or "").strip()
    if reasoning:
        r = text.find(reasoning, start, end)
        if r >= 0:
            cut = r + len(reasoning)
            close = _CLOSE_THINK.match(text, cut)
            cut = close.end() if close and close.end() <= end else cut
            ranges.append((start, cut, "reasoning"))
    content = (msg.get("content") or "").strip()
    c = text.find(content, cut, end) if content else -1
    content_end = c + len(content) if c >= 0 else cut
    if msg.get("tool_calls"):
        if content_end > cut:
            ranges.append((cut, content_end, "content"))
        ranges.append((content_end, end, "tool_call"))
    else:
        ranges.append((cut, end, "content"))
    return ranges


def _sample(ids: list[int], offsets, spans: list[list[tuple[int, int, str]]], reasoning_loss: bool) -> Sample:
    """Token ids with the loss mask and kind counts of the character ranges in `spans`."""
    ranges = sorted(r for turn in spans for r in turn)
    mask, kinds = [0] * len(ids), dict.fromkeys(KINDS, 0)
    k = 0
    for t, (s, e) in enumerate(offsets):
        while k < len(ranges) and s >= ranges[k][1]:
            k += 1
        if k < len(ranges) and ranges[k][0] <= s < ranges[k][1] and e > s:
            kind = ranges[k][2]
            if reasoning_loss or kind != "reasoning":
                mask[t] = 1
                kinds[kind] += 1
    return Sample(ids, mask, kinds)


def choose_template(tokenizer, chat_template: str = "", chat_template_kwargs: str = "") -> dict:
    """Apply `--chat-template` (a file, or the Jinja text itself) to `tokenizer` and parse
    `--chat-template-kwargs` (a JSON object); returns the kwargs. Raises with the fix on bad values, and in one
    line for a template (given or the tokenizer's own) that does not compile, before any record is read."""
    import json
    from pathlib import Path

    if chat_template:
        p = Path(chat_template)
        looks_like_path = "{" not in chat_template and "\n" not in chat_template
        if looks_like_path and not p.is_file():
            raise FileNotFoundError(
                f"--chat-template {chat_template}: no such file (pass a file or the Jinja text)"
            )
        text = p.read_text() if looks_like_path else chat_template
        if not text.strip():
            raise ValueError(f"--chat-template {chat_template}: the file is empty: pass a file holding a Jinja chat "
                             "template, or leave --chat-template out to use the tokenizer's own")  # fmt: skip
        tokenizer.chat_template = text
    is_file = chat_template and "{" not in chat_template and "\n" not in chat_template
    _compiles(tokenizer, f"--chat-template {chat_template}" if is_file else "--chat-template" if chat_template
              else "the tokenizer's chat template")  # fmt: skip
    try:
        kwargs = json.loads(chat_template_kwargs) if chat_template_kwargs else {}
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--chat-template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": true}}': {e}"
        ) from e
    if not isinstance(kwargs, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object, not {chat_template_kwargs!r}")
    return kwargs


def _compiles(tokenizer, what: str) -> None:
    """Refuse in one line a chat template that Jinja cannot compile (with the error and its line)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tpl = getattr(tokenizer, "chat_template", None)
    if not isinstance(tpl, str) or not tpl:
        return
    try:
        _compile_jinja_template(tpl)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{what} does not compile: {e.message} (template line {e.lineno}); fix the template "
                         "or pass another with --chat-template") from None  # fmt: skip


def require_chat_template(tokenizer, target: str, also: str = "") -> None:
    """Refuse in one line, with the fix, a tokenizer that cannot render chats (`has_chat_template`): checked
    with the tokenizer alone, before a command loads any model. `also`: a further fix of that command."""
    if not has_chat_template(tokenizer):
        raise ValueError(f"the tokenizer of {target} has no chat template (a base model?), so conversations "
                         "cannot be rendered as the target sees them when served. "
                         f"Fix: {CHAT_TEMPLATE_FIX}{also}")  # fmt: skip


def template_identity(tokenizer, kwargs: dict) -> dict:
    """What a later stage must render with to see what this data saw: the template's hash and the kwargs.

    One template, one identity: the hash is of the text Jinja renders from, so one trailing newline (which Jinja
    drops; a file usually ends with one, the same template given inline does not) does not change it."""
    import hashlib

    tpl = getattr(tokenizer, "chat_template", None) or ""
    tpl = tpl[:-1] if isinstance(tpl, str) and tpl.endswith("\n") else tpl
    return {"chat_template_sha256": hashlib.sha256(tpl.encode()).hexdigest()[:16] if tpl else None,
            "chat_template_kwargs": kwargs}  # fmt: skip

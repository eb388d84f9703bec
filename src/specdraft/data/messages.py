"""Conversations as the chat template takes them: any record shape -> OpenAI-style messages + tools.

What a record may hold, and what each becomes (every record dropped keeps a reason that is true):
- OpenAI `messages` (`role`, `content`) or ShareGPT `conversations` (`from`, `value`; human/gpt/...).
- `content` as a string or a list of parts: text parts (`{"type": "text", "text": ...}`, or bare strings)
  are joined with a newline, as vLLM joins them for a template that takes a string; the parts themselves are
  kept aside (`Conversation.parts`, as `{"type": "text", "text": ...}`), what a client sends and what vLLM gives
  a template that iterates them (`render.as_sent`); an image, audio, video or file part drops the record
  ("image part", ...), since the draft is trained on the text the target sees.
- Assistant `tool_calls` (`{"type": "function", "id", "function": {"name", "arguments"}}`): arguments given
  as a JSON string are parsed into an object (a template renders them with `tojson`); arguments that are
  not JSON drop the record. A `tool` turn (its `content` the result, `tool_call_id`/`name`) must follow
  an assistant turn with tool calls or another tool result. Conversation-level `tools` (OpenAI function
  definitions, a list or a JSON string of one) reach the template. The arguments as the data gave them (its
  JSON string, or the object's JSON) are kept aside (`Conversation.arguments_text`) for a template that
  concatenates them as a string.
- Hermes-style inline calls: an assistant turn whose text holds `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (after any text of its own) becomes that text plus those tool calls; a `tool` turn (or a `human` one
  right after such calls) wrapped in `<tool_response>...</tool_response>` becomes a tool result. Glaive's
  `<functioncall>` text is refused, naming the format (convert it to tool calls first).
- ShareGPT function calling: a `function_call` turn (`value` = JSON `{"name", "arguments"}`) becomes an
  assistant tool call (merged into the assistant turn just before it when that turn has no calls yet),
  an `observation` turn a tool result.
- Reasoning: a field (`reasoning_content`, `reasoning` or `thinking`) or inline at the start of the content
  (`<think>...</think>`). The rule when both are present: the record is dropped ("reasoning given twice"),
  since no rule can tell which one the target produced. Normalised, reasoning travels as the message's
  `reasoning_content` field and the content holds no `<think>` block; the content as given is kept aside
  (`Conversation.inline_reasoning`) for a template that renders no reasoning (there it stays in the content).
  Inline reasoning is split as vLLM's reasoning parsers split what a target writes (the text a multi-turn
  client sends back): the reasoning is the text between `<think>` and `</think>` as written, the content all
  that follows `</think>`, its leading whitespace included (the whitespace rule in `render`): kept aside as
  `Conversation.parsed`, what the template is given; the messages hold both with their edges trimmed. A field
  is taken as given (newlines at its edges dropped).
  The template gets the reasoning under the name it reads (`Conversation.reasoning_name`, found by
  `render.template_traits`: `reasoning_content`, `reasoning` or `thinking`, as gpt-oss's template reads it).

A conversation whose first turn (after any system prompt) is not from the user keeps the rest from its
first user turn on, as SpecForge does; the repair is counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_call": "function_call",
}
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
LEADING_DROPPED = "leading non-user turn dropped"  # a repair: the conversation is kept without them
_THINK = re.compile(
    r"^\s*<think>(.*?)</think>", re.S
)  # the content is all after </think>, as vLLM's parsers give it
_HERMES_CALL = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.S)
_HERMES_RESULT = re.compile(r"\s*<tool_response>\s*(.*?)\s*</tool_response>\s*", re.S)
_ASIDE = (
    "_inline",
    "_parsed",
    "_arguments_text",
    "_parts",
)  # kept aside while normalising, then moved into the Conversation
_MEDIA = {"image": "image part", "image_url": "image part", "input_image": "image part", "audio": "audio part",
          "input_audio": "audio part", "audio_url": "audio part", "video": "video part", "video_url": "video part",
          "file": "file part"}  # fmt: skip


class Dropped(ValueError):
    """Why a record cannot be used (the reason is counted in the manifest)."""


@dataclass
class Conversation:
    """A normalised conversation: OpenAI-style messages and the tools offered to the model (or None)."""

    messages: list[dict]
    tools: list[dict] | None = None
    inline_reasoning: dict[int, str] = field(default_factory=dict)  # message -> its content as given
    arguments_text: dict[tuple[int, int], str] = field(default_factory=dict)  # (message, call) -> as given
    reasoning_name: str = "reasoning_content"  # the field the chat template reads reasoning from
    parsed: dict[int, tuple[str, str]] = field(
        default_factory=dict
    )  # inline: (reasoning, content) as vLLM splits
    # message -> its text parts as the data gave them; `sends_parts`: the template iterates text parts (vLLM's
    # "openai" content format), so `render.as_sent` gives them to it instead of their join
    parts: dict[int, list[dict]] = field(default_factory=dict)
    sends_parts: bool = False

    @property
    def has_reasoning(self) -> bool:
        return any(m.get("reasoning_content") for m in self.messages)

    @property
    def has_tool_calls(self) -> bool:
        return any(m.get("tool_calls") for m in self.messages)


def normalize_record(record, repairs: list[str] | None = None) -> tuple[Conversation | None, str | None]:
    """(Conversation, None) from a raw record, or (None, the reason it is unusable)."""
    if not isinstance(record, dict):
        return None, "record is not an object"
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list) or not turns:
        return None, "no messages/conversations list"
    try:
        msgs = _hermes_results(_merge_function_calls([_message(t) for t in turns]))
        msgs = _with_system(record, msgs)
        tools = _tools(record.get("tools", record.get("functions")))
        msgs = _check_order(msgs, repairs)
    except Dropped as e:
        return None, str(e)
    inline = {i: m.pop("_inline") for i, m in enumerate(msgs) if "_inline" in m}
    parsed = {i: m.pop("_parsed") for i, m in enumerate(msgs) if "_parsed" in m}
    texts = {(i, j): c.pop("_arguments_text") for i, m in enumerate(msgs)
             for j, c in enumerate(m.get("tool_calls") or []) if "_arguments_text" in c}  # fmt: skip
    parts = {i: m.pop("_parts") for i, m in enumerate(msgs) if "_parts" in m}
    parts = {i: p for i, p in parts.items() if i not in inline and _joined(p) == msgs[i]["content"]}
    return Conversation(msgs, tools, inline, texts, parsed=parsed, parts=parts), None


def _message(turn) -> dict:
    """One turn as an OpenAI message (role, content, and reasoning/tool fields when present)."""
    if not isinstance(turn, dict):
        raise Dropped("turn is not an object")
    raw_role = turn.get("role", turn.get("from"))
    role = _ROLE_MAP.get(str(raw_role).lower()) if raw_role is not None else None
    if role is None:
        raise Dropped("unknown role")
    given = turn.get("content", turn.get("value"))
    content = _text(given)
    if role == "function_call":  # ShareGPT: the call itself is the turn's value
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [_tool_call({"function": _json(content)}, 0)],
        }
    msg: dict = {"role": role, "content": content}
    if isinstance(given, list):  # the parts as given, kept while the content is their join (normalize_record)
        msg["_parts"] = [{"type": "text", "text": p if isinstance(p, str) else p["text"]} for p in given]
    if role == "assistant":
        _reasoning(turn, msg)
        calls = turn.get("tool_calls") or (
            [{"function": turn["function_call"]}] if turn.get("function_call") else []
        )
        if "<functioncall>" in msg["content"]:
            raise Dropped("Glaive-style inline <functioncall> text (not read: convert it to tool_calls)")
        if "<tool_call>" in msg["content"]:
            if calls:
                raise Dropped("tool calls given twice (tool_calls and inline Hermes <tool_call> text)")
            msg["content"], calls = _hermes_calls(msg["content"])
        if calls:
            if not isinstance(calls, list):
                raise Dropped("tool_calls is not a list")
            msg["tool_calls"] = [_tool_call(c, i) for i, c in enumerate(calls)]
    elif role == "tool":
        for k in ("tool_call_id", "name"):
            if turn.get(k) is not None:
                msg[k] = str(turn[k])
    if not msg["content"].strip() and not msg.get("tool_calls") and not msg.get("reasoning_content"):
        raise Dropped("empty content")
    return msg


def _hermes_calls(text: str) -> tuple[str, list[dict]]:
    """(the text before the calls, the calls) of an assistant turn in the Hermes format: `<tool_call>` blocks
    of JSON `{"name", "arguments"}` after the turn's own text, nothing but whitespace between or after them."""
    first = text.index("<tool_call>")
    calls, at = [], first
    while at < len(text):
        m = _HERMES_CALL.match(text, at)
        if not m:
            raise Dropped("Hermes-style inline <tool_call> text with other text after it or unclosed")
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            raise Dropped("Hermes-style inline <tool_call> that is not JSON") from None
        if not isinstance(call, dict):
            raise Dropped("Hermes-style inline <tool_call> that is not a JSON object")
        calls.append({"function": {"name": call.get("name"), "arguments": call.get("arguments", {})}})
        at = m.end()
    return text[:first].rstrip(), calls


def _joined(parts: list[dict]) -> str:
    """Text parts as vLLM joins them for a template that takes a string: with a newline."""
    return "\n".join(p["text"] for p in parts)


def _text(content) -> str:
    """A string content, or the text parts of a content list joined (`_joined`); media parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        _check_utf8(content)
        return content
    if not isinstance(content, list):
        raise Dropped("content is neither text nor a list of parts")
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if kind in _MEDIA:
            raise Dropped(_MEDIA[kind])
        if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
            raise Dropped(f"unknown content part {kind!r}")
        out.append(part["text"])
    text = "\n".join(out)
    _check_utf8(text)
    return text


def _check_utf8(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise Dropped("not valid UTF-8") from None


def _reasoning(turn: dict, msg: dict) -> None:
    """Move the turn's reasoning (a field, or a leading inline <think> block) into `reasoning_content`."""
    fields = [turn[k] for k in REASONING_FIELDS if isinstance(turn.get(k), str) and turn[k].strip()]
    inline = _THINK.match(msg["content"])
    if len(fields) > 1 or (fields and inline):
        raise Dropped("reasoning given twice")
    if inline:
        fields = [inline.group(1)]
        msg["_inline"] = msg["content"]
        msg["_parsed"] = (
            inline.group(1),
            msg["content"][inline.end() :],
        )  # as vLLM's reasoning parsers split it
        msg["content"] = msg["content"][inline.end() :].lstrip()
    if "<think>" in msg["content"] or "</think>" in msg["content"]:
        raise Dropped("think tag inside the content")
    if fields:
        msg["reasoning_content"] = fields[0].strip("\n")
    elif inline:
        del msg["_parsed"]  # an empty think block: no reasoning to send back


def _json(value, what: str = "tool-call arguments"):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise Dropped(f"{what} are not JSON") from None
    return value


def _tool_call(call, i: int) -> dict:
    """An OpenAI tool call with its arguments as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise Dropped("tool call without a function name")
    given = fn.get("arguments", {})
    args = _json(given)
    if not isinstance(args, dict):
        raise Dropped("tool-call arguments are not a JSON object")
    return {
        "type": "function",
        "id": str(call.get("id") or f"call_{i}"),
        "function": {"name": fn["name"], "arguments": args},
        "_arguments_text": given if isinstance(given, str) else json.dumps(given, ensure_ascii=False),
    }


def _merge_function_calls(msgs: list[dict]) -> list[dict]:
    """ShareGPT: a function_call turn after the assistant's text joins that turn (one assistant message)."""
    out: list[dict] = []
    for m in msgs:
        prev = out[-1] if out else None
        if m["role"] == "assistant" and not m["content"] and m.get("tool_calls") and prev and (
                prev["role"] == "assistant" and not prev.get("tool_calls")):  # fmt: skip
            prev["tool_calls"] = m["tool_calls"]
            continue
        out.append(m)
    return out


def _hermes_results(msgs: list[dict]) -> list[dict]:
    """Hermes: a tool turn, or a user turn right after tool calls, made of `<tool_response>` blocks is one tool
    result per block (their text unwrapped)."""
    out: list[dict] = []
    for m in msgs:
        after_calls = bool(out) and (out[-1].get("tool_calls") or out[-1]["role"] == "tool")
        text = m["content"]
        if (
            m["role"] in ("tool", "user")
            and "<tool_response>" in text
            and (m["role"] == "tool" or after_calls)
        ):
            blocks, at = [], 0
            while at < len(text) and (b := _HERMES_RESULT.match(text, at)):
                blocks.append(b.group(1))
                at = b.end()
            if at < len(text) or not blocks:
                raise Dropped("Hermes-style <tool_response> turn with other text in it")
            out += [{**{k: v for k, v in m.items() if k not in ("content", "_parts")}, "role": "tool", "content": r}
                    for r in blocks]  # fmt: skip
            continue
        out.append(m)
    return out


def _with_system(record: dict, msgs: list[dict]) -> list[dict]:
    """A record-level system prompt (`system` column) goes first, unless the messages have their own."""
    system = record.get("system")
    if isinstance(system, str) and system.strip() and msgs[0]["role"] != "system":
        return [{"role": "system", "content": system}] + msgs
    return msgs


def _tools(tools) -> list[dict] | None:
    """Conversation-level tool definitions (a list, or a JSON string of one), or None."""
    if tools is None or tools == "" or tools == []:
        return None
    tools = _json(tools, "tool definitions")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Dropped("tool definitions are not a list of objects")
    return [t if "type" in t else {"type": "function", "function": t} for t in tools]


def _check_order(msgs: list[dict], repairs: list[str] | None) -> list[dict]:
    """Leading non-user turns dropped (a repair); then the turn order a chat template expects."""
    if any(m["role"] == "system" for m in msgs[1:]):
        raise Dropped("system turn after the start")
    system = msgs[:1] if msgs[0]["role"] == "system" else []
    body = msgs[len(system) :]
    first_user = next((i for i, m in enumerate(body) if m["role"] == "user"), None)
    if first_user is None:
        raise Dropped("no user turn")
    if first_user:
        body = body[first_user:]
        if repairs is not None:
            repairs.append(LEADING_DROPPED)
    if not any(m["role"] == "assistant" for m in body):
        raise Dropped("no assistant turn")
    for a, b in zip(body, body[1:]):
        if b["role"] == "tool" and not (a["role"] == "tool" or a.get("tool_calls")):
            raise Dropped("tool result with no call before it")
        if a.get("tool_calls") and b["role"] != "tool":
            raise Dropped("tool call with no result after it")
        if a["role"] == b["role"] and a["role"] != "tool":
            raise Dropped("roles do not alternate")
    return system + body

"""A conversation rendered by the chat template into samples: token ids and the loss mask.

The loss mask covers what the target generates when serving: each assistant turn's reasoning, content and
tool calls, with its end-of-turn token; never tool results, user or system text. Assistant turn i spans the
characters between the rendering of messages[:i] with the generation prompt (`before`) and the rendering of
messages[:i+1] (`upto`), trailing whitespace after the end-of-turn marker excluded.

Each turn in the context the target saw when it generated it: when every `upto` is a prefix of the whole
conversation's rendering, the template is stable and the conversation is one sample (tokenized whole,
spans mapped through the fast tokenizer's offsets). When the template renders a turn differently once later
turns follow (hybrid-thinking templates drop the reasoning of earlier turns), every assistant turn becomes
its own sample: the tokens of the prompt the template builds to generate it (`before`, tokenized alone, as
the serving engine does), then that turn's tokens, scored alone. A turn whose rendering does not start with
its own generation prompt (e.g. reasoning in the data, thinking switched off in the template kwargs) cannot
be placed in any context the target saw: the conversation is dropped with that reason.

Kinds, for the manifest's counts and `--no-reasoning-loss`: within a turn, `reasoning` runs from the turn's
start through its reasoning text and the closing think tag; `tool_call` from the end of the content (or of
the reasoning) to the end of the turn when the turn calls tools; `content` is the rest. The end-of-turn
token counts with the turn's last part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specdraft.data.messages import Conversation, Dropped
from specdraft.targets import CHAT_TEMPLATE_FIX, has_chat_template

KINDS = ("reasoning", "content", "tool_call")
_CLOSE_THINK = re.compile(r"\s*</think>\s*")
_EMPTY_THINK = re.compile(r"^\s*<think>\s*</think>\s*")
_PROBE = "SPECDRAFT-REASONING-PROBE"


@dataclass
class Sample:
    """One training sample: token ids, the loss mask, and the loss tokens counted per kind."""

    input_ids: list[int]
    loss_mask: list[int]
    kinds: dict[str, int] = field(default_factory=dict)


def has_generation_markers(tokenizer) -> bool:
    tpl = getattr(tokenizer, "chat_template", None) or ""
    return "{% generation %}" in tpl or "{%- generation %}" in tpl


def render(tokenizer, conv: Conversation, n: int, generation_prompt: bool, kwargs: dict) -> str:
    """The template's text for the first `n` messages (with the tools and template kwargs)."""
    return tokenizer.apply_chat_template(conv.messages[:n], tools=conv.tools, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)  # fmt: skip


def conversation_samples(tokenizer, conv: Conversation, kwargs: dict | None = None,
                         reasoning_loss: bool = True) -> list[Sample]:  # fmt: skip
    """The samples of one conversation (one when the template is stable, else one per assistant turn).

    Raises `Dropped` (with the reason) for a conversation no sample can be made of."""
    kwargs = kwargs or {}
    if has_generation_markers(tokenizer) and not conv.tools and not conv.has_reasoning:
        out = tokenizer.apply_chat_template(conv.messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kwargs)  # fmt: skip
        mask = [int(x) for x in out["assistant_masks"]]
        return [Sample(list(out["input_ids"]), mask, {"content": sum(mask)})]
    turns = [(i, *turn_text(tokenizer, conv, i, kwargs)) for i, m in enumerate(conv.messages)
             if m["role"] == "assistant"]  # fmt: skip
    full = render(tokenizer, conv, len(conv.messages), False, kwargs)
    if all(full.startswith(before + done) for _, before, done in turns):  # stable: one sample
        spans = [_turn_kinds(conv.messages[i], full, len(before), len(before + done.rstrip()))
                 for i, before, done in turns]  # fmt: skip
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        return [_sample(list(enc["input_ids"]), enc["offset_mapping"], spans, reasoning_loss)]
    out = []
    for i, before, done in turns:  # each turn after the prompt the template builds for it, scored alone
        done = done.rstrip()
        head = tokenizer(before, add_special_tokens=False)["input_ids"]
        tail = tokenizer(done, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [(0, 0)] * len(head) + [
            (s + len(before), e + len(before)) for s, e in tail["offset_mapping"]
        ]
        spans = [_turn_kinds(conv.messages[i], before + done, len(before), len(before) + len(done))]
        out.append(_sample(list(head) + list(tail["input_ids"]), offsets, spans, reasoning_loss))
    return out


def turn_text(tokenizer, conv: Conversation, i: int, kwargs: dict) -> tuple[str, str]:
    """(prompt, completion): the prompt the template builds to generate assistant turn `i`, and the text
    the target generates after it (reasoning, content, tool calls, end-of-turn marker).

    The completion is the template's own rendering of the turn past its prompt when that rendering extends
    the prompt and shows the turn's reasoning. Templates that hide the reasoning of the turn itself
    (DeepSeek-R1 renders none; Kimi-K2-thinking none up to the last final answer) or whose prompt opens a
    think block the turn's rendering lacks get the completion built from parts: the template's rendering of
    the turn without its reasoning (past the header it shares with the prompt, any empty think block
    removed), behind the reasoning wrapped as the template wraps it (`think_format`)."""
    msg = conv.messages[i]
    reasoning = (msg.get("reasoning_content") or "").strip()
    before, upto = render(tokenizer, conv, i, True, kwargs), render(tokenizer, conv, i + 1, False, kwargs)
    if upto.startswith(before) and len(upto.rstrip()) > len(before) and reasoning in upto[len(before) :]:
        return before, upto[len(before) :]
    bare_msg = {k: v for k, v in msg.items() if k != "reasoning_content"}
    plain = render(tokenizer, Conversation(conv.messages[:i] + [bare_msg], conv.tools), i + 1, False, kwargs)
    gen_tail, body = _split_turn(tokenizer, before, plain)
    alone = Conversation(
        [{"role": "user", "content": "Q"}, bare_msg], conv.tools
    )  # the turn in a minimal context
    gen_alone, body_alone = _split_turn(tokenizer, render(tokenizer, alone, 1, True, kwargs),
                                        render(tokenizer, alone, 2, False, kwargs))  # fmt: skip
    if gen_tail not in ("", gen_alone):  # the template re-rendered earlier turns: take the turn from `alone`
        gen_tail, body = (gen_alone if before.endswith(gen_alone) else ""), body_alone
    if not body.strip():
        raise Dropped("the template renders an assistant turn unlike its own generation prompt "
                      "(check --chat-template-kwargs, e.g. enable_thinking, against the data)")  # fmt: skip
    open_, close = think_format(tokenizer, kwargs)
    if reasoning:
        head = open_[len(gen_tail) :] if open_.startswith(gen_tail) else open_
        return before, head + reasoning + close + body
    return before, (close.lstrip(" ") if "<think>" in gen_tail else "") + body


def think_format(tokenizer, kwargs: dict) -> tuple[str, str]:
    """(open, close): how the template wraps a turn's reasoning, learned from two probe renderings (a final
    answer, then a tool-calling turn, as the last turn); `<think>\\n`, `\\n</think>\\n\\n` when neither shows it."""
    key = (getattr(tokenizer, "chat_template", None), repr(sorted(kwargs.items())))
    cache = tokenizer.__dict__.setdefault("_specdraft_think_format", {})
    if key not in cache:
        cache[key] = _probe_think(tokenizer, kwargs) or ("<think>\n", "\n</think>\n\n")
    return cache[key]


def _probe_think(tokenizer, kwargs: dict) -> tuple[str, str] | None:
    user = {"role": "user", "content": "Q"}
    call = {"type": "function", "id": "call_0", "function": {"name": "f", "arguments": {}}}
    for turn in ({"content": "ANSWER"}, {"content": "", "tool_calls": [call]}):
        conv = Conversation([user, {"role": "assistant", "reasoning_content": _PROBE, **turn}])
        try:
            prompt, text = render(tokenizer, conv, 1, True, kwargs), render(tokenizer, conv, 2, False, kwargs)
        except Exception:  # a template that refuses the probe teaches nothing
            continue
        at = text.find(_PROBE)
        close = _CLOSE_THINK.match(text, at + len(_PROBE)) if at >= 0 else None
        if close:
            return _split_turn(tokenizer, prompt, text[:at])[1] or "", close.group(0)
    return None


def _split_turn(tokenizer, prompt: str, rendered: str) -> tuple[str, str]:
    """(the prompt's tail, the turn) past the tokens a generation prompt and a rendering with the turn share;
    an empty think block at the turn's start is dropped (the reasoning goes back in by `think_format`)."""
    a = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    b = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    n = 0
    while n < min(len(a["input_ids"]), len(b)) and a["input_ids"][n] == b[n]:
        n += 1
    cut = a["offset_mapping"][n - 1][1] if n else 0
    return prompt[cut:], _EMPTY_THINK.sub("", rendered[cut:], count=1)


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
    `--chat-template-kwargs` (a JSON object); returns the kwargs. Raises with the fix on bad values."""
    import json
    from pathlib import Path

    if chat_template:
        p = Path(chat_template)
        looks_like_path = "{" not in chat_template and "\n" not in chat_template
        if looks_like_path and not p.is_file():
            raise FileNotFoundError(
                f"--chat-template {chat_template}: no such file (pass a file or the Jinja text)"
            )
        tokenizer.chat_template = p.read_text() if looks_like_path else chat_template
    try:
        kwargs = json.loads(chat_template_kwargs) if chat_template_kwargs else {}
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--chat-template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": true}}': {e}"
        ) from e
    if not isinstance(kwargs, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object, not {chat_template_kwargs!r}")
    return kwargs


def require_chat_template(tokenizer, target: str, also: str = "") -> None:
    """Refuse in one line, with the fix, a tokenizer that cannot render chats (`has_chat_template`): checked
    with the tokenizer alone, before a command loads any model. `also`: a further fix of that command."""
    if not has_chat_template(tokenizer):
        raise ValueError(f"the tokenizer of {target} has no chat template (a base model?), so conversations "
                         "cannot be rendered as the target sees them when served. "
                         f"Fix: {CHAT_TEMPLATE_FIX}{also}")  # fmt: skip


def template_identity(tokenizer, kwargs: dict) -> dict:
    """What a later stage must render with to see what this data saw: the template's hash and the kwargs."""
    import hashlib

    tpl = getattr(tokenizer, "chat_template", None) or ""
    return {"chat_template_sha256": hashlib.sha256(tpl.encode()).hexdigest()[:16] if tpl else None,
            "chat_template_kwargs": kwargs}  # fmt: skip

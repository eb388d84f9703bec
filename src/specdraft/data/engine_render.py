"""The serving engine's own renderer as the check of every sample (issue 47).

The chat template is not always what the engine serves: vLLM resolves the template itself (a `--chat-template`
given to it, else the processor's, else the tokenizer's, else a fallback), parses the client's messages its own
way (reasoning read from the `reasoning` field and given to the template as `reasoning` and `reasoning_content`;
tool-call arguments parsed into objects) and filters the template kwargs to those the template reads. When vLLM
is importable, `prepare` renders every sample's prompt and turn through that code for the target (the messages as
a client sends them: reasoning in `reasoning`, the content as the reasoning parser gave it, text parts as given,
arguments as JSON text) and drops a conversation it renders differently, naming vLLM and both texts' first
difference; the scored turn too (`check_samples`): what the target must generate after the prompt, token by
token, as vLLM renders the conversation. Without
vLLM (or with `renderer="template"`) the template's own rendering stays the check. The manifest's `renderer`
says which checked the samples.

vLLM renders gpt-oss models through openai-harmony and Mistral models under `tokenizer_mode mistral` through
mistral-common, not through the Jinja template; those paths are not driven here (`EngineRenderer` refuses such a
target with the reason, and `prepare` says the template checked the samples).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from specdraft.data.messages import Conversation, Dropped
from specdraft.data.render import _EMPTY_BLOCK, _OPENS_THINK, Sample, Turn, as_sent

RENDERERS = ("auto", "vllm", "template")
_OWN_RENDERERS = {"gpt_oss": "openai-harmony", "mistral": "mistral-common"}  # model_type -> vLLM's own path
# a turn's part before the renderer's text, around its reasoning: an opening tag then a newline at most before
# it, a newline at most then the closing tag (two newlines after it, R1's `\n</think>\n\n`) after it: a doubled
# newline there is none the target writes
_BEFORE_REASONING = re.compile(r"(<think>)?\n?")
_AFTER_REASONING = re.compile(r"\n?(</think>\n{0,2})?")


def first_difference(ours, theirs, what: str = "char") -> str:
    """Where two texts (or id lists) first differ, with a little of each around that place."""
    n = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if isinstance(ours, str):
        return f"first difference at {what} {n}: template {ours[n : n + 40]!r} vs vLLM {theirs[n : n + 40]!r}"
    return (
        f"first difference at {what} {n}: template {list(ours[n : n + 8])} vs vLLM {list(theirs[n : n + 8])}"
    )


def _vllm_chat_renderer(target_dir: str):
    """vLLM's in-process chat rendering for `target_dir`: (render(messages, tools, chat_template, gen, kwargs)
    -> (text, ids), vLLM's version, the model type).

    vLLM's internal rendering API (`ModelConfig`, `get_tokenizer`, `parse_chat_messages`,
    `resolve_chat_template_content_format`, `safe_apply_chat_template`: vLLM 0.32, what `/v1/chat/completions/render`
    and `HfRenderer.render_messages` run), called through the engine contract, which declares each (optional
    entries: `specdraft doctor` checks them)."""
    from specdraft.engine import contract as engines

    config = engines.call("vllm.ModelConfig.render", model=target_dir, tokenizer=target_dir)
    tokenizer = engines.call("vllm.get_tokenizer", target_dir)

    def render(messages: list[dict], tools, chat_template, gen: bool, kwargs: dict) -> tuple[str, list[int]]:
        fmt = engines.call("vllm.resolve_chat_template_content_format", chat_template=chat_template, tools=tools,
                     given_format="auto", tokenizer=tokenizer, model_config=config)  # fmt: skip
        conversation, _, _ = engines.call("vllm.parse_chat_messages", messages, config, content_format=fmt)
        args = dict(tools=tools, chat_template=chat_template, add_generation_prompt=gen)
        text = engines.call("vllm.safe_apply_chat_template", config, tokenizer, conversation, tokenize=False,
                      user_kwargs=kwargs, **args)  # fmt: skip
        ids = engines.call("vllm.safe_apply_chat_template", config, tokenizer, [dict(m) for m in conversation],
                     tokenize=True, user_kwargs=kwargs, **args)  # fmt: skip
        return text, list(ids)

    def encode(
        text: str,
    ) -> list[int]:  # the engine's tokenizer on text (the prompt and turn a target is served)
        return list(tokenizer.encode(text, add_special_tokens=False))

    hf_config = engines.read(config, "vllm.ModelConfig.render", "hf_config")
    return render, engines.installed_version("vllm") or "?", getattr(hf_config, "model_type", ""), encode


@dataclass
class EngineRenderer:
    """The engine's rendering of a target's chats: `render(messages, tools, gen, kwargs) -> (text, ids)`, and its
    tokenizer: `encode(text) -> ids` (no special tokens added: a rendering holds its own)."""

    name: str
    _render: object
    chat_template: str | None
    _encode: object = None

    def render(self, messages: list[dict], tools, gen: bool, kwargs: dict) -> tuple[str, list[int]]:
        return self._render(messages, tools, self.chat_template, gen, kwargs)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def check(
        self, conv: Conversation, turns: list[tuple[int, Turn]], samples: list[Sample], kwargs: dict
    ) -> None:
        """`check_samples` with this engine: raises `Dropped` for a sample it renders otherwise."""
        check_samples(self, conv, turns, samples, kwargs)


def engine_renderer(target_dir: str | Path | None, chat_template: str | None, choice: str = "auto"):
    """(the EngineRenderer, or None, and the manifest's `renderer` text).

    `choice`: "auto" (vLLM when it imports and renders this target through the template, else the template),
    "vllm" (refuse, with the reason, when it cannot) or "template" (the template's own rendering only).
    `chat_template`: the template text given to prepare (as `vllm serve --chat-template` would get it), or None
    (vLLM resolves the target's own)."""
    if choice not in RENDERERS:
        raise ValueError(f"--renderer {choice!r}: choose one of {', '.join(RENDERERS)}")
    if choice == "template":
        return None, "template"
    why = ""
    if target_dir is None or not (Path(target_dir) / "config.json").is_file():
        why = "the target has no config.json for vLLM to load"
    else:
        try:
            render, version, model_type, encode = _vllm_chat_renderer(str(target_dir))
        except ImportError as e:
            why = f"vLLM is not importable ({e})"
        except Exception as e:  # vLLM cannot take this target: the template stays the check, said why
            why = f"vLLM cannot load the target's config/tokenizer ({type(e).__name__}: {str(e)[:120]})"
        else:
            if model_type in _OWN_RENDERERS:
                why = (f"vLLM renders {model_type} models through {_OWN_RENDERERS[model_type]}, not the template "
                       "(not driven by specdraft yet)")  # fmt: skip
            else:
                return EngineRenderer(f"vllm {version}", render, chat_template, encode), f"vllm {version}"
    if choice == "vllm":
        raise ValueError(f"--renderer vllm: {why}; pass --renderer template to check with the template alone")
    return None, f"template ({why})"


def as_client_sends(messages: list[dict], parts: dict[int, list[dict]] | None = None) -> list[dict]:
    """Messages as an OpenAI client sends them back to vLLM: reasoning in `reasoning` (the field vLLM reads),
    tool-call arguments as JSON text, content given as text parts (`parts`, by message) sent as those parts."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if parts and i in parts:
            m["content"] = parts[i]
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                               if isinstance(c["function"]["arguments"], str)
                               else json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                               for c in m["tool_calls"]]  # fmt: skip
        out.append(m)
    return out


def check_samples(engine, conv: Conversation, turns: list[tuple[int, Turn]], samples: list[Sample],
                  kwargs: dict) -> None:  # fmt: skip
    """The engine check: for each turn, the engine renders the messages before it (as a client sends them: reasoning
    in `reasoning`, text parts as given) with its generation prompt to the sample's prompt, text and token ids, the
    messages through it to the template's rendering of the turn (`upto`), and the scored turn is what the target
    writes after that prompt as the engine renders the conversation (`_check_scored`); else `Dropped` naming the
    engine and the first difference."""
    client = replace(conv, reasoning_name="reasoning_content", sends_parts=False)
    sent = as_client_sends(as_sent(client, len(conv.messages)), conv.parts)
    for k, ((i, t), sample) in enumerate(zip(turns, samples)):
        n = sample.prompts[k if len(sample.prompts) > 1 else 0]
        try:
            text, ids = engine.render(sent[:i], conv.tools, True, kwargs)
            upto, _ = engine.render(sent[: i + 1], conv.tools, False, kwargs)
            history = upto if upto.startswith(text) else engine.render(sent[:i], conv.tools, False, kwargs)[0]
        except Exception as e:  # the engine refuses what the template renders: no true sample
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise Dropped(f"{engine.name} refuses the conversation the template renders: {msg}") from e
        if text != t.before:
            raise Dropped(f"{engine.name} renders the prompt of a turn unlike the template: "
                          f"{first_difference(t.before, text)}")  # fmt: skip
        if ids != sample.input_ids[:n]:
            raise Dropped(f"{engine.name} tokenizes the prompt of a turn unlike the sample: "
                          f"{first_difference(sample.input_ids[:n], ids, 'token')}")  # fmt: skip
        if upto != t.upto:
            raise Dropped(
                f"{engine.name} renders a turn unlike the template: {first_difference(t.upto, upto)}"
            )
        reasoning = (conv.messages[i].get("reasoning_content") or "").strip()
        given = conv.parsed[i][0] if i in conv.parsed else reasoning  # as the data wrote it, edges included
        _check_scored(engine, t, sample, n, (text, upto, history), given if given in t.text else reasoning)


def engine_turn(before: str, upto: str, history: str) -> tuple[str, bool]:
    """(the text a renderer shows for a turn after its prompt `before`, whether the prompt opens a think block the
    rendering of the turn lacks): `upto` past `before` when it extends it; else `upto` past the history and the
    prompt's header (the prompt past the history, less a trailing `<think>`), and past that `<think>` when the
    turn's rendering has it. `history`: the messages before the turn rendered without the prompt."""
    if upto.startswith(before):
        return upto[len(before) :].rstrip(), False
    gen = before[len(history) :] if before.startswith(history) else ""
    opens = _OPENS_THINK.search(gen)
    header = gen[: opens.start()] if opens else gen
    at = len(history) if upto.startswith(history) else upto.rfind(header) if header else -1
    if at < 0 or not upto.startswith(header, at):
        return "", False
    body = upto[at + len(header) :]
    if opens and body.startswith(gen[opens.start() :]):
        return body[len(gen) - opens.start() :].rstrip(), False
    return body.rstrip(), bool(opens)


def _check_scored(
    engine, t: Turn, sample: Sample, n: int, shown: tuple[str, str, str], reasoning: str
) -> None:
    """The scored turn against the engine (what the target must generate after the prompt, token by token): the
    engine's own text of the turn (`engine_turn`) ends it, before that comes nothing but the turn's reasoning and
    its think tags, one closing tag at most (one exactly after a prompt that opens a think block) and no opening
    one after such a prompt, and the engine's tokenizer makes the sample's ids of the prompt and the turn (a
    turn's stop id after it) from the engine's prompt followed by the turn. `shown`: the engine's (prompt, rendering
    through the turn, history) texts."""
    before = shown[0]
    shown, opened = engine_turn(*shown)
    empty = _EMPTY_BLOCK.match(shown)
    if reasoning and empty and not t.text.endswith(shown):  # the empty block the reasoning goes in (Kimi)
        shown = shown[empty.end() :]
    head = t.text[: len(t.text) - len(shown)]
    pre, _, post = head.partition(reasoning) if reasoning and reasoning in head else ("", "", head)
    if not t.text.endswith(shown) or not (
        _BEFORE_REASONING.fullmatch(pre) and _AFTER_REASONING.fullmatch(post)
    ):
        why = (f"before vLLM's text of it, {head[:80]!r} is more than the reasoning and its tags"
               if t.text.endswith(shown) else f"it does not end with vLLM's text of it {shown[-80:]!r}")  # fmt: skip
        raise Dropped(f"{engine.name} renders the scored turn unlike the sample: {why}")
    closes, opens = t.text.count("</think>"), t.text.count("<think>")
    if closes > 1 or opens > 1 or (opened and (closes != 1 or opens)):
        raise Dropped(f"{engine.name}: the scored turn holds {opens} <think> and {closes} </think> after a prompt "
                      f"that {'opens' if opened else 'opens no'} think block")  # fmt: skip
    ids = engine.encode(before + t.text + t.stop)
    if ids != sample.input_ids[: len(ids)] or len(ids) < n:
        raise Dropped(f"{engine.name} tokenizes the prompt and scored turn unlike the sample: "
                      f"{first_difference(sample.input_ids, ids, 'token')}")  # fmt: skip

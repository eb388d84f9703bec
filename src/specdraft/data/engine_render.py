"""The serving engine's own renderer as the check of every sample (issue 47).

The chat template is not always what the engine serves: vLLM resolves the template itself (a `--chat-template`
given to it, else the processor's, else the tokenizer's, else a fallback), parses the client's messages its own
way (reasoning read from the `reasoning` field and given to the template as `reasoning` and `reasoning_content`;
tool-call arguments parsed into objects) and filters the template kwargs to those the template reads. When vLLM
is importable, `prepare` renders every sample's prompt and turn through that code for the target (the messages as
a client sends them: reasoning in `reasoning`, the content as the reasoning parser gave it, arguments as JSON
text) and drops a conversation it renders differently, naming vLLM and both texts' first difference. Without
vLLM (or with `renderer="template"`) the template's own rendering stays the check. The manifest's `renderer`
says which checked the samples.

vLLM renders gpt-oss models through openai-harmony and Mistral models under `tokenizer_mode mistral` through
mistral-common, not through the Jinja template; those paths are not driven here (`EngineRenderer` refuses such a
target with the reason, and `prepare` says the template checked the samples).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RENDERERS = ("auto", "vllm", "template")
_OWN_RENDERERS = {"gpt_oss": "openai-harmony", "mistral": "mistral-common"}  # model_type -> vLLM's own path


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

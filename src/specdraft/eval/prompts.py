"""What both evaluations decode: prompts, how a turn is rendered to token ids, where generation stops.

The reference decoder (:mod:`specdraft.eval.reference`) and vLLM (:mod:`specdraft.eval.serving`) read the
same prompts, render them with the same chat template and stop at the same end-of-sequence ids, so their
reports compare prompt by prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Prompt:
    """One evaluation prompt: its user turns (the assistant turns are generated), or a ready chat or token ids.

    ``token_ids`` (the prompt as is) and ``messages`` (a chat rendered with the generation prompt) come
    only from prompt lists given to the vLLM evaluation; prompt files give user turns.
    """

    id: str
    category: str
    turns: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    messages: list[dict] | None = None


def load_prompts(prompts: str = "mtbench", max_prompts: int = 0) -> list[Prompt]:
    """Questions from MT-bench (`mtbench`: 80, 2 turns each, with categories) or a jsonl / JSON file.

    A record is either MT-bench style {"turns": [str, ...], "category"?, "question_id"?} or a chat
    ({"messages"|"conversations": [...]}, OpenAI or ShareGPT roles) whose user turns are used.
    `max_prompts` > 0 keeps that many, taken round-robin over categories (MT-bench: 8 -> one per category).
    """
    from specdraft.data.prepare import mtbench_path, normalize, read_conversations

    path = mtbench_path() if prompts == "mtbench" else Path(prompts)
    if not Path(path).exists():
        raise FileNotFoundError(
            f"prompt file {path} not found: pass `mtbench` or a jsonl of chats / questions"
        )
    out: list[Prompt] = []
    skipped = 0
    for rec, raw in read_conversations(path):
        if isinstance(raw, dict) and isinstance(raw.get("turns"), list) and raw["turns"]:
            turns = [t for t in raw["turns"] if isinstance(t, str) and t.strip()]
        else:
            msgs, _ = normalize(raw)
            turns = [m["content"] for m in msgs or [] if m["role"] == "user"]
        if not turns:
            skipped += 1
            continue
        qid = str(raw.get("question_id", raw.get("id", rec))) if isinstance(raw, dict) else str(rec)
        cat = str(raw.get("category", "all")) if isinstance(raw, dict) else "all"
        out.append(Prompt(id=qid, category=cat, turns=turns))
    if not out:
        raise ValueError(f"no usable prompts in {path} ({skipped} records without user turns): each line needs "
                         "`turns` (a list of strings) or `messages` with user turns")  # fmt: skip
    if max_prompts and max_prompts < len(out):  # round-robin over categories, file order within each
        by_cat: dict[str, list[Prompt]] = {}
        for p in out:
            by_cat.setdefault(p.category, []).append(p)
        picked: list[Prompt] = []
        for rank in range(max(len(v) for v in by_cat.values())):
            picked += [v[rank] for v in by_cat.values() if rank < len(v)]
        out = picked[:max_prompts]
    return out


def collect_prompts(prompts: str | Sequence[Any], max_prompts: int = 0) -> list[Prompt]:
    """Normalise the ``prompts`` argument of :func:`specdraft.eval.serving.evaluate_vllm`.

    Accepted: ``"mtbench"`` or a jsonl / JSON path (read by :func:`load_prompts`, as the reference
    evaluation reads them), or a list (its first ``max_prompts`` items) whose items are token-id lists,
    user messages (str, one-turn chats), chats (lists of ``{"role", "content"}`` dicts, rendered with the
    generation prompt appended) or :class:`Prompt` objects.

    Raises:
        ValueError: an empty list or an item of another kind.
    """
    if isinstance(prompts, (str, Path)):
        return [dataclasses.replace(p, turns=list(p.turns)) for p in load_prompts(str(prompts), max_prompts)]
    items = list(prompts)[:max_prompts] if max_prompts else list(prompts)
    if not items:
        raise ValueError("no prompts: pass `mtbench`, a jsonl path, or a non-empty list")
    out = []
    for i, p in enumerate(items):
        if isinstance(p, Prompt):
            out.append(dataclasses.replace(p, turns=list(p.turns)))
        elif isinstance(p, str):
            out.append(Prompt(str(i), "all", [p]))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) for t in p):
            out.append(Prompt(str(i), "all", token_ids=[int(t) for t in p]))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) and "role" in m for m in p):
            out.append(Prompt(str(i), "all", messages=[dict(m) for m in p]))
        else:
            raise ValueError(
                f"prompt {i} is neither a token-id list, a user message (str), a chat (list of "
                f"{{'role', 'content'}} dicts) nor an evaluate.Prompt: {str(p)[:80]!r}"
            )
    return out


#: how chats are rendered while `rendering` is active: `--chat-template` text (None: the tokenizer's own)
#: and `--chat-template-kwargs`; both evaluations render through `_chat_ids`, so they always agree
_RENDERING: dict[str, Any] = {"chat_template": None, "kwargs": {}}


@contextlib.contextmanager
def rendering(chat_template: str | None, kwargs: dict) -> Iterator[None]:
    """Render every prompt of this evaluation with `chat_template` (None: the tokenizer's own) and the
    template variables `kwargs` (e.g. `enable_thinking`), as serving would."""
    before = dict(_RENDERING)
    _RENDERING.update(chat_template=chat_template, kwargs=dict(kwargs))
    try:
        yield
    finally:
        _RENDERING.update(before)


def _chat_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of a chat rendered by the chat template (see `rendering`), with the generation prompt appended."""
    extra = {"chat_template": _RENDERING["chat_template"]} if _RENDERING["chat_template"] else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra,
                                         **_RENDERING["kwargs"])  # fmt: skip
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, user_turns: list[str], answers: list[str]) -> list[int]:
    """Token ids of a chat (user turn 1, answer 1, .., user turn n) with the generation prompt appended."""
    assert len(answers) == len(user_turns) - 1, "one answer per earlier user turn"
    msgs = []
    for i, u in enumerate(user_turns):
        msgs.append({"role": "user", "content": u})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return _chat_ids(tokenizer, msgs)


def render_turn(tokenizer: Any, p: Prompt, turn: int, answers: list[str]) -> list[int]:
    """Token ids of turn ``turn`` (0-based) of ``p``, following the earlier ``answers``.

    User turns are rendered by :func:`render_prompt`; ``token_ids`` are passed as they are; ``messages``
    are rendered as one chat.
    """
    if p.token_ids is not None:
        return list(p.token_ids)
    if p.messages is not None:
        return _chat_ids(tokenizer, p.messages)
    return render_prompt(tokenizer, p.turns[: turn + 1], answers[:turn])

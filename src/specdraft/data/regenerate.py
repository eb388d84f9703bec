"""regenerate: replace every assistant reply of a conversation file with the target's own reply.

A draft learns the distribution it is trained on; at serving time it only ever sees the target's text.
So, as every trainer in the field offers, the user turns are kept and each assistant reply is produced by
the target itself, turn by turn (turn 2 follows the target's reply to turn 1), through the target's chat
template (or `--chat-template`, with `--chat-template-kwargs`, as `prepare` takes them; both engines get the
prompt as token ids rendered by the target's tokenizer here, with the conversation's `tools`). The output
is a conversations jsonl that `specdraft prepare` reads as is (prepare it with the same template flags).

Reasoning: a reply that starts with a `<think>...</think>` block, or that closes with `</think>` the think
block the prompt opened (templates that force thinking), is written with the reasoning as the message's
`reasoning_content` and the rest as its `content` (prepare trains on both); a reply cut at the token limit
inside its reasoning is all reasoning. Replies with reasoning are counted.

Tool calls: no tool is run here, so only the assistant turns whose context needs no fresh tool result are
regenerated: a conversation ends before the first user turn that the data answers with a tool call (the
turns before it regenerated, the rest dropped; with none before it, the conversation is not written). Such
conversations are counted (`tool_cut`). A regenerated reply that itself calls a tool is kept as text.

Files of OUT:
    chunk-{k:05d}.jsonl   the regenerated conversations k*C .. (k+1)*C-1 of the usable input, written
                          atomically: a chunk is there whole or not at all
    .chunk-{k:05d}.totals.json  that chunk's totals, written just before the chunk (a chunk counts as done
                          only with both files: one without its totals is generated again)
    regenerate.json       the settings (the chat template's hash and kwargs among them) and input fingerprint,
                          written once the engine runs (a rerun with other settings is refused while a chunk is
                          there; a run that wrote no chunk may start over with other settings), then the
                          totals: replies by stop reason, replies with reasoning, tokens, conversations cut at a
                          tool call, replies that repeat themselves (`loops`: warned of), dropped records by reason
    conversations.jsonl   all chunks in input order, written when the last chunk is done

Sampling: by default at the temperature the target is served with (its generation_config's temperature and top-p,
else 0.7: greedy replies of a small target loop, docs/experiments.md), said when the run starts and recorded;
`--temperature 0` for greedy. A reply that repeats itself (over half its 8-token windows seen earlier in it) is
dropped by default with the rest of its conversation (`--loops drop`; `trim` cuts it where the repetition starts,
`keep` keeps it), counted in the totals.

Resume: rerun the same command; chunks already written are kept, the rest generated. Each chunk draws
its sampling seed from (--seed, chunk index), so a resumed run writes what an uninterrupted one would.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from tqdm import tqdm

from specdraft.data.messages import Conversation, normalize_record
from specdraft.data.prepare import ReadReport, _describe_drops, read_conversations
from specdraft.data.render import choose_template, require_chat_template, template_identity
from specdraft.fileio import DirLock, atomic_write_text, changed_settings, file_hash, read_state
from specdraft.targets import EMBEDDED_DEFAULT, stop_ids

SETTINGS_FILE = "regenerate.json"
OUTPUT_FILE = "conversations.jsonl"
END_OF_TURN, LENGTH = "end_of_turn", "length"
_OPEN_THINK = re.compile(r"\s*<think>")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class Sampling:
    """How replies are sampled (temperature 0: greedy)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass
    max_new_tokens: int = 512  # reply length cap (0: up to the context); a reply cut there has stop `length`


@dataclass
class Prompting:
    """How prompts are rendered and how long they (and the replies) may be."""

    tokenizer: Any  # the target's tokenizer, with the chosen chat template
    kwargs: dict  # --chat-template-kwargs
    max_prompt_tokens: int  # a conversation ends before a turn whose prompt would be longer
    context: int = 0  # the target's context length: a reply's bound when max_new_tokens is 0


@dataclass
class Reply:
    """One generated reply: its token ids (stop token excluded) and why it ended."""

    ids: list[int]
    stop: str  # END_OF_TURN or LENGTH


@dataclass
class Totals:
    """What a run produced, recorded in regenerate.json."""

    conversations: int = 0
    replies: dict[str, int] = field(default_factory=lambda: {END_OF_TURN: 0, LENGTH: 0})
    with_reasoning: int = 0  # replies written with reasoning_content
    reply_tokens: int = 0
    cut_short: int = 0  # conversations ended early because the next prompt was too long
    tool_cut: int = 0  # conversations ended before their first tool call (see the module docstring)
    looping: int = 0  # replies that repeat themselves (`loops`)
    looping_tokens: int = 0  # their tokens
    looping_dropped: int = 0  # of those, dropped with the rest of their conversation (--loops drop)
    looping_trimmed: int = 0  # of those, cut where the repetition starts (--loops trim)


#: the counts of Totals summed over chunks (replies, by stop reason, is summed per reason)
COUNTS = tuple(f.name for f in fields(Totals) if f.name != "replies")


#: a reply loops when over this share of its LOOP_N-token windows repeat an earlier one (a greedy small target
#: cut at the token limit: 198 of the 227 such SmolLM2-135M replies in docs/experiments.md; 8 of 208 that ended)
LOOP_SHARE, LOOP_N = 0.5, 8


def loops(ids: list[int]) -> bool:
    """Whether a reply repeats itself: over LOOP_SHARE of its LOOP_N-token windows seen earlier in it."""
    if len(ids) < 2 * LOOP_N:
        return False
    windows = [tuple(ids[i : i + LOOP_N]) for i in range(len(ids) - LOOP_N + 1)]
    return 1 - len(set(windows)) / len(windows) > LOOP_SHARE


def loop_start(ids: list[int]) -> int:
    """Where a reply starts repeating itself: the first token of its first LOOP_N-token window seen earlier
    (len(ids) when none is)."""
    seen = set()
    for i in range(len(ids) - LOOP_N + 1):
        w = tuple(ids[i : i + LOOP_N])
        if w in seen:
            return i
        seen.add(w)
    return len(ids)


class HFGenerator:
    """Batched generation with transformers: left padding, KV cache, stop at any end-of-turn id."""

    def __init__(self, model, pad_id: int | None, stop_ids: tuple[int, ...]):
        self.model = model
        self.stop_ids = stop_ids
        self.pad_id = pad_id if pad_id is not None else stop_ids[0]

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], max_new: list[int], sampling: Sampling, seed: int
    ) -> list[list[int]]:
        """The new tokens of each prompt (up to and including a stop id, then padding), at most its `max_new`."""
        device = self.model.device
        T = max(len(p) for p in prompts)
        ids = torch.full(
            (len(prompts), T), self.pad_id, dtype=torch.long, device=device
        )  # (B, T) left-padded
        att = torch.zeros((len(prompts), T), dtype=torch.long, device=device)  # (B, T)
        for b, p in enumerate(prompts):
            ids[b, T - len(p) :] = torch.as_tensor(p, device=device)
            att[b, T - len(p) :] = 1
        greedy = sampling.temperature <= 0
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=att,
            max_new_tokens=max(max_new),
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            eos_token_id=list(self.stop_ids),
            pad_token_id=self.pad_id,
        )
        return [
            row.tolist()[:n] for row, n in zip(out[:, T:], max_new, strict=True)
        ]  # (B, new) each cut to its cap


def _cut(new: list[int], stop_ids: tuple[int, ...]) -> Reply:
    """The reply up to (not including) its first stop id; `length` when no stop id came."""
    for i, t in enumerate(new):
        if t in stop_ids:
            return Reply(new[:i], END_OF_TURN)
    return Reply(new, LENGTH)


def prompt_text(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None
) -> str:
    """`messages` (and `tools`) rendered by the chat template with its kwargs, ending with the generation prompt."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                         **(kwargs or {}))  # fmt: skip


def render(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None
) -> list[int]:
    """Token ids of `prompt_text` (what both engines get as the prompt)."""
    return list(
        tokenizer(prompt_text(tokenizer, messages, tools, kwargs), add_special_tokens=False)["input_ids"]
    )


def split_reasoning(reply: str, opened: bool) -> tuple[str, str]:
    """(reasoning, content) of a decoded reply; reasoning is "" when the reply has none.

    `opened`: the prompt ended with an open `<think>`, so the reasoning runs to the reply's `</think>`;
    otherwise only a reply that starts with `<think>` has reasoning. Without a `</think>` (a reply cut at the
    token limit) all of it is reasoning."""
    if not opened:
        m = _OPEN_THINK.match(reply)
        if not m:
            return "", reply.strip()
        reply = reply[m.end() :]
    reasoning, _, content = reply.partition("</think>")
    return reasoning.strip(), content.strip()


def plain_user_turns(messages: list[dict]) -> list[dict]:
    """The user turns that need no tool: those before the first one the data answers with a tool call."""
    users = []
    for i, m in enumerate(messages):
        if m["role"] != "user":
            continue
        answer = messages[i + 1] if i + 1 < len(messages) else {}
        if answer.get("tool_calls") or answer.get("role") == "tool":
            return users
        users.append(m)
    return users


def regenerate_chunk(
    convs: list[Conversation], gen, prompting: Prompting, sampling: Sampling, turns: str, seed: int,
    on_turn: Callable[[int, Totals], None] | None = None, on_loop: str = "keep",
) -> tuple[list[Conversation], Totals]:  # fmt: skip
    """Regenerate a chunk of conversations turn by turn, all conversations of the chunk batched per turn;
    `on_turn(j, totals so far)` after each turn (progress within a chunk).

    Each conversation keeps its leading system message, its tools and its user turns up to the first the data
    answers with a tool call (`plain_user_turns`); turn j's prompt is the conversation so far with the
    target's own earlier replies. A conversation whose next prompt exceeds `max_prompt_tokens` (or, with
    max_new_tokens 0, leaves no room in the context) ends at the turns already done (dropped if none is).
    A reply that loops (`loops`) is kept, trimmed where it starts repeating, or dropped with the rest of its
    conversation, as `on_loop` says (`keep`, `trim`, `drop`).
    """
    tot = Totals()
    users = []
    for c in convs:
        kept, wanted = plain_user_turns(c.messages), sum(m["role"] == "user" for m in c.messages)
        if turns == "first":
            kept, wanted = kept[:1], 1
        tot.tool_cut += len(kept) < wanted
        users.append(kept)
    done = [[m for m in c.messages[:1] if m["role"] == "system"] for c in convs]
    alive = list(range(len(convs)))
    for j in range(max((len(u) for u in users), default=0)):
        batch, prompts, caps, opened = [], [], [], []
        for i in alive:
            if j >= len(users[i]):
                continue
            text = prompt_text(prompting.tokenizer, done[i] + [users[i][j]], convs[i].tools, prompting.kwargs)
            p = list(prompting.tokenizer(text, add_special_tokens=False)["input_ids"])
            cap = sampling.max_new_tokens or prompting.context - len(p)
            if len(p) > prompting.max_prompt_tokens or cap < 1:
                tot.cut_short += 1
                continue
            batch.append(i)
            prompts.append(p)
            caps.append(cap)
            opened.append(text.rstrip().endswith("<think>"))
        if not batch:
            break
        new = gen.generate(prompts, caps, sampling, seed * 1_000_003 + j)
        kept = []
        for i, ids, o in zip(batch, new, opened, strict=True):
            r = _cut(ids, gen.stop_ids)
            if loops(r.ids):
                tot.looping, tot.looping_tokens = tot.looping + 1, tot.looping_tokens + len(r.ids)
                if on_loop == "drop":  # the conversation ends before this reply
                    tot.looping_dropped += 1
                    continue
                if on_loop == "trim":  # cut where it starts repeating: no end of turn was generated there
                    tot.looping_trimmed += 1
                    r = Reply(r.ids[: loop_start(r.ids)], LENGTH)
            kept.append(i)
            reasoning, content = split_reasoning(prompting.tokenizer.decode(r.ids), o)
            reply = {
                "role": "assistant",
                **({"reasoning_content": reasoning} if reasoning else {}),
                "content": content,
            }
            done[i] += [users[i][j], reply]
            tot.replies[r.stop] += 1
            tot.with_reasoning += bool(reasoning)
            tot.reply_tokens += len(r.ids)
        alive = kept
        if on_turn is not None:
            on_turn(j, tot)
    out = [
        Conversation(d, c.tools)
        for d, c in zip(done, convs, strict=True)
        if any(m["role"] == "assistant" for m in d)
    ]
    tot.conversations = len(out)
    return out, tot


def _settings(data: Path, target: str, sampling: Sampling, turns: str, max_samples: int, chunk: int, seed: int,
              max_prompt_tokens: int, template: dict) -> dict:  # fmt: skip
    return {
        "source": str(data.resolve()),
        "source_hash": file_hash(data),
        "target": target,
        **asdict(sampling),
        "turns": turns,
        "max_samples": max_samples,
        "chunk_size": chunk,
        "seed": seed,
        "max_prompt_tokens": max_prompt_tokens,
        **template,  # chat_template_sha256, chat_template_kwargs
    }


def _chunk_done(out: Path, k: int) -> bool:
    """True when chunk `k` and its totals are both written (the totals go first; see _run_chunks)."""
    return (out / f"chunk-{k:05d}.jsonl").exists() and (out / f".chunk-{k:05d}.totals.json").exists()


def _check_resume(out: Path, settings: dict, defaults: dict) -> None:
    """Refuse other settings than those of the chunks already in `out` (none there: any settings start over).

    `defaults`: what a setting missing from the record (a run recorded before it existed) was."""
    f = out / SETTINGS_FILE
    if not f.exists() or not any(out.glob("chunk-*.jsonl")):
        return
    fix = (
        f"delete {f} and rerun with the settings this run started with (the chunks there are kept), or "
        "choose another output directory"
    )
    before = read_state(f, fix, keys=("settings",))["settings"]
    diff = changed_settings(before, settings, defaults)
    if diff:
        shown = ", ".join(f"{k}: {was!r} -> {now!r}" for k, was, now in diff)
        raise ValueError(f"{out} holds a regeneration with other settings ({shown}); rerun with the earlier "
                         "settings to resume, or choose another output directory")  # fmt: skip


def _usable(data: Path, max_samples: int) -> tuple[list[Conversation], ReadReport]:
    report = ReadReport()
    convs = []
    for rec, raw in read_conversations(data, report):
        conv, why = normalize_record(raw)
        if conv is None:
            report.drop(why, rec)
            continue
        convs.append(conv)
        if max_samples and len(convs) >= max_samples:
            break
    if not convs:
        raise ValueError(f"{data}: no usable conversation ({_describe_drops(report) or 'the file is empty'}); "
                         "each needs a user turn and an assistant turn")  # fmt: skip
    return convs, report


def _check_args(src: Path, data: str, engine: str, sampling: Sampling, turns: str, chunk_size: int,
                max_prompt_tokens: int, chat_template: str, chat_template_kwargs: str, dtype: str,
                tensor_parallel_size: int, engine_args: str, on_loop: str = "drop") -> dict:  # fmt: skip
    """Every bad argument in one ValueError, before anything loads; returns the parsed --engine-args."""
    from specdraft.engine.options import parse_engine_args
    from specdraft.fileio import DTYPES

    errors = []
    if turns not in ("first", "all"):
        errors.append(f"--turns must be `first` or `all`, not {turns!r}")
    if on_loop not in ("drop", "trim", "keep"):
        errors.append(f"--loops must be `drop`, `trim` or `keep`, not {on_loop!r}")
    if engine not in ("auto", "hf", "vllm"):
        errors.append(f"--engine must be `auto`, `hf` or `vllm`, not {engine!r}")
    if engine == "hf" and (tensor_parallel_size != 1 or engine_args):
        errors.append("--tensor-parallel-size and --engine-args apply to --engine vllm only")
    extra = {}
    try:
        extra = parse_engine_args(engine_args)
    except ValueError as e:
        errors.append(str(e))
    try:
        choose_template(
            SimpleNamespace(), chat_template, chat_template_kwargs
        )  # the values alone, no tokenizer yet
    except (ValueError, FileNotFoundError) as e:
        errors.append(str(e))
    if dtype != "auto" and dtype not in DTYPES:
        errors.append(f"--dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if sampling.max_new_tokens < 0:
        errors.append(f"--max-new-tokens must be at least 0 (0: up to the target's context), not {sampling.max_new_tokens}")  # fmt: skip
    for name, v in (("chunk-size", chunk_size), ("max-prompt-tokens", max_prompt_tokens)):
        if v < 1:
            errors.append(f"--{name} must be at least 1, not {v}")
    if not (sampling.temperature >= 0 and math.isfinite(sampling.temperature)) or not 0 < sampling.top_p <= 1:
        errors.append(f"--temperature must be >= 0 and --top-p in (0, 1], not {sampling.temperature} and {sampling.top_p}")  # fmt: skip
    if not src.is_file():
        errors.append(f"{data}: no such file (give a conversations file, or `sharegpt`)")
    if errors:
        raise ValueError("; ".join(errors))
    return extra


def regenerate(
    data: str,
    out: str,
    target: str = EMBEDDED_DEFAULT,
    engine: Literal["auto", "hf", "vllm"] = "auto",
    temperature: float | None = None,
    top_p: float | None = None,
    loops: Literal["drop", "trim", "keep"] = "drop",
    max_new_tokens: int = 512,
    max_samples: int = 0,
    turns: Literal["first", "all"] = "all",
    seed: int = 0,
    chunk_size: int = 32,
    max_prompt_tokens: int = 2048,
    chat_template: str = "",
    chat_template_kwargs: str = "",
    device: str = "auto",
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
    tensor_parallel_size: int = 1,
    engine_args: str = "",
    trust_remote_code: bool = False,
) -> Path:
    """Replace each assistant reply with the target's own, turn by turn; resumable (rerun the same command).

    Args:
        data: conversations (jsonl, JSON array, ShareGPT; `sharegpt` = the bundled ShareGPT file). A conversation
            ends before its first tool call (no tool is run); reasoning replies keep it as `reasoning_content`.
        out: output directory: chunk files, regenerate.json and, when done, conversations.jsonl.
        target: the target model (a directory, or `smollm2-135m`, the embedded default).
        engine: `vllm` (batched, the fast path), `hf` (transformers batched generation), or `auto`: vLLM when
            installed. Greedy replies are the same either way.
        temperature: sampling temperature (0 = greedy); default: the target's own (its generation_config's
            temperature, else 0.7), said when the run starts.
        top_p: nucleus sampling mass; default: the target's generation_config's top_p, else 1.
        loops: a reply that repeats itself (over half its 8-token windows seen earlier in it): `drop` it with the
            rest of its conversation, `trim` it where the repetition starts, or `keep` it (counted either way).
        max_new_tokens: reply length cap (a reply cut there is recorded with stop reason `length`); 0 = up to
            the target's context: max_position_embeddings of its config minus each prompt's length.
        max_samples: use only the first N usable conversations (0 = all).
        turns: `first` (only the first user turn) or `all` (every user turn, each after the target's reply).
        seed: sampling seed (each chunk and turn derives its own from it).
        chunk_size: conversations per chunk file (the unit of resume).
        max_prompt_tokens: a conversation ends before a turn whose prompt would be longer.
        chat_template: a Jinja chat template (a file, or the template text) instead of the tokenizer's own (a
            base model has none: it is refused without this, from its tokenizer, before any engine loads).
        chat_template_kwargs: JSON object of template variables, e.g. '{"enable_thinking": true}'; prepare the
            output with the same template flags.
        device: auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu or cuda[:N] (the hf engine).
        dtype: auto (bfloat16 on a GPU that supports it, else float32), float32, bfloat16 or float16.
        tensor_parallel_size: vLLM: GPUs the target is split over.
        engine_args: vLLM: JSON of more `vllm.LLM` options, e.g. '{"max_num_seqs": 64}' (checked before loading).
        trust_remote_code: allow model code shipped with the target.
    """
    from specdraft.data.prepare import sharegpt_path
    from specdraft.runtime import resolve_device, resolve_dtype
    from specdraft.targets import load_tokenizer, locate_target

    src = sharegpt_path() if data == "sharegpt" else Path(data)
    sampling = _sampling(target, temperature, top_p, max_new_tokens)
    extra = _check_args(src, data, engine, sampling, turns, chunk_size, max_prompt_tokens, chat_template,
                        chat_template_kwargs, dtype, tensor_parallel_size, engine_args, loops)  # fmt: skip
    # a missing or empty target is named here, before any engine is chosen
    target_dir = locate_target(target, need="config")
    tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
    recorded_before = template_identity(
        tokenizer, {}
    )  # what runs recorded before these settings rendered with
    kwargs = choose_template(tokenizer, chat_template, chat_template_kwargs)
    require_chat_template(tokenizer, target)  # the tokenizer alone: before any engine loads
    context = _context_length(target, trust_remote_code) if max_new_tokens == 0 else 0
    prompting = Prompting(tokenizer, kwargs, max_prompt_tokens, context)
    root = Path(out)
    settings = _settings(src, target, sampling, turns, max_samples, chunk_size, seed, max_prompt_tokens,
                         template_identity(tokenizer, kwargs)) | {"loops": loops}  # fmt: skip
    with DirLock(root, "regeneration"):
        # a run recorded before loops were handled kept them; before sampling was the default it was greedy
        _check_resume(root, settings, recorded_before | {"loops": "keep"})
        convs, report = _usable(src, max_samples)
        chunks = [convs[i : i + chunk_size] for i in range(0, len(convs), chunk_size)]
        todo = [k for k in range(len(chunks)) if not _chunk_done(root, k)]
        if todo:
            if engine == "auto":
                engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
            if engine == "vllm":
                dtype = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
                max_model_len = context or max_prompt_tokens + max_new_tokens
                gen = _vllm_generator(target, target_dir, tokenizer, dtype, max_model_len, tensor_parallel_size,
                                      seed, trust_remote_code, extra)  # fmt: skip
            else:
                device = resolve_device(device, "regenerate")
                gen = _hf_generator(
                    target, tokenizer, device, resolve_dtype(dtype, device), trust_remote_code
                )
            # recorded once the engine runs: a run that failed to start holds no settings
            started = {"settings": settings, "done": False}
            atomic_write_text(root / SETTINGS_FILE, json.dumps(started, indent=1))
            print(f"regenerate: {len(todo)} of {len(chunks)} chunks to generate with {engine}", flush=True)
            try:
                _run_chunks(root, chunks, todo, gen, prompting, sampling, turns, seed, loops)
            finally:
                if hasattr(gen, "close"):
                    gen.close()  # the engine's memory back before the next stage loads anything
        return _finish(root, settings, len(chunks), report)


def _sampling(target: str, temperature: float | None, top_p: float | None, max_new_tokens: int) -> Sampling:
    """The sampling settings: those given, the rest the target's own (generation_config, else T 0.7), said."""
    from specdraft.targets import default_sampling, locate_target, read_generation_config

    if temperature is not None and top_p is not None:
        return Sampling(temperature, top_p, max_new_tokens)
    t, p, source = default_sampling(read_generation_config(locate_target(target, need="config")))
    t = t if temperature is None else temperature
    p = p if top_p is None else top_p
    how = "greedy" if t == 0 else f"temperature {t:g}, top-p {p:g}"
    print(f"regenerate: sampling {how} ({'given' if temperature is not None else source}; --temperature 0 for "
          "greedy)", flush=True)  # fmt: skip
    return Sampling(t, p, max_new_tokens)


def _context_length(target: str, trust_remote_code: bool) -> int:
    """The target's context length (max_position_embeddings of its text config): --max-new-tokens 0's bound."""
    from specdraft.targets import load_text_config

    cfg = load_text_config(target, trust_remote_code=trust_remote_code)
    for key in _CONTEXT_KEYS:
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError(f"{target}: its config names no context length ({', '.join(_CONTEXT_KEYS)}), so "
                     "--max-new-tokens 0 has no bound; give --max-new-tokens N")  # fmt: skip


def _stops(target: str, tokenizer, generation_config) -> tuple[int, ...]:
    stops = stop_ids(tokenizer, generation_config)
    if not stops:
        raise ValueError(f"{target}: neither the tokenizer nor generation_config.json names an EOS token; "
                         "replies could not end their turn")  # fmt: skip
    return stops


def _hf_generator(target: str, tokenizer, device: str, dtype: str, trust_remote_code: bool) -> HFGenerator:
    """An HFGenerator for `target`, loaded with transformers (`tokenizer` is the target's, already loaded)."""
    from specdraft.targets import load_target

    tgt = load_target(
        target, device=device, dtype=dtype, trust_remote_code=trust_remote_code, with_tokenizer=False
    )
    return HFGenerator(
        tgt.model, tokenizer.pad_token_id, _stops(target, tokenizer, tgt.model.generation_config)
    )


def _vllm_generator(target: str, target_dir: Path, tokenizer, dtype: str, max_model_len: int, tp: int, seed: int,
                    trust_remote_code: bool, engine_args: dict):  # fmt: skip
    """A VLLMGenerator for `target`, found at `target_dir` (the embedded default's converted dir); it gets
    prompts as token ids rendered by `tokenizer` here, so the chosen template and kwargs apply as with hf."""
    from specdraft.data.vllm_replies import VLLMGenerator
    from specdraft.targets import read_generation_config

    stops = _stops(target, tokenizer, read_generation_config(target_dir))
    return VLLMGenerator(str(target_dir), stops, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tp,
                         seed=seed, trust_remote_code=trust_remote_code, engine_args=engine_args)  # fmt: skip


def _run_chunks(
    root: Path,
    chunks,
    todo,
    gen,
    prompting: Prompting,
    sampling: Sampling,
    turns: str,
    seed: int,
    on_loop: str,
) -> None:
    bar = tqdm(total=sum(len(chunks[k]) for k in todo), unit="conv", desc="regenerate", mininterval=1.0)
    t0, ntok = time.time(), 0

    def rate(tokens: int) -> str:
        return f"{tokens / max(time.time() - t0, 1e-9):.1f}"

    for k in todo:
        # conversations count when their chunk is written; the chunk's turns show as they finish
        def turn_done(j: int, tot: Totals, k: int = k, before: int = ntok) -> None:
            n = before + tot.reply_tokens
            bar.set_postfix(chunk=k, turn=j + 1, tokens=n, tok_s=rate(n))

        convs, tot = regenerate_chunk(
            chunks[k], gen, prompting, sampling, turns, seed * 100_003 + k, turn_done, on_loop
        )
        lines = "".join(json.dumps({"messages": c.messages, **({"tools": c.tools} if c.tools else {}), "chunk": k})
                        + "\n" for c in convs)  # fmt: skip
        # the totals first: a chunk without them counts as not done (_chunk_done)
        atomic_write_text(root / f".chunk-{k:05d}.totals.json", json.dumps(asdict(tot)))
        atomic_write_text(root / f"chunk-{k:05d}.jsonl", lines)
        ntok += tot.reply_tokens
        bar.update(len(chunks[k]))
        bar.set_postfix(tokens=ntok, tok_s=rate(ntok))
    bar.close()


def _finish(root: Path, settings: dict, n_chunks: int, report: ReadReport) -> Path:
    """Join the chunks into conversations.jsonl, record the totals, print a one-paragraph report."""
    total = Totals()
    parts = []
    for k in range(n_chunks):
        parts.append((root / f"chunk-{k:05d}.jsonl").read_text())
        t = json.loads((root / f".chunk-{k:05d}.totals.json").read_text())
        for name in COUNTS:  # a chunk written before a count existed: 0
            setattr(total, name, getattr(total, name) + t.get(name, 0))
        for s, n in t["replies"].items():
            total.replies[s] += n
    atomic_write_text(root / OUTPUT_FILE, "".join(parts))
    meta = {"settings": settings, "done": True, "totals": asdict(total), "records_read": report.records,
            "dropped": {r: len(v) for r, v in report.dropped.items()}}  # fmt: skip
    atomic_write_text(root / SETTINGS_FILE, json.dumps(meta, indent=1))
    drops = _describe_drops(report)
    kwargs = settings["chat_template_kwargs"]
    print(f"regenerate: {total.conversations} conversations, {sum(total.replies.values())} replies "
          f"({total.replies[END_OF_TURN]} ended their turn, {total.replies[LENGTH]} cut at the token limit, "
          f"{total.with_reasoning} with reasoning), {total.reply_tokens} reply tokens -> {root / OUTPUT_FILE}"
          + (f"; {total.tool_cut} conversations ended before their first tool call" if total.tool_cut else "")
          + (f"; chat template kwargs {json.dumps(kwargs)} (prepare with the same)" if kwargs else "")
          + (f"; dropped: {drops}" if drops else ""))  # fmt: skip
    if total.looping:
        print(f"regenerate: {total.looping} replies repeated themselves ({total.looping_tokens} tokens): "
              f"{total.looping_dropped} dropped with the rest of their conversation, {total.looping_trimmed} trimmed "
              f"where the repetition starts, the rest kept (--loops {settings.get('loops', 'keep')})", flush=True)  # fmt: skip
    kept_loops = total.looping - total.looping_dropped - total.looping_trimmed
    if kept_loops and total.looping_tokens * 10 > total.reply_tokens:  # over a tenth of the tokens
        print(f"regenerate: warning: {total.looping} replies ({total.looping_tokens} of the {total.reply_tokens} "
              f"tokens) repeat themselves (over half their {LOOP_N}-token windows seen earlier in the reply): a "
              "draft trained on them learns the loops (docs/experiments.md: such data trained a worse draft than "
              "the original replies). Sample instead of greedy (leave --temperature out: the target's own), drop "
              "them (--loops drop), lower --max-new-tokens, or train on the data's own replies", flush=True)  # fmt: skip
    return root / OUTPUT_FILE

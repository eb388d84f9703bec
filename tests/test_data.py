"""prepare: tolerant readers, bad rows counted by reason, and exact assistant loss masks."""

import json

import pytest
from conftest import CHATML, LLAMA3, LLAMA3_GEN, build_tokenizer, write_jsonl

from specdraft.data.prepare import (
    LEADING_DROPPED,
    ReadReport,
    check_chat_template,
    load_dataset,
    normalize,
    prepare,
    read_conversations,
    tokenize_conversation,
)

CONV = [
    {"role": "user", "content": "Hello! How can I help you today?"},
    {"role": "assistant", "content": "The quick brown fox jumps."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "It is four."},
]


def masked_text(tok, ids, mask):
    """The masked tokens, decoded run by run."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.mark.parametrize(
    "template,end",
    [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>"), (LLAMA3_GEN, "<|eot_id|>")],
    ids=["chatml", "llama3-diff", "llama3-generation-markers"],
)
def test_mask_covers_exactly_assistant_replies(template, end):
    tok = build_tokenizer(template)
    ids, mask = tokenize_conversation(tok, CONV)
    assert len(ids) == len(mask)
    assert masked_text(tok, ids, mask) == ["The quick brown fox jumps." + end, "It is four." + end]
    # the unmasked rest is exactly the prompt part of the rendering
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)


@pytest.mark.real
def test_mask_on_real_smollm2_template():
    from specdraft.targets import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    ids, mask = tokenize_conversation(tok, CONV)
    assert masked_text(tok, ids, mask) == ["The quick brown fox jumps.<|im_end|>", "It is four.<|im_end|>"]
    # the template's default system prompt and the user turns stay unmasked
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(
        [i for i, m in zip(ids, mask) if not m]
    )
    assert ids == tok.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]


def test_no_chat_template_is_a_clear_error():
    tok = build_tokenizer(CHATML)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*Fix"):
        check_chat_template(tok)


def test_normalize_reasons():
    ok = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert normalize(ok) == (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        None,
    )
    assert normalize({"messages": [{"role": "user", "content": "hi"}]})[1] == "no assistant turn"
    assert (
        normalize({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]})[1]
        == "empty content"
    )
    assert normalize({"messages": [{"role": "wizard", "content": "a"}]})[1] == "unknown role"
    # a leading assistant turn is dropped; what is left ([user]) has no assistant turn
    assert normalize({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]})[
        1
    ] == ("no assistant turn")
    assert normalize({"messages": [{"role": "assistant", "content": "a"}]})[1] == "no user turn"
    two_users = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    assert normalize({"messages": two_users})[1] == "roles do not alternate"
    assert normalize(
        {"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "x"}]}
    )[1] == ("not valid UTF-8")


def test_truncated_json_array_recovers_every_whole_record(tmp_path):
    recs = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(5)
    ]
    text = json.dumps(recs)
    cut = text[: text.index('"a4"') + 2]  # cut inside the last record
    p = tmp_path / "cut.json"
    p.write_text(cut)
    rep = ReadReport()
    got = list(read_conversations(p, rep))
    assert [r for r, _ in got] == [0, 1, 2, 3]
    assert rep.dropped == {"truncated record at end of file": [4]}
    assert rep.truncated_tail_bytes > 0


def test_jsonl_with_bad_lines(tmp_path):
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": CONV})
    p.write_bytes(
        b"\n".join([good.encode(), b"{not json", b'{"messages": "\xff\xfe"}', good.encode()]) + b"\n"
    )
    rep = ReadReport()
    got = list(read_conversations(p, rep))
    assert [r for r, _ in got] == [0, 3]
    assert rep.dropped == {"not valid JSON": [1], "not valid UTF-8": [2]}


def test_prepare_end_to_end_reports_drops(tmp_path, tiny_llama_dir):
    rows = [
        {"messages": CONV},
        {"messages": [{"role": "user", "content": "no reply"}]},
        {
            "messages": CONV
            + [{"role": "user", "content": "x " * 400}, {"role": "assistant", "content": "y " * 400}]
        },
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
        {"messages": CONV[:2]},
    ]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    out = prepare(str(src), str(tmp_path / "ds"), target=str(tiny_llama_dir), max_length=128)
    ds = load_dataset(out)
    man = ds.manifest
    assert len(ds) == 3 and man["num_samples"] == 3
    assert man["dropped"] == {
        "no assistant turn": {"count": 1, "records": [1]},
        "empty content": {"count": 1, "records": [3]},
    }
    assert man["truncated_to_max_length"] == {"count": 1, "records": [2]}
    assert max(len(x) for x in ds.input_ids) == 128
    counts = ds.token_counts
    assert counts.sum() == man["num_loss_tokens"] == sum(sum(m) for m in ds.loss_mask)
    with pytest.raises(ValueError, match="--strict.*no assistant turn.*records \\[1\\]"):
        prepare(str(src), str(tmp_path / "ds2"), target=str(tiny_llama_dir), max_length=128, strict=True)


def test_leading_non_user_turns_are_dropped_not_the_conversation(tmp_path, tiny_llama_dir):
    """ShareGPT style: a conversation opening with the assistant keeps everything from its first user turn."""
    system = {"role": "system", "content": "Be brief."}
    lead = [{"role": "assistant", "content": "Hi, I am a bot."}, {"role": "assistant", "content": "Ask me."}]
    repairs: list[str] = []
    assert normalize({"messages": lead + CONV}, repairs) == (CONV, None)
    assert repairs == [LEADING_DROPPED]
    repairs = []
    assert normalize({"messages": [system, *lead[:1], *CONV]}, repairs) == ([system, *CONV], None)
    assert repairs == [LEADING_DROPPED]
    repairs = []
    assert normalize({"messages": CONV}, repairs) == (CONV, None) and repairs == []
    sharegpt = {"conversations": [{"from": "gpt", "value": "Hello."}, {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": "hello"}]}  # fmt: skip
    assert normalize(sharegpt)[0] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    rows = [
        {"messages": CONV},
        {"messages": lead + CONV},
        {"messages": lead},  # no user turn at all: still dropped
        {"messages": [system, *lead[:1], *CONV[:2]]},
    ]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    ds = load_dataset(prepare(str(src), str(tmp_path / "ds"), target=str(tiny_llama_dir), max_length=256))
    assert len(ds) == 3
    assert ds.manifest["repaired"] == {LEADING_DROPPED: {"count": 2, "records": [1, 3]}}
    assert ds.manifest["dropped"] == {"no user turn": {"count": 1, "records": [2]}}
    assert ds.input_ids[1] == ds.input_ids[0]  # the repaired conversation is exactly the user-first one
    assert ds.loss_mask[1] == ds.loss_mask[0]


@pytest.mark.parametrize("pretty", [True, False], ids=["pretty-printed", "one-line"])
def test_top_level_json_object_is_named(tmp_path, pretty, tiny_llama_dir):
    """A file that is one JSON object wrapping the conversations: its own message, with where they are."""
    doc = {"version": 2, "data": [{"messages": CONV} for _ in range(124)]}
    p = tmp_path / "wrapped.json"
    p.write_text(json.dumps(doc, indent=2 if pretty else None))
    with pytest.raises(ValueError, match=r"the file is one JSON object, not a list of conversations: .*"
                                         r"\['version', 'data'\].*'data' holds a list of 124 objects.*jq -c"):  # fmt: skip
        list(read_conversations(p))
    with pytest.raises(ValueError, match="the file is one JSON object, not a list of conversations"):
        prepare(str(p), str(tmp_path / "ds"), target=str(tiny_llama_dir))
    # one conversation object, pretty-printed, is one record; jsonl files are unaffected
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"messages": CONV}, indent=2))
    assert list(read_conversations(one)) == [(0, {"messages": CONV})]
    jl = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}] * 3)
    assert len(list(read_conversations(jl))) == 3


@pytest.mark.real
def test_real_sharegpt_file_is_recovered():
    from specdraft.data.prepare import sharegpt_path

    rep = ReadReport()
    repairs: list[str] = []
    n_ok = sum(1 for _, raw in read_conversations(sharegpt_path(), rep) if normalize(raw, repairs)[1] is None)
    assert rep.records == 17671  # every whole record of the cut-off file (see shared/DATA.md)
    assert list(rep.dropped) == ["truncated record at end of file"] and rep.truncated_tail_bytes > 0
    # 11144 records open with the user; of the 6358 opening with the assistant, 6172 are kept from their first
    # user turn on (the rest have no user turn, or other faults), as SpecForge keeps them
    assert repairs.count(LEADING_DROPPED) == 6172
    assert n_ok == 17293

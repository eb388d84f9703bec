"""regenerate on real conversation data: the chosen chat template and its kwargs, reasoning kept as
`reasoning_content`, replies up to the target's context, and the tool-call policy."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import pytest
import torch
from conftest import conversations, needs_vllm, write_jsonl
from standin_templates import TEMPLATES, standin_tokenizer

from specdraft import targets
from specdraft.data.messages import normalize_record
from specdraft.data.prepare import prepare
from specdraft.data.regenerate import (
    END_OF_TURN,
    LENGTH,
    SETTINGS_FILE,
    Prompting,
    Sampling,
    loops,
    regenerate,
    regenerate_chunk,
    render,
    split_reasoning,
)
from specdraft.targets import load_target, load_tokenizer

HYBRID = TEMPLATES["hybrid_thinking"]
CONTEXT = 256  # max_position_embeddings of conftest's tiny models
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "type": "function",
    "id": "call_0",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


@pytest.fixture
def convs_file(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", conversations(7, seed=3))


def _greedy(target, ids: list[int], max_new: int) -> str:
    """Oracle: token-by-token greedy decoding of one prompt alone (no padding, no KV cache, no generate())."""
    stops = targets.stop_ids(target.tokenizer, target.model.generation_config)
    new: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            t = int(target.model(torch.tensor([ids + new])).logits[0, -1].argmax())
        if t in stops:
            break
        new.append(t)
    return target.tokenizer.decode(new).strip()


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_reasoning_on_strings():
    assert split_reasoning("<think>\nplan it\n</think>\n\nthe answer", False) == ("plan it", "the answer")
    assert split_reasoning("  <think>a\nb</think>answer", False) == ("a\nb", "answer")
    assert split_reasoning("plan it\n</think>\n\nthe answer", True) == (
        "plan it",
        "the answer",
    )  # prompt opened
    assert split_reasoning("<think>\n\n</think>\n\nthe answer", False) == ("", "the answer")  # empty block
    assert split_reasoning("the answer", False) == ("", "the answer")
    assert split_reasoning("<think>\ncut at the token lim", False) == ("cut at the token lim", "")
    assert split_reasoning("cut at the token lim", True) == ("cut at the token lim", "")
    assert split_reasoning("x </think> y", False) == ("", "x </think> y")  # no leading block: all content


def test_chat_template_and_its_kwargs_choose_the_prompt(
    tiny_llama_dir, convs_file, tmp_path, capsys, one_thread
):
    kw = '{"enable_thinking": false}'
    args = dict(
        temperature=0.0,
        loops="keep",
        target=str(tiny_llama_dir),
        engine="hf",
        max_new_tokens=4,
        turns="first",
        max_samples=3,
    )
    out = regenerate(str(convs_file), str(tmp_path / "o"), chat_template=str(HYBRID), chat_template_kwargs=kw,
                     **args)  # fmt: skip
    target = load_target(str(tiny_llama_dir))
    target.tokenizer.chat_template = HYBRID.read_text()
    differs = 0
    for rec in _lines(out):
        first = rec["messages"][:1]
        ids = render(target.tokenizer, first, kwargs={"enable_thinking": False})
        assert target.tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert rec["messages"][1]["content"] == _greedy(target, ids, 4)
        differs += rec["messages"][1]["content"] != _greedy(target, render(target.tokenizer, first), 4)
    assert differs  # the kwargs changed what the target saw
    meta = json.loads((tmp_path / "o" / SETTINGS_FILE).read_text())
    assert meta["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    # the template's identity: its text as Jinja renders it (a file's trailing newline dropped, issue 36)
    assert (
        meta["settings"]["chat_template_sha256"]
        == hashlib.sha256(HYBRID.read_bytes().removesuffix(b"\n")).hexdigest()[:16]
    )
    assert 'chat template kwargs {"enable_thinking": false}' in capsys.readouterr().out


def test_other_template_or_kwargs_on_resume_are_refused(tiny_llama_dir, convs_file, tmp_path, one_thread):
    args = dict(
        temperature=0.0,
        loops="keep",
        target=str(tiny_llama_dir),
        engine="hf",
        max_new_tokens=1,
        max_samples=1,
        chat_template=str(HYBRID),
    )
    regenerate(
        str(convs_file), str(tmp_path / "o"), chat_template_kwargs='{"enable_thinking": false}', **args
    )
    with pytest.raises(ValueError, match=r"other settings \(chat_template_kwargs: \{'enable_thinking': False\} "
                                         r"-> \{'enable_thinking': True\}\)"):  # fmt: skip
        regenerate(
            str(convs_file), str(tmp_path / "o"), chat_template_kwargs='{"enable_thinking": true}', **args
        )
    with pytest.raises(ValueError, match=r"other settings \(chat_template_sha256: .*chat_template_kwargs"):
        regenerate(str(convs_file), str(tmp_path / "o"), **{**args, "chat_template": ""})
    with pytest.raises(ValueError, match="--chat-template-kwargs must be a JSON object"):
        regenerate(str(convs_file), str(tmp_path / "p"), chat_template_kwargs="enable_thinking", **args)
    # a run recorded before these settings existed (the tokenizer's own template, no kwargs) still resumes
    plain = dict(
        temperature=0.0,
        loops="keep",
        target=str(tiny_llama_dir),
        engine="hf",
        max_new_tokens=1,
        max_samples=1,
    )
    regenerate(str(convs_file), str(tmp_path / "q"), **plain)
    f = tmp_path / "q" / SETTINGS_FILE
    meta = json.loads(f.read_text())
    for k in ("chat_template_sha256", "chat_template_kwargs"):
        del meta["settings"][k]
    f.write_text(json.dumps(meta))
    regenerate(str(convs_file), str(tmp_path / "q"), **plain)


class Scripted:
    """A generator that answers every prompt with the same token ids (a real target's reasoning reply)."""

    def __init__(self, tokenizer, reply: str):
        self.stop_ids = (tokenizer.eos_token_id,)
        self.reply = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.prompts: list[list[int]] = []

    def generate(self, prompts, max_new, sampling, seed):
        self.prompts += prompts
        return [self.reply[:n] for n in max_new]


def _convs(rows: list[dict]):
    return [normalize_record(r)[0] for r in rows]


def test_a_reply_with_a_think_block_keeps_its_reasoning_and_prepare_trains_on_it(hybrid_dir, tmp_path):
    tok = load_tokenizer(str(hybrid_dir))
    gen = Scripted(tok, "<think>\nstep one\n</think>\n\nthe answer")
    convs, tot = regenerate_chunk(_convs(conversations(3, seed=1)), gen, Prompting(tok, {}, 2048, CONTEXT),
                                  Sampling(max_new_tokens=64), "all", seed=0)  # fmt: skip
    replies = [m for c in convs for m in c.messages if m["role"] == "assistant"]
    assert replies and all(
        m["reasoning_content"] == "step one" and m["content"] == "the answer" for m in replies
    )
    assert tot.with_reasoning == len(replies) == tot.replies[END_OF_TURN]
    data = write_jsonl(tmp_path / "regen.jsonl", [{"messages": c.messages} for c in convs])
    prepare(str(data), str(tmp_path / "ds"), target=str(hybrid_dir))
    kinds = json.loads((tmp_path / "ds" / "manifest.json").read_text())["loss_tokens_by_kind"]
    assert kinds["reasoning"] > 0 and kinds["content"] > 0


def test_replies_that_repeat_themselves_are_counted(hybrid_dir):
    """A greedy small target loops until the token limit (73% of the regenerated tokens in docs/experiments.md):
    such replies are counted, with their tokens, for the run's warning."""
    assert loops([5, 6, 7] * 20) and not loops(list(range(100))) and not loops([1] * 15)  # too short to judge
    tok = load_tokenizer(str(hybrid_dir))
    prompting, sampling = Prompting(tok, {}, 2048, CONTEXT), Sampling(max_new_tokens=400)
    looping = Scripted(tok, "Sure. " + "The answer is yes and the answer is no. " * 20)
    _, tot = regenerate_chunk(_convs(conversations(3, seed=1)), looping, prompting, sampling, "first", seed=0)
    assert tot.looping == 3 and tot.looping_tokens == tot.reply_tokens > 0
    plain = Scripted(tok, " ".join(f"item {i} is {i * i}," for i in range(30)))
    _, tot = regenerate_chunk(_convs(conversations(3, seed=1)), plain, prompting, sampling, "first", seed=0)
    assert tot.looping == tot.looping_tokens == 0 and tot.reply_tokens > 0


def test_looping_replies_are_dropped_with_their_conversation_or_trimmed(hybrid_dir):
    """--loops drop (the default) ends the conversation before a looping reply (a first reply that loops: the
    conversation is not written); trim cuts it where the repetition starts, with no end of turn; both counted."""
    from specdraft.data.regenerate import LOOP_N, loop_start

    assert (
        loop_start([1, 2] + list(range(3, 3 + LOOP_N)) * 3) == 2 + LOOP_N
        and loop_start(list(range(50))) == 50
    )
    tok = load_tokenizer(str(hybrid_dir))
    prompting, sampling = Prompting(tok, {}, 2048, CONTEXT), Sampling(max_new_tokens=400)
    looping = Scripted(tok, "Sure. " + "The answer is yes and the answer is no. " * 20)
    convs, tot = regenerate_chunk(_convs(conversations(3, seed=1)), looping, prompting, sampling, "all", seed=0,
                                  on_loop="drop")  # fmt: skip
    assert convs == [] and tot.looping == tot.looping_dropped == 3 and tot.reply_tokens == 0
    convs, tot = regenerate_chunk(_convs(conversations(3, seed=1)), looping, prompting, sampling, "first", seed=0,
                                  on_loop="trim")  # fmt: skip
    replies = [m["content"] for c in convs for m in c.messages if m["role"] == "assistant"]
    assert len(replies) == 3 == tot.looping_trimmed and tot.replies[LENGTH] == 3
    ids = tok(replies[0], add_special_tokens=False)["input_ids"]
    assert not loops(ids) and replies[0].count("The answer is yes") == 1, replies[0]


def test_the_default_sampling_is_the_targets_own(tmp_path):
    """regenerate samples by default at the temperature the target's generation_config names (0.7 without one);
    do_sample false is greedy."""
    from specdraft.targets import default_sampling

    assert default_sampling({}) == (0.7, 1.0, "the target's generation_config names none: 0.7")
    assert default_sampling({"do_sample": True, "temperature": 0.6, "top_p": 0.95})[:2] == (0.6, 0.95)
    assert default_sampling({"do_sample": False, "temperature": 0.6})[:2] == (0.0, 1.0)


@pytest.mark.parametrize("looping_tokens, warned", [(300, True), (50, False)])
def test_a_run_mostly_of_loops_is_warned_of_with_the_fix(tmp_path, capsys, looping_tokens, warned):
    """The run's report warns, with what to change, when over a tenth of the reply tokens are in looping replies;
    the totals in regenerate.json count them across chunks (a chunk written before the count existed: 0)."""
    from specdraft.data.regenerate import Totals, _finish
    from specdraft.data.sources import ReadReport

    for k, tot in enumerate(
        [Totals(reply_tokens=500, looping=2, looping_tokens=looping_tokens), Totals(reply_tokens=500)]
    ):
        (tmp_path / f"chunk-{k:05d}.jsonl").write_text("")
        totals = {n: v for n, v in asdict(tot).items() if k == 0 or not n.startswith("looping")}
        (tmp_path / f".chunk-{k:05d}.totals.json").write_text(json.dumps(totals))
    _finish(tmp_path, {"chat_template_kwargs": {}}, 2, ReadReport())
    out = capsys.readouterr().out
    assert ("--loops drop" in out and f"2 replies ({looping_tokens} of the 1000 tokens)" in out) is warned
    meta = json.loads((tmp_path / SETTINGS_FILE).read_text())["totals"]
    assert (meta["looping"], meta["looping_tokens"], meta["reply_tokens"]) == (2, looping_tokens, 1000)


def test_each_turn_of_a_chunk_reports_its_progress(hybrid_dir):
    """A chunk's conversations are counted when it is written; its turns report as they finish (the progress bar's
    turn and tokens), so a long chunk does not sit at 0% for minutes."""
    tok = load_tokenizer(str(hybrid_dir))
    gen = Scripted(tok, "the answer")
    rows = conversations(4, seed=1)
    seen: list[tuple[int, int]] = []
    convs, tot = regenerate_chunk(_convs(rows), gen, Prompting(tok, {}, 2048, CONTEXT), Sampling(max_new_tokens=64),
                                  "all", seed=0, on_turn=lambda j, t: seen.append((j, t.reply_tokens)))  # fmt: skip
    most = max(sum(m["role"] == "user" for m in c.messages) for c in convs)
    assert most > 1 and [j for j, _ in seen] == list(range(most))
    per_reply = len(gen.reply) - 1  # the reply's tokens, its end-of-turn id not counted
    replies = [sum(sum(m["role"] == "user" for m in c.messages) > j for c in convs) for j in range(most)]
    assert [n for _, n in seen] == [per_reply * sum(replies[: j + 1]) for j in range(most)]
    assert seen[-1][1] == tot.reply_tokens


def test_a_prompt_that_opens_the_think_block_gets_its_reasoning_split_at_the_close():
    tok = standin_tokenizer("deepseek_r1")  # the generation prompt ends with `<think>\n`
    gen = Scripted(tok, "step one\n</think>\n\nthe answer")
    convs, tot = regenerate_chunk(_convs(conversations(2, seed=1)), gen, Prompting(tok, {}, 2048, CONTEXT),
                                  Sampling(max_new_tokens=64), "first", seed=0)  # fmt: skip
    assert [c.messages[1] for c in convs] == [
        {"role": "assistant", "reasoning_content": "step one", "content": "the answer"}
    ] * 2
    assert tok.decode(gen.prompts[0]).endswith("<think>\n") and tot.with_reasoning == 2


def test_max_new_tokens_0_runs_each_reply_up_to_the_context(tiny_llama_dir, convs_file, tmp_path, one_thread):
    out = regenerate(str(convs_file), str(tmp_path / "o"), target=str(tiny_llama_dir), engine="hf", max_new_tokens=0,
                     turns="first", max_samples=3, chunk_size=3, temperature=0.0, loops="keep")  # fmt: skip
    tok = load_tokenizer(str(tiny_llama_dir))
    prompts = [render(tok, rec["messages"][:1]) for rec in _lines(out)]
    assert len({len(p) for p in prompts}) == 3  # one batch of prompts of three lengths
    meta = json.loads((tmp_path / "o" / SETTINGS_FILE).read_text())
    assert meta["settings"]["max_new_tokens"] == 0
    assert meta["totals"]["replies"] == {END_OF_TURN: 0, LENGTH: 3}  # the random target never ends its turn
    assert meta["totals"]["reply_tokens"] == sum(CONTEXT - len(p) for p in prompts)  # each up to the context


def test_a_conversation_ends_before_its_first_tool_call(hybrid_dir, tmp_path, one_thread):
    chat = conversations(1, seed=5)[0]["messages"]
    rows = [
        {"messages": [{"role": "user", "content": "Hello! How can I help you today?"},
                      {"role": "assistant", "content": "Hi."},
                      {"role": "user", "content": "The weather in Paris?"},
                      {"role": "assistant", "content": "", "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                      {"role": "assistant", "content": "It is sunny."},
                      {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "Welcome."}],
         "tools": [WEATHER]},
        {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}],
         "tools": [WEATHER]},
        {"messages": chat},
    ]  # fmt: skip
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    out = regenerate(
        str(data),
        str(tmp_path / "o"),
        target=str(hybrid_dir),
        engine="hf",
        max_new_tokens=3,
        temperature=0.0,
        loops="keep",
    )
    got = _lines(out)
    assert [[m["role"] for m in r["messages"]] for r in got] == [
        ["user", "assistant"],
        [m["role"] for m in chat],
    ]
    assert got[0]["tools"] == [WEATHER] and "tools" not in got[1]
    totals = json.loads((tmp_path / "o" / SETTINGS_FILE).read_text())["totals"]
    assert totals["tool_cut"] == 2 and totals["conversations"] == 2
    # the tools reached the template: the reply is the target's answer to the prompt that lists them
    target = load_target(str(hybrid_dir))
    first = got[0]["messages"][:1]
    with_tools = render(target.tokenizer, first, tools=[WEATHER])
    assert "# Tools" in target.tokenizer.decode(with_tools)
    assert got[0]["messages"][1]["content"] == _greedy(target, with_tools, 3)
    assert got[0]["messages"][1]["content"] != _greedy(target, render(target.tokenizer, first), 3)


@pytest.fixture(scope="module")
def vllm_hybrid_dir(tmp_path_factory):
    """The hybrid-thinking tiny target with head_dim 64 (vLLM's CPU attention supports only some head sizes)."""
    import transformers as tf

    d = tmp_path_factory.mktemp("tiny-hybrid-vllm")
    tok = standin_tokenizer("hybrid_thinking")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=False)  # fmt: skip
    tf.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.slow  # a vLLM engine start (~36 s): make test-slow
@pytest.mark.vllm
@needs_vllm
def test_vllm_renders_with_the_template_kwargs_and_caps_each_reply_at_the_context(
    vllm_hybrid_dir, convs_file, tmp_path, monkeypatch, one_thread
):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    args = dict(temperature=0.0, loops="keep", target=str(vllm_hybrid_dir), max_new_tokens=0, turns="first", max_samples=3, chunk_size=3,
                chat_template_kwargs='{"enable_thinking": false}')  # fmt: skip
    out = {e: regenerate(str(convs_file), str(tmp_path / e), engine=e, **args) for e in ("hf", "vllm")}
    assert out["vllm"].read_text() == out["hf"].read_text()  # the same prompts, the same greedy replies
    tok = load_tokenizer(str(vllm_hybrid_dir))
    prompts = [
        render(tok, rec["messages"][:1], kwargs={"enable_thinking": False}) for rec in _lines(out["vllm"])
    ]
    totals = json.loads((tmp_path / "vllm" / SETTINGS_FILE).read_text())["totals"]
    assert totals["replies"] == {END_OF_TURN: 0, LENGTH: 3} and len({len(p) for p in prompts}) == 3
    assert totals["reply_tokens"] == sum(CONTEXT - len(p) for p in prompts)  # each its own cap, in one batch

"""`specdraft eval`: prompts, the report (tau, acceptance, speed, lossless), plots, reproducibility, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import write_jsonl

from specdraft.decode import speculate
from specdraft.decode.speculate import Speculator, target_generate
from specdraft.eval import reference
from specdraft.eval.command import evaluate
from specdraft.eval.prompts import load_prompts, render_prompt
from specdraft.eval.reference import evaluate_report, load_eval_draft
from specdraft.eval.report import summary_lines
from specdraft.eval.stats import acceptance_stats, first_divergence, tau_of

pytestmark = pytest.mark.usefixtures("one_thread")


def test_acceptance_stats():
    s = acceptance_stats([0, 1, 3, 3, 2], 3)
    assert s["tau"] == pytest.approx(1 + 9 / 5)
    assert s["acceptance_rate_per_position"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s["reached_per_position"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s["accepted_histogram"] == [1, 1, 1, 2]
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2 and first_divergence([1, 2], [1, 2, 3]) == 2
    assert tau_of([0, 1, 3, 3, 2]) == pytest.approx(1 + 9 / 5) and tau_of([]) == 1.0
    assert acceptance_stats([], 2) == {"rounds": 0, "tau": 1.0, "acceptance_rate_per_position": [None, None],
                                       "reached_per_position": [0.0, 0.0], "accepted_histogram": []}  # fmt: skip


def test_mtbench_prompts():
    ps = load_prompts("mtbench")
    assert len(ps) == 80 and all(len(p.turns) == 2 for p in ps)
    assert len({p.category for p in ps}) == 8
    eight = load_prompts("mtbench", max_prompts=8)
    assert len({p.category for p in eight}) == 8 and eight[0].id == "81"  # one per category, file order


def test_chat_jsonl_prompts(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 7, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"conversations": [{"from": "human", "value": "Tell me a joke"}, {"from": "gpt", "value": "No"}]},
        {"nothing": 1},
    ])  # fmt: skip
    ps = load_prompts(str(f))
    assert [(p.id, p.category, p.turns) for p in ps] == [
        ("7", "math", ["What is 2+2?", "And 3+3?"]), ("1", "all", ["Hi"]), ("2", "all", ["Tell me a joke"])
    ]  # fmt: skip
    one = write_jsonl(
        tmp_path / "one.jsonl", [{"question_id": 3, "category": "code", "turns": ["Sort a list"]}]
    )
    assert [(p.id, p.turns) for p in load_prompts(str(one))] == [("3", ["Sort a list"])]  # jsonl of one line
    empty = write_jsonl(tmp_path / "e.jsonl", [{"x": 1}])
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompts(str(empty))
    with pytest.raises(FileNotFoundError, match="mtbench"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_render_prompt_follows_the_chat(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    one = render_prompt(tok, ["hello"], [])
    two = render_prompt(tok, ["hello", "again"], ["fox"])
    assert two[: len(one)] == one and len(two) > len(one)
    assert tok.decode(two).endswith("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval-q")
    rows = [{"question_id": i, "category": ["writing", "math"][i % 2], "turns": [f"Write a poem about the sea {i}",
             "Now make it shorter"]} for i in range(3)]  # fmt: skip
    return str(write_jsonl(d / "q.jsonl", rows))


# ---------------------------------------------------------------------------------------------------------
# a draft that gets tokens accepted: with an untrained one nothing is, and "lossless" holds trivially
# ---------------------------------------------------------------------------------------------------------

RIGHT = 2  # draft depths 1..RIGHT propose the target's own next token, deeper ones a wrong one


class _ScriptedDrafter:
    """A `Drafter` that knows the target's greedy continuation (`truth`, the whole token stream): at draft
    depths 1..RIGHT it proposes the true next token, deeper ones the next token id after it (never true).

    Output at draft position t predicts stream index t + 2 (the decoder's alignment); the depth restarts at 1
    with each catch-up (`extend`) and grows with each chain `step`."""

    def __init__(self, vocab_size: int):
        self.target_ids = torch.arange(vocab_size)  # the full vocabulary: draft index = target id
        self.truth: list[int] = []
        self.n = self.depth = 0

    def reset(self) -> None:
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def crop(self, n: int) -> None:
        self.n = min(self.n, n)

    def _propose(self, last_position: int) -> torch.Tensor:
        tok = self.truth[last_position + 2]
        if self.depth > RIGHT:
            tok = (tok + 1) % len(self.target_ids)
        return torch.nn.functional.one_hot(torch.tensor(tok), len(self.target_ids)).float()

    def extend(self, aux, ids, positions):
        self.n, self.depth = int(positions[-1]) + 1, 1
        return torch.zeros(1), self._propose(int(positions[-1]))

    def step(self, ids, hidden, positions, mask):
        assert mask is None and len(ids) == 1, "chain drafting only"
        self.n, self.depth = int(positions[-1]) + 1, self.depth + 1
        return torch.zeros(1, 1), self._propose(int(positions[-1]))[None]


class _ScriptedSpeculator(Speculator):
    """The real decoder and acceptance rule, the draft replaced by `_ScriptedDrafter`: before each prompt
    its truth is decoded by the same target runner the baseline uses."""

    def __init__(self, target, draft):
        super().__init__(target, draft)
        self.drafter = _ScriptedDrafter(target.vocab_size)

    def generate(self, prompt, cfg, seed=0):
        ahead = target_generate(self.runner, prompt, cfg.max_new_tokens + cfg.max_draft_depth + 1)
        self.drafter.truth = list(prompt) + ahead.tokens
        return super().generate(prompt, cfg, seed)


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(reference, "Speculator", _ScriptedSpeculator)


def _assert_scripted_report(rep: dict, name: str, k: int) -> None:
    """The oracle, by hand: every round accepts exactly RIGHT of k drafts, so tau = RIGHT + 1, positions
    1..RIGHT are always accepted and RIGHT + 1 never; the output is the baseline's token for token."""
    d = rep["drafts"][name]
    assert d["lossless"] == {"checked": True, "ok": True, "divergences": []}
    assert all(
        r["drafts"][name]["accepted"] == [RIGHT] * len(r["drafts"][name]["accepted"]) for r in rep["records"]
    )
    assert d["tau"] == RIGHT + 1
    assert d["acceptance_rate_per_position"] == [1.0] * RIGHT + [0.0] + [None] * (k - RIGHT - 1)
    assert d["reached_per_position"] == [1.0] * RIGHT + [0.0] * (k - RIGHT)
    assert d["accepted_histogram"] == [0] * RIGHT + [d["rounds"]] + [0] * (k - RIGHT)
    for r in rep["records"]:  # one target forward per round, plus the prefill
        assert r["drafts"][name]["target_forwards"] == 1 + len(r["drafts"][name]["accepted"])
        assert r["drafts"][name]["new_tokens"] == r["baseline"]["new_tokens"]
    assert d["target_forwards"] < rep["baseline"]["target_forwards"]


def test_eval_report_on_tiny_llama(tiny_llama_dir, questions, tmp_path, scripted):
    out = tmp_path / "ev"
    kw = dict(target=str(tiny_llama_dir), prompts=questions, turns=2, max_new_tokens=12, k=3,
              draft_vocab_size=64, out=str(out), progress=False)  # fmt: skip
    rep = evaluate_report(["untrained"], **kw)
    d = rep["drafts"]["untrained"]
    assert rep["settings"]["turns"] == 2 and len(rep["records"]) == 6
    assert d["lossless"] == {"checked": True, "ok": True, "divergences": []}
    assert len(d["acceptance_rate_per_position"]) == 3 and 1.0 <= d["tau"] <= 4.0
    _assert_scripted_report(rep, "untrained", k=3)
    assert set(d["tau_per_category"]) == {"writing", "math"}
    assert d["tau_per_category"] == {"math": RIGHT + 1, "writing": RIGHT + 1}
    assert d["target_forwards"] <= rep["baseline"]["target_forwards"]
    assert rep["baseline"]["tokens_per_s"] > 0 and d["speedup"] > 0
    # a round's cost, split: the draft's part and the verify, each timed, within the rounds' wall clock
    r, rounds = d["round_ms"], sum(len(x["drafts"]["untrained"]["accepted"]) for x in rep["records"])
    assert min(r.values()) > 0 and (r["draft"] + r["verify"]) * rounds <= 1e3 * d["seconds"]
    assert summary_lines(rep)[2].startswith("  a round: draft ")
    assert (out / "acceptance_per_position.png").stat().st_size > 1000
    assert (out / "tau_per_category.png").stat().st_size > 1000
    saved = json.loads((out / "report.json").read_text())
    assert saved["drafts"]["untrained"]["tau"] == d["tau"]
    # same settings -> same tokens and acceptance (timings aside)
    again = evaluate_report(["untrained"], **{**kw, "out": str(tmp_path / "ev2")})
    strip = lambda rep: [(r["id"], r["turn"], r["drafts"]["untrained"]["accepted"]) for r in rep["records"]]  # noqa: E731
    assert strip(again) == strip(rep)
    assert summary_lines(rep)[1].startswith(
        f"untrained: tau {RIGHT + 1:.3f}, acceptance per position [1.00, 1.00, 0.00]"
    )


def _accept_one_too_many(real):
    def rule(p, toks, q, generator=None):
        a, nxt = real(p, toks, q, generator)
        return min(a + 1, len(toks)), nxt

    return rule


def _accept_none(real):
    def rule(p, toks, q, generator=None):
        return 0, int(p[0].argmax())  # greedy: the target's own token, no draft ever taken

    return rule


@pytest.mark.parametrize("broken", [_accept_one_too_many, _accept_none], ids=["one_too_many", "none"])
def test_a_broken_acceptance_rule_is_caught(
    tiny_llama_dir, questions, tmp_path, scripted, monkeypatch, capsys, broken
):
    """Mutation: the checks above must fail when the decoder's acceptance rule is broken, either way."""
    monkeypatch.setattr(speculate, "accept_chain", broken(speculate.accept_chain))
    kw = dict(target=str(tiny_llama_dir), prompts=questions, max_prompts=2, max_new_tokens=12, k=3,
              draft_vocab_size=64, progress=False)  # fmt: skip
    rep = evaluate_report(["untrained"], out=str(tmp_path / "r"), **kw)
    with pytest.raises(AssertionError):
        _assert_scripted_report(rep, "untrained", k=3)
    if broken is _accept_one_too_many:  # wrong drafts accepted: the lossless check itself reports them
        assert rep["drafts"]["untrained"]["lossless"]["ok"] is False
        assert evaluate(["untrained"], out=str(tmp_path / "c"), **kw) == 1
        assert "lossless NO" in capsys.readouterr().out


def test_eval_sampling_and_tree_and_cli_status(tiny_llama_dir, questions, tmp_path, capsys, monkeypatch):
    rep = evaluate_report(["untrained"], target=str(tiny_llama_dir), prompts=questions, max_prompts=2, tree=True,
                          topk=3, depth=3, budget=6, temperature=0.7, max_new_tokens=10, draft_vocab_size=64,
                          out=str(tmp_path / "s"), progress=False, seed=3)  # fmt: skip
    d = rep["drafts"]["untrained"]
    assert d["lossless"]["checked"] is False and len(d["acceptance_rate_per_position"]) == 3
    monkeypatch.setattr(reference, "Speculator", _ScriptedSpeculator)  # a draft that gets tokens accepted
    code = evaluate(["untrained"], target=str(tiny_llama_dir), prompts=questions, max_prompts=1, max_new_tokens=6,
                    draft_vocab_size=64, out=str(tmp_path / "c"), progress=False)  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "lossless yes" in printed
    assert f"tau {RIGHT + 1:.3f}" in printed  # drafts were accepted: the check was not trivially true


def test_eval_loads_saved_and_trained_drafts(tiny_llama_dir, tmp_path):
    from specdraft.model.checkpoint import save_draft
    from specdraft.targets import load_target

    tgt = load_target(str(tiny_llama_dir))
    counts_dir = tmp_path / "ds"
    counts_dir.mkdir()
    counts = np.zeros(tgt.vocab_size, dtype=np.int64)
    counts[100:140] = 5
    np.save(counts_dir / "token_counts.npy", counts)
    d = load_eval_draft("untrained", tgt, str(counts_dir), draft_vocab_size=40)
    assert d.t2d[100:140].all() and int(d.t2d.sum()) == 40
    save_draft(d, tmp_path / "saved")
    assert torch.equal(load_eval_draft(str(tmp_path / "saved"), tgt).fc.weight, d.fc.weight)
    with pytest.raises(FileNotFoundError, match="untrained"):
        load_eval_draft(str(tmp_path / "nothing"), tgt)
    with pytest.raises(FileNotFoundError, match="token counts"):
        load_eval_draft("untrained", tgt, str(tmp_path))


@pytest.mark.real
@pytest.mark.slow
def test_lossless_on_mtbench_first_turns_with_acceptance_and_rejection(tmp_path):
    """Zero divergences on the real target with a briefly trained draft, on one MT-bench first turn per category
    (8): rounds that accept every draft, rounds that reject at once and rounds cut part-way (the cache rolled back
    past accepted tokens) all occur, asserted, which is what the check over all 80 first turns exercised (~12 min;
    now `python benchmarks/lossless.py`, a measurement, not a test)."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare
    from specdraft.train.config import TrainConfig
    from specdraft.train.loop import train

    K = 3
    ds = prepare("sharegpt", str(tmp_path / "ds"), max_length=256, max_samples=48)
    shards = extract(str(ds), str(tmp_path / "x"), samples_per_shard=16, skip_doctor=True)
    final = train(str(shards), str(tmp_path / "run"), TrainConfig(draft_vocab_size=4096, ttt_steps=3, epochs=2,
                  lr=3e-3, max_tokens=2048, val_fraction=0.0, progress=False, tensorboard=False))  # fmt: skip
    rep = evaluate_report([str(final)], max_prompts=8, max_new_tokens=32, k=K, out=str(tmp_path / "eval"),
                          progress=False)  # fmt: skip
    d = rep["drafts"][str(final)]
    assert rep["settings"]["prompts"] == 8
    assert d["lossless"]["ok"], d["lossless"]["divergences"]
    hist = d["accepted_histogram"]  # rounds by accepted drafts: 0 .. K
    assert hist[0] > 0, hist  # rejected at the first draft
    assert sum(hist[1:K]) > 0, hist  # accepted some, then rejected: the caches roll back past accepted tokens
    assert d["tau"] > 1.02, "the draft accepted (almost) nothing: the check did not exercise acceptance"


def test_eval_vllm_options_are_checked_before_anything_loads():
    from specdraft.eval.command import _engine_kwargs, evaluate

    with pytest.raises(ValueError, match="vLLM options: add --engine vllm"):
        evaluate(["untrained"], tensor_parallel_size=2)
    with pytest.raises(ValueError, match="not valid JSON"):
        _engine_kwargs(1, "{max_num_seqs: 8}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        _engine_kwargs(1, "[1, 2]")
    with pytest.raises(ValueError, match="with --tensor-parallel-size"):
        _engine_kwargs(1, '{"tensor_parallel_size": 2}')
    with pytest.raises(ValueError, match="at least 1"):
        _engine_kwargs(0, "")
    assert _engine_kwargs(1, "") == {}

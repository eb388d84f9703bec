"""`specdraft eval`: prompts, the report (tau, acceptance, speed, lossless), plots, reproducibility, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import write_jsonl

from specdraft.eval.reference import (
    acceptance_stats,
    evaluate,
    evaluate_report,
    first_divergence,
    load_eval_draft,
    load_prompts,
    render_prompt,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_acceptance_stats():
    s = acceptance_stats([0, 1, 3, 3, 2], 3)
    assert s["tau"] == pytest.approx(1 + 9 / 5)
    assert s["acceptance_rate_per_position"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s["reached_per_position"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s["accepted_histogram"] == [1, 1, 1, 2]
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2 and first_divergence([1, 2], [1, 2, 3]) == 2


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


def test_eval_report_on_tiny_llama(tiny_llama_dir, questions, tmp_path):
    out = tmp_path / "ev"
    kw = dict(target=str(tiny_llama_dir), prompts=questions, turns=2, max_new_tokens=12, k=3,
              draft_vocab_size=64, out=str(out), progress=False)  # fmt: skip
    rep = evaluate_report(["untrained"], **kw)
    d = rep["drafts"]["untrained"]
    assert rep["settings"]["turns"] == 2 and len(rep["records"]) == 6
    assert d["lossless"] == {"checked": True, "ok": True, "divergences": []}
    assert len(d["acceptance_rate_per_position"]) == 3 and 1.0 <= d["tau"] <= 4.0
    assert set(d["tau_per_category"]) == {"writing", "math"}
    assert d["target_forwards"] <= rep["baseline"]["target_forwards"]
    assert rep["baseline"]["tokens_per_s"] > 0 and d["speedup"] > 0
    assert (out / "acceptance_per_position.png").stat().st_size > 1000
    assert (out / "tau_per_category.png").stat().st_size > 1000
    saved = json.loads((out / "report.json").read_text())
    assert saved["drafts"]["untrained"]["tau"] == d["tau"]
    # same settings -> same tokens and acceptance (timings aside)
    again = evaluate_report(["untrained"], **{**kw, "out": str(tmp_path / "ev2")})
    strip = lambda rep: [(r["id"], r["turn"], r["drafts"]["untrained"]["accepted"]) for r in rep["records"]]  # noqa: E731
    assert strip(again) == strip(rep)


def test_eval_sampling_and_tree_and_cli_status(tiny_llama_dir, questions, tmp_path, capsys):
    rep = evaluate_report(["untrained"], target=str(tiny_llama_dir), prompts=questions, max_prompts=2, tree=True,
                          topk=3, depth=3, budget=6, temperature=0.7, max_new_tokens=10, draft_vocab_size=64,
                          out=str(tmp_path / "s"), progress=False, seed=3)  # fmt: skip
    d = rep["drafts"]["untrained"]
    assert d["lossless"]["checked"] is False and len(d["acceptance_rate_per_position"]) == 3
    code = evaluate(["untrained"], target=str(tiny_llama_dir), prompts=questions, max_prompts=1, max_new_tokens=6,
                    draft_vocab_size=64, out=str(tmp_path / "c"), progress=False)  # fmt: skip
    assert code == 0 and "lossless yes" in capsys.readouterr().out


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
def test_lossless_on_all_mtbench_first_turns(tmp_path):
    """The full check (~10+ min on 2 CPU cores): zero divergences over the 80 first turns, with a briefly
    trained draft, so accepted drafts, rejections and cache rollbacks all happen on the real target."""
    from specdraft.capture.extract import extract
    from specdraft.data.prepare import prepare
    from specdraft.train.loop import TrainConfig, train

    ds = prepare("sharegpt", str(tmp_path / "ds"), max_length=256, max_samples=48)
    shards = extract(str(ds), str(tmp_path / "x"), samples_per_shard=16, skip_doctor=True)
    final = train(str(shards), str(tmp_path / "run"), TrainConfig(draft_vocab_size=4096, ttt_steps=3, epochs=2,
                  lr=3e-3, max_tokens=2048, val_fraction=0.0, progress=False, tensorboard=False))  # fmt: skip
    rep = evaluate_report([str(final)], max_new_tokens=32, k=3, out=str(tmp_path / "eval"), progress=False)
    d = rep["drafts"][str(final)]
    assert rep["settings"]["prompts"] == 80
    assert d["lossless"]["ok"], d["lossless"]["divergences"]
    assert d["tau"] > 1.02, "the draft accepted (almost) nothing: the check did not exercise acceptance"

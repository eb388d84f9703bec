"""The batch-1 measurement interleaved with the target alone (eval/batch1.py): the pairing of rounds, and
evaluate_vllm's order of engines, with vLLM's engine stubbed by one whose speed drifts as the run goes on."""

from __future__ import annotations

import json

import pytest

from specdraft.eval import batch1
from specdraft.eval.report import summary_lines
from specdraft.eval.serving import evaluate_vllm
from specdraft.eval.vllm_engine import Generation

K = 3
COUNTERS = {"vllm:spec_decode_num_drafts": 40, "vllm:spec_decode_num_draft_tokens": 120,
            "vllm:spec_decode_num_accepted_tokens": 24, "vllm:spec_decode_num_accepted_tokens_per_pos": [12, 8, 4]}  # fmt: skip


def _m(tps: float, new: int = 64, counters: dict | None = None, same: bool = True) -> dict:
    out = {
        "prompts": 2,
        "new_tokens": new,
        "seconds": new / tps,
        "tokens_per_s": tps,
        "same_tokens_as_batched": same,
    }
    return {**out, "counters": counters} if counters else out


def test_a_drifting_machine_slows_both_sides_of_the_speed_up():
    """The target alone slows from 20 to 14 tok/s over the run, and the draft runs at 1.1x of the target's speed
    between each pair of its measurements: every round reads x1.10, where the draft's first measurement against
    the target's first alone (one measurement per engine) reads x1.045."""
    alone = [_m(t) for t in (20, 18, 16, 14)]
    draft = [_m(1.1 * (a + b) / 2, counters=COUNTERS) for a, b in ((20, 18), (18, 16), (16, 14))]
    c = batch1.costs(draft, alone, K)
    assert c["speedup_per_round"] == pytest.approx([1.1] * 3)
    assert c["speedup"] == pytest.approx(1.1) and c["interleaved_rounds"] == 3
    assert batch1.costs(draft[:1], alone[:1], K)["speedup"] == pytest.approx(1.1 * 19 / 20)
    assert c["baseline_tokens_per_s"] == pytest.approx(17.0)  # the median of the brackets 19, 17, 15
    # the counters of the three rounds add up: 120 rounds, 72 accepted
    assert c["rounds"] == 120 and c["tau"] == pytest.approx(1 + 72 / 120)
    # a round costs its seconds over the bracket's seconds per token: round 1 is 64/20.9 s over 40 rounds
    step = (1 / 20 + 1 / 18) / 2
    assert c["round_cost_per_round"][0] == pytest.approx((64 / 20.9 / 40) / step, abs=1e-3)


def test_the_median_ignores_one_disturbed_round_and_a_changed_output_is_not_lossless():
    alone = [_m(20), _m(20), _m(20), _m(20)]
    draft = [_m(22, counters=COUNTERS), _m(8, counters=COUNTERS), _m(23, counters=COUNTERS)]
    c = batch1.costs(draft, alone, K)
    assert c["speedup"] == pytest.approx(1.1) and c["speedup_per_round"][1] == pytest.approx(0.4)
    assert c["same_tokens_as_batched"]
    draft[2]["same_tokens_as_batched"] = False
    assert not batch1.costs(draft, alone, K)["same_tokens_as_batched"]
    b = batch1.baseline(alone)
    assert b["tokens_per_s"] == 20 and len(b["measurements"]) == 4


def test_evaluate_vllm_interleaves_the_engines(tmp_path, monkeypatch, tiny_llama_dir):
    """batch1_rounds=3 with two drafts builds A D1 D2 A D1 D2 A D1 D2 A (the first three with the batched runs),
    every later engine measures batch 1 only, and each draft's speed-up is paired with the target alone around it.
    The stub's machine slows by 5% with every engine built; each draft decodes at a fixed multiple of the
    target's speed at that moment."""
    import specdraft.eval.serving as serving

    built: list[str] = []
    factor = {}

    class StubEngine:
        def __init__(self, target_dir, draft_dir, k, **kw):
            self.draft, self.load_seconds = draft_dir, 0.1
            self.speed = 20 * 0.95 ** len(built)  # the target alone's tok/s on the machine right now
            built.append("A" if draft_dir is None else factor[draft_dir][0])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        repairs: list = []  # nothing repaired in the engine's kernels

        def speculative_settings(self):  # what the engine read back: a chain of k, vLLM's defaults, V1 runner
            return {"method": "eagle3", "num_speculative_tokens": 3, "draft_sample_method": "greedy",
                    "rejection_sample_method": "standard", "model_runner": "v1"}  # fmt: skip

        def generate(self, ids, n, sequential=False, **kw):
            tps = self.speed * (factor[self.draft][1] if self.draft else 1.0)
            new = [[5, 6, 7, 8] for _ in ids]
            return Generation(new, 4 * len(ids) / tps, dict(COUNTERS) if self.draft else {}, None)

    monkeypatch.setattr(serving, "VLLMEngine", StubEngine)
    exports = []
    for name, mult in (("d1", 1.2), ("d2", 0.9)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
        factor[str(d)] = (name, mult)
        exports.append(str(d))
    rep = evaluate_vllm(exports, target=str(tiny_llama_dir), prompts=["hi", "hello", "hey"], k=K, max_new_tokens=4,
                        batch1_prompts=2, batch1_rounds=3, progress=False)  # fmt: skip
    assert built == ["A", "d1", "d2"] * 3 + ["A"]
    assert rep["settings"]["batch1_rounds"] == 3
    assert len(rep["baseline"]["batch1"]["measurements"]) == 4
    # d1 is built one engine after the A before it and two before the A after it: 1.2 * 0.95 / mean(1, 0.95**3)
    d1, d2 = rep["drafts"][exports[0]]["batch1"], rep["drafts"][exports[1]]["batch1"]
    assert d1["speedup_per_round"] == pytest.approx([1.2 * 0.95 / ((1 + 0.95**3) / 2)] * 3, rel=1e-3)
    assert d2["speedup_per_round"] == pytest.approx([0.9 * 0.95**2 / ((1 + 0.95**3) / 2)] * 3, rel=1e-3)
    assert d1["tau"] == pytest.approx(1 + 24 / 40) and d1["rounds"] == 120
    assert rep["drafts"][exports[0]]["lossless"]["ok"]
    assert any("median of 3 rounds interleaved" in line for line in summary_lines(rep))


def test_batch1_rounds_below_one_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="batch1_rounds must be >= 1"):
        evaluate_vllm([str(tmp_path)], batch1_rounds=0)

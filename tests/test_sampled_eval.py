"""Evaluation at the temperature users serve at (issue 57), without vLLM: the two-sample distribution check
(its false-alarm rate, its power against a wrong acceptance rule, both drafting methods of the reference decoder),
and the options each engine refuses, one line each with the fix, before anything loads.

The served side (vLLM at T > 0 with probabilistic drafting, read back from the engine) is in
tests/test_export_vllm.py, on its trained draft.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_speculate import BigramDrafter, BigramTarget

from specdraft.decode import speculate
from specdraft.decode.rules import accept_chain, sample
from specdraft.decode.speculate import SpecConfig, make_generator, speculative_generate, target_generate
from specdraft.eval import stats
from specdraft.eval.command import evaluate
from specdraft.eval.report import summary_lines

pytestmark = pytest.mark.usefixtures("one_thread")


def test_chi2_survival_matches_known_quantiles():
    # chi-square(1) at 3.841 and chi-square(5) at 11.07 are the 5% points; chi-square(2) is exp(-x/2)
    assert stats.chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert stats.chi2_sf(11.07, 5) == pytest.approx(0.05, abs=1e-3)
    assert stats.chi2_sf(4.0, 2) == pytest.approx(torch.exp(torch.tensor(-2.0)).item(), rel=1e-6)
    assert stats.chi2_sf(1.0, 0) == 1.0


def test_homogeneity_pools_rare_categories_and_detects_a_shift():
    same = Counter({"a": 50, "b": 30, "c": 20})
    stat, df, p = stats.homogeneity(same, same)
    assert (stat, df, p) == (pytest.approx(0.0), 2, pytest.approx(1.0))
    # rare categories (pooled count < 10) become one column: 4 rare ones -> "rest" of 8 joins the smallest kept
    a = Counter({"a": 60, "b": 40, "x": 1, "y": 1, "z": 1, "w": 1})
    b = Counter({"a": 60, "b": 40, "x": 1, "y": 1, "z": 1, "w": 1})
    assert stats.homogeneity(a, b)[1] == 1
    shifted = Counter({"a": 80, "b": 20})
    assert stats.homogeneity(Counter({"a": 50, "b": 50}), shifted)[2] < 1e-4
    assert stats.homogeneity(Counter({"a": 5}), Counter({"a": 5})) == (0.0, 0, 1.0)  # nothing to test


def test_false_alarms_stay_under_the_stated_rate():
    """Two samples of one law, 300 times over: the check fails in at most ~alpha of them (Bonferroni is
    conservative; 300 x 1% = 3 expected at most, 10 or more has probability < 1e-3)."""
    g = torch.Generator().manual_seed(0)
    law = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    alarms = 0
    for _ in range(300):
        draws = [
            torch.multinomial(law, 3 * 150, replacement=True, generator=g).view(150, 3).tolist()
            for _ in range(4)
        ]
        sides = [draws[0:2], draws[2:4]]  # 2 prompts a side, 150 samples of 3 tokens each
        alarms += not stats.compare_distributions(sides[0], sides[1], tokens=3)["ok"]
    assert alarms < 10, alarms


def _bigram_pair(seed: int = 3, Vt: int = 5):
    g = torch.Generator().manual_seed(seed)
    t_table = torch.randn(Vt, Vt, generator=g) * 1.5
    d_ids = torch.tensor([0, 1, 3, 4])  # token 2 is outside the draft vocabulary
    d_table = torch.randn(Vt, 4, generator=g) * 1.5
    return BigramTarget(t_table), BigramDrafter(d_table, d_ids)


def _check(cfg: SpecConfig, samples: int = 1500) -> dict:
    """The distribution check on the bigram stubs: speculative decoding against the target alone."""
    tgt, dr = _bigram_pair()
    prompts = [[1], [3]]

    def spec(p, s):
        return speculative_generate(tgt, dr, p, cfg, make_generator(s)).tokens

    def alone(p, s):
        return target_generate(tgt, p, cfg.max_new_tokens, cfg.temperature, (), make_generator(s)).tokens

    return stats.compare_distributions(stats.draw_samples(spec, prompts, samples, 1), stats.draw_samples(alone, prompts, samples, 10**6),
                                tokens=cfg.max_new_tokens)  # fmt: skip


@pytest.mark.parametrize("draft_sample", ["probabilistic", "greedy"])
def test_the_reference_decoder_keeps_the_distribution_with_either_drafting(draft_sample):
    check = _check(SpecConfig(k=3, temperature=0.8, max_new_tokens=4, draft_sample=draft_sample))
    assert check["ok"], check
    assert check["tests"] >= 6 and check["worst"]["p_value"] >= check["threshold"]


def _residual_bug(p, draft_tokens, q, generator=None):
    """A classic wrong rule: at a rejection, draw from p instead of norm(max(p - q, 0))."""
    k = len(draft_tokens)
    if q is None:
        return accept_chain(p, draft_tokens, q, generator)
    for j, x in enumerate(draft_tokens):
        if float(torch.rand((), generator=generator)) * float(q[j, x]) < float(p[j, x]):
            continue
        return j, sample(p[j], generator)
    return k, sample(p[k], generator)


def _always_accept(p, draft_tokens, q, generator=None):
    """A blatant wrong rule: every draft token accepted."""
    return len(draft_tokens), sample(p[len(draft_tokens)], generator)


@pytest.mark.parametrize("wrong", [_residual_bug, _always_accept])
def test_the_check_fails_on_a_decoder_with_a_wrong_acceptance_rule(monkeypatch, wrong):
    monkeypatch.setattr(speculate, "accept_chain", wrong)
    check = _check(SpecConfig(k=3, temperature=0.8, max_new_tokens=4, draft_sample="probabilistic"))
    assert not check["ok"], check
    assert check["worst"]["p_value"] < check["threshold"]
    line = stats.distribution_summary(check)
    assert "NOT KEPT" in line and "false alarms <= 1%" in line


def test_greedy_drafting_at_temperature_accepts_with_the_targets_probability():
    """Greedy drafting proposes the draft's argmax; at T > 0 the rule accepts it with p(d) exactly."""
    tgt, dr = _bigram_pair()
    cfg = SpecConfig(k=1, temperature=1.0, max_new_tokens=2, draft_sample="greedy")
    root = 1
    g = make_generator(0)
    first, acc = Counter(), 0
    n = 3000
    for _ in range(n):
        r = speculative_generate(tgt, dr, [root], cfg, g)
        first[r.tokens[0]] += 1
        acc += r.accepted[0] if r.accepted else 0
    # the round after the first token drafts argmax of the draft at that token; accepted w.p. p(argmax)
    p = torch.softmax(tgt.table, -1)
    d_arg = dr.target_ids[dr.table.argmax(-1)]  # (V,) the draft's proposal after each token
    expect = sum(first[x] / n * float(p[x, d_arg[x]]) for x in first)
    assert acc / n == pytest.approx(expect, abs=0.03)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"engine": "vllm", "tree": True}, "--tree: options of the reference decoder"),
        (
            {"engine": "vllm", "budget": 64, "counts": "x"},
            "--budget, --counts: options of the reference decoder",
        ),
        ({"engine": "vllm", "threads": 1}, "--threads"),
        ({"engine": "vllm", "temperature": 0.7, "verify": "block"}, "drop --verify block here"),
        ({"engine": "hf", "top_p": 0.9, "temperature": 0.7}, "--top-p: vLLM only"),
        ({"engine": "hf", "verify": "block"}, "--verify block: vLLM only"),
        (
            {"engine": "hf", "tree": True, "draft_sample": "probabilistic"},
            "drop one of --tree and --draft-sample",
        ),
        ({"dist_samples": 100}, "--dist-samples checks sampled output (T > 0)"),
        ({"temperature": -1.0}, "--temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "--temperature must be a finite number >= 0"),
        ({"temperature": 0.7, "reference": True, "engine": "vllm"}, "drop --reference or --temperature"),
    ],
)
def test_options_the_engine_would_drop_are_refused_in_one_line(tmp_path, kwargs, words):
    if kwargs.get("engine") == "vllm" and kwargs.get("verify") == "block":
        pytest.importorskip("vllm")
    with pytest.raises(ValueError) as e:
        evaluate(["untrained"], out=str(tmp_path / "ev"), **kwargs)
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg
    assert not (tmp_path / "ev").exists()  # refused before anything was written


def test_summary_says_na_at_temperature_and_gives_the_check():
    check = {"ok": True, "alpha": 0.01, "tests": 24, "threshold": 0.01 / 24, "samples_per_side": [200] * 4,
             "tokens": 6, "worst": {"prompt": 1, "prefix_tokens": 3, "p_value": 0.04, "chi2": 9.1, "df": 3}}  # fmt: skip
    d = {"format": "speculators", "tau": 1.3, "acceptance_rate_per_position": [0.3, 0.2, 0.1], "tokens_per_s": 5.0,
         "speedup": 1.1, "lossless": {"checked": False, "ok": None, "divergences": []}, "distribution": check}  # fmt: skip
    rep = {"engine": "vllm", "vllm_version": "0.32.0", "baseline": {"new_tokens": 10, "tokens_per_s": 4.0},
           "settings": {"k": 3, "temperature": 0.7, "top_p": 1.0, "draft_sample": "probabilistic", "verify": "standard"},
           "drafts": {"x": d}}  # fmt: skip
    lines = summary_lines(rep)
    assert "T=0.7, probabilistic drafting, standard verification" in lines[0]
    assert "lossless n/a (T>0)" in lines[1]
    assert "target's distribution kept: 24 chi-square tests of 200 samples a side" in lines[2]

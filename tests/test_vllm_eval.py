"""`eval --engine vllm` pieces that need no vLLM: prompts, statistics, the parity replay, argument errors.

The served round trip and the parity against the draft vLLM loads are in tests/test_export_vllm.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specdraft.eval.reference import Prompt, acceptance_stats, render_prompt
from specdraft.eval.vllm import (
    _diff_counters,
    _render,
    collect_prompts,
    compare_with_reference,
    counter_stats,
    drafter_parity,
    evaluate_vllm,
    export_format,
    stop_ids_for,
)
from specdraft.model.draft import DraftConfig, DraftKVCache, Eagle3Draft


def test_counter_stats_use_the_reference_definitions():
    # 5 rounds accepting [0, 1, 3, 3, 2] of k=3: per_pos counts rounds reaching position i
    counters = {
        "vllm:spec_decode_num_drafts": 5,
        "vllm:spec_decode_num_draft_tokens": 15,
        "vllm:spec_decode_num_accepted_tokens": 9,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [4, 3, 2],
    }
    s = counter_stats(counters, 3)
    ref = acceptance_stats([0, 1, 3, 3, 2], 3)
    assert s["tau"] == pytest.approx(ref["tau"])
    assert s["acceptance_rate_per_position"] == pytest.approx(ref["acceptance_rate_per_position"])
    assert s["reached_per_position"] == pytest.approx(ref["reached_per_position"])
    assert s["acceptance_rate"] == pytest.approx(9 / 15)
    empty = counter_stats({}, 2)
    assert empty["tau"] == 1.0 and empty["acceptance_rate_per_position"] == [None, None]


def test_counter_snapshots_are_differenced():
    before = {"vllm:spec_decode_num_drafts": 3, "vllm:spec_decode_num_accepted_tokens_per_pos": [2, 1]}
    after = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens_per_pos": [5, 1, 1]}
    d = _diff_counters(after, before)
    assert d == {"vllm:spec_decode_num_drafts": 7, "vllm:spec_decode_num_accepted_tokens_per_pos": [3, 0, 1]}


def test_prompts_render_exactly_like_the_reference(chatml_tokenizer):
    tok = chatml_tokenizer
    ps = collect_prompts(["Hello there", [5, 6, 7], [{"role": "user", "content": "Hi"}]])
    assert [p.id for p in ps] == ["0", "1", "2"]
    assert _render(tok, ps[0], 0, []) == render_prompt(tok, ["Hello there"], [])
    assert _render(tok, ps[1], 0, []) == [5, 6, 7]
    assert _render(tok, ps[2], 0, []) == render_prompt(tok, ["Hi"], [])
    two = collect_prompts([Prompt("q", "math", ["a b", "c d"])])[0]
    assert _render(tok, two, 1, ["answer"]) == render_prompt(tok, ["a b", "c d"], ["answer"])
    mt = collect_prompts("mtbench", max_prompts=3)
    assert [p.id for p in mt] == ["81", "91", "101"] and len(mt[0].turns) == 2
    with pytest.raises(ValueError, match="token-id list"):
        collect_prompts([{"nope": 1}])
    with pytest.raises(ValueError, match="no prompts"):
        collect_prompts([])


def test_stop_ids_like_the_reference(tmp_path, chatml_tokenizer):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    eos = chatml_tokenizer.eos_token_id
    assert stop_ids_for(str(tmp_path), chatml_tokenizer) == tuple(sorted({eos, 7, 9}))


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


def test_parity_replay_reproduces_the_draft_and_catches_a_flipped_norm():
    draft = _tiny_draft()
    capture = _vllm_like_events(draft)
    same = drafter_parity(copy.deepcopy(draft), capture)
    assert same["first_passes"] == 2 and same["chain_steps"] == 4 and same["logit_rows"] == 6
    assert max(same["max_abs_diff"].values()) < 1e-5 and same["top1_agreement"] == 1.0 and same["d2t_equal"]
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

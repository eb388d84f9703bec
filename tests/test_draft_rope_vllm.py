"""The draft's RoPE is what vLLM computes for it: yarn with mscale / mscale_all_dim / attention_factor.

vLLM serves an EAGLE-3 draft as a Llama layer, whose rotary embedding comes from vLLM's `get_rope` with the
draft config's `rope_parameters`; the draft computes its own (transformers' rope init functions). A
DeepSeek-V3 / Kimi-K2.5 target hands its yarn settings to the draft, so both must agree on them.
"""

from __future__ import annotations

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

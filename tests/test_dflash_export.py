"""DFlash files: save/load is exact, and the served formats load into vLLM's own config classes."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.model.dflash import DFlashConfig, DFlashDraft
from specdraft.model.dflash_files import (
    is_dflash_dir,
    load_dflash,
    mask_embedding_file,
    save_dflash,
    served_files,
    served_problems,
    write_served,
)


def _draft(**kw) -> DFlashDraft:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                draft_vocab_size=40, num_hidden_layers=2, block_size=6, aux_layer_ids=[1, 3, 5, 7],
                mask_token_id=7, target_num_layers=8)  # fmt: skip
    torch.manual_seed(0)
    d = DFlashDraft(DFlashConfig(**{**base, **kw}))
    with torch.no_grad():
        d.mask_embedding.normal_()
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def test_save_load_is_exact(tmp_path):
    d = _draft()
    save_dflash(d, tmp_path / "d", extra={"train": {"steps": 3}})
    assert is_dflash_dir(tmp_path / "d") and not is_dflash_dir(tmp_path)
    e = load_dflash(tmp_path / "d")
    assert e.cfg == d.cfg
    for (k, a), (k2, b) in zip(d.state_dict().items(), e.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    aux = torch.randn(1, 9, 4 * 32)
    ids, is_mask = torch.tensor([[3] + [0] * 5]), torch.arange(6)[None] > 0
    outs = [m(ids, is_mask, torch.arange(9, 15)[None], m.context_kv(m.context(aux), torch.arange(9)[None]), None)
            for m in (d.eval(), e.eval())]  # fmt: skip
    assert torch.equal(outs[0], outs[1])


# the parameter names vLLM 0.32's DFlashQwen3ForCausalLM loads (qwen3_dflash.py, after its stacking map)
def _vllm_names(n_layers: int, d2t: bool) -> set[str]:
    per = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
           "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
           "post_attention_layernorm"]  # fmt: skip
    names = {f"layers.{i}.{p}.weight" for i in range(n_layers) for p in per}
    names |= {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight"}
    return names | ({"d2t"} if d2t else set())


def test_speculators_export_loads_into_vllm_config(tmp_path):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    d = _draft()
    config, state, mask = served_files(d, "speculators", "Qwen/Qwen3-8B", ["Qwen3ForCausalLM"])
    assert set(state) == _vllm_names(2, d2t=True)
    assert state["fc.weight"].shape == (32, 4 * 32) and state["lm_head.weight"].shape == (40, 32)
    names = write_served(tmp_path / "out", config, state, mask_embedding_file(d.cfg, mask))
    assert names == ["config.json", "model.safetensors", "mask_embedding.pt"]
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert SpeculatorsConfig.build_vllm_speculative_config(raw) == {
        "method": "dflash",
        "num_speculative_tokens": 5,
    }
    SpeculatorsConfig.validate_speculators_config(raw)
    hf = SpeculatorsConfig.from_pretrained(str(tmp_path / "out"))
    assert hf.architectures == ["DFlashDraftModel"]
    assert hf.dflash_config["target_layer_ids"] == [0, 2, 4, 6]  # outputs of layers id - 1
    assert hf.eagle_aux_hidden_state_layer_ids == [1, 3, 5, 7] and hf.dflash_config["mask_token_id"] == 7
    assert hf.dflash_config["causal"] is False and hf.dflash_config["sample_from_anchor"] is False
    assert (hf.num_hidden_layers, hf.hidden_size, hf.draft_vocab_size) == (2, 32, 40)
    m = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)  # as vLLM reads it
    assert m["mask_token_id"] == 7 and torch.equal(
        m["embedding"], d.mask_embedding.detach().to(torch.bfloat16)
    )


def test_speculators_full_vocab_has_no_d2t_and_no_mask_file_untrained():
    d = _draft(draft_vocab_size=50, train_mask_embedding=False)
    _, state, mask = served_files(d, "speculators", "t")
    assert set(state) == _vllm_names(2, d2t=False) and mask is None


def test_sglang_export_keys():
    d = _draft(draft_vocab_size=50, train_mask_embedding=False)
    config, state, mask = served_files(d, "sglang", "t")
    assert mask is None and "lm_head.weight" not in state and not any(k.startswith("embed") for k in state)
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 6
    assert config["dflash_config"] == {"target_layer_ids": [0, 2, 4, 6], "mask_token_id": 7}
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 8
    assert all(0 <= i < config["num_target_layers"] for i in config["dflash_config"]["target_layer_ids"])


def test_refusals():
    assert len(served_problems(_draft().cfg, "sglang")) == 2  # reduced vocabulary, trained mask embedding
    assert served_problems(_draft(aux_layer_ids=[0, 3]).cfg, "speculators")
    with pytest.raises(ValueError, match="mask_token_id"):
        served_files(_draft(draft_vocab_size=50), "sglang", "t")

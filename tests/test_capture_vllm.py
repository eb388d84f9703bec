"""vLLM hook capture equals transformers' output_hidden_states, in-process and with worker processes."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_vllm

from specdraft.capture.vllm import decoder_layers, split_to_prompts

L = 4
LAYER_IDS = [0, 1, 2, L]  # id L = last layer output before the final norm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random fp32 Llama saved as an HF dir (no tokenizer: vLLM runs with skip_tokenizer_init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,  # head_dim 64: vLLM's CPU attention supports only some head sizes
        intermediate_size=256,
        num_hidden_layers=L,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    d = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    lens = [5, 17, 17, 3, 64, 1, 33, 17, 9, 120]
    ps = [torch.randint(1, 512, (n,), generator=g).tolist() for n in lens]
    ps += [ps[1], ps[4], ps[0][:3]]  # duplicates and a prefix of another prompt
    return ps


def _hf_reference(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            hs = m(torch.tensor([p]), output_hidden_states=True).hidden_states
            out.append(torch.stack([hs[i][0] for i in LAYER_IDS], dim=1))
    return out, m.model.norm


def _max_diff(ours: list[torch.Tensor], ref: list[torch.Tensor], norm) -> float:
    worst = 0.0
    with torch.no_grad():
        for o, r in zip(ours, ref):
            assert o.shape == r.shape, (o.shape, r.shape)
            # HF hidden_states[L] is AFTER the final norm; our id L is before it
            o = o.clone()
            o[:, -1] = norm(o[:, -1])
            worst = max(worst, (o - r).abs().max().item())
    return worst


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("multiproc", ["0", "1"], ids=["in_process", "worker_processes"])
def test_vllm_capture_matches_transformers(tiny, prompts, multiproc, monkeypatch):
    from specdraft.capture.vllm import VLLMCapture

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiproc)
    ref, norm = _hf_reference(tiny, prompts)
    # the longest prompt is exactly max_model_len tokens: the boundary is accepted
    cap = VLLMCapture(tiny, LAYER_IDS, dtype="float32", max_model_len=max(len(p) for p in prompts))
    try:
        assert cap.num_layers == L
        ours = cap.run(prompts)
        assert [o.shape[0] for o in ours] == [len(p) for p in prompts]
        diff = _max_diff(ours, ref, norm)
        print(f"max abs diff vs transformers ({'mp' if multiproc == '1' else 'inproc'}): {diff:.2e}")
        assert diff < 1e-4
        # a second batch in another order gives the same values (hooks stay installed, state is popped)
        again = cap.run(list(reversed(prompts)))
        assert max((a - b).abs().max().item() for a, b in zip(reversed(again), ours)) < 1e-5
    finally:
        cap.close()


def test_split_maps_rows_to_prompts_without_an_engine():
    """Pure mapping logic: reordered, batched and chunked forward calls map back to prompts exactly."""
    prompts = [[1, 2, 3], [4, 5, 6, 7], [1, 2, 3], [9]]

    def rows(ids):
        return torch.tensor(ids, dtype=torch.float32)[:, None, None].repeat(1, 2, 3)

    calls = [
        # prompt 1 first chunk + prompt 3 whole; engine order differs from input order
        {
            "input_ids": torch.tensor([4, 5, 9]),
            "positions": torch.tensor([0, 1, 0]),
            "hidden": rows([4, 5, 9]),
        },
        {
            "input_ids": torch.tensor([6, 7, 1, 2, 3]),
            "positions": torch.tensor([2, 3, 0, 1, 2]),
            "hidden": rows([6, 7, 1, 2, 3]),
        },
    ]
    out = split_to_prompts(calls, prompts)
    assert [o[:, 0, 0].tolist() for o in out] == [[1, 2, 3], [4, 5, 6, 7], [1, 2, 3], [9]]
    # duplicates are separate tensors: a shard can hold both (safetensors refuses shared memory)
    assert out[0].untyped_storage().data_ptr() != out[2].untyped_storage().data_ptr()


def test_split_refuses_a_missing_prompt():
    calls = [
        {"input_ids": torch.tensor([1, 2]), "positions": torch.tensor([0, 1]), "hidden": torch.zeros(2, 1, 1)}
    ]
    with pytest.raises(RuntimeError, match="not captured whole"):
        split_to_prompts(calls, [[1, 2, 3]])


def test_extract_mode_is_gated_to_gpus():
    if torch.cuda.is_available():
        pytest.skip("GPU present: the gate does not apply")
    from specdraft.capture.vllm import VLLMCapture

    with pytest.raises(RuntimeError, match="CUDA build"):
        VLLMCapture("unused", [0], mode="extract_hidden_states")


def test_decoder_layers_of_vllm_shaped_models():
    """vLLM keeps transformers' layout, so the layer search is `targets.find_layout`: a causal LM's
    `model.layers`, a multimodal wrapper's `language_model.model.layers`; nothing found is a RuntimeError
    that points at doctor."""
    from torch import nn

    def backbone(n):
        b = nn.Module()
        b.layers, b.norm = nn.ModuleList(nn.Linear(2, 2) for _ in range(n)), nn.LayerNorm(2)
        return b

    causal = nn.Module()
    causal.model = backbone(3)
    assert decoder_layers(causal) is causal.model.layers
    wrapper, lm = nn.Module(), nn.Module()
    lm.model = backbone(2)
    wrapper.language_model, wrapper.vision_tower = lm, nn.Linear(2, 2)
    assert decoder_layers(wrapper) is lm.model.layers
    with pytest.raises(RuntimeError, match="cannot find the decoder stack.*specdraft doctor"):
        decoder_layers(nn.Linear(2, 2))

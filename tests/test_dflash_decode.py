"""Reference decoding with a DFlash draft: a copying draft is accepted in full, a random one is lossless."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, tiny_config

from specdraft.decode.block import BlockSpeculator
from specdraft.decode.speculate import SpecConfig
from specdraft.model.dflash import DFlashConfig, DFlashDraft
from specdraft.targets import wrap_model


def _repeat_target():
    """A tiny Llama whose greedy next token is its current token: the attention and MLP outputs are zero,
    embeddings and LM head are the identity (V = H = 64), so logits = norm(onehot(x))."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tiny_config("llama", vocab_size=64)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(64))
        model.lm_head.weight.copy_(torch.eye(64))
    return wrap_model(model, "repeat")


def _copy_draft(block_size: int) -> DFlashDraft:
    """A DFlash draft that proposes its anchor in every slot: context features and mask slots carry no value
    (fc = 0, mask embedding = 0), queries are zero (uniform attention), so each mask slot's output is the
    anchor's value scaled down, which the final norm and the identity head read back as the anchor."""
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                       vocab_size=64, draft_vocab_size=64, block_size=block_size, aux_layer_ids=[1, 3, 5],
                       mask_token_id=0, target_num_layers=8)  # fmt: skip
    d = DFlashDraft(cfg).eval()
    with torch.no_grad():
        d.embed_tokens.weight.copy_(torch.eye(64))
        d.fc.weight.zero_()
        d.mask_embedding.zero_()
        layer = d.layers[0]
        layer.self_attn.q_proj.weight.zero_()
        layer.self_attn.v_proj.weight.copy_(torch.eye(64))
        layer.self_attn.o_proj.weight.copy_(torch.eye(64))
        layer.mlp.down_proj.weight.zero_()
        d.lm_head.weight.copy_(torch.eye(64))
    return d


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_copying_draft_is_accepted_in_full(temperature):
    target = _repeat_target()
    spec = BlockSpeculator(target, _copy_draft(block_size=5))
    cfg = SpecConfig(max_new_tokens=21, temperature=temperature)
    prompt = [3, 9, 12, 40]
    r = spec.generate(prompt, cfg)
    if temperature == 0:
        assert r.tokens == spec.baseline(prompt, cfg).tokens == [40] * 21
        assert r.accepted == [4] * 4 and r.drafted == [4] * 4 and r.tau == 5.0  # 1 + 4 rounds of 5 tokens
    else:  # the target is nearly flat at T = 1 (logits 0..8), so only check the rule runs and keeps counts
        assert len(r.tokens) == 21 and all(0 <= a <= 4 for a in r.accepted)
    spec.close()


def test_random_draft_is_lossless_greedy():
    target = wrap_model(build_tiny_model("llama"), "tiny-llama")
    torch.manual_seed(3)
    cfg = DFlashConfig.from_target(target.model.config, [1, 3, 5, 7], draft_vocab_size=320, block_size=4,
                                   num_hidden_layers=2, mask_token_id=5)  # fmt: skip
    draft = DFlashDraft(cfg)
    model = target.model
    draft.init_from_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    spec = BlockSpeculator(target, draft)
    sc = SpecConfig(max_new_tokens=24)
    for prompt in ([1, 2, 3], [17, 250, 4, 4, 90, 11]):
        r = spec.generate(prompt, sc)
        assert r.tokens == spec.baseline(prompt, sc).tokens
        assert sum(r.accepted) + r.rounds >= len(r.tokens) - 1 and set(r.drafted) == {3}
    spec.close()


def test_rejects_another_target():
    target = wrap_model(build_tiny_model("llama"), "tiny-llama")
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=320, aux_layer_ids=[1, 2])  # fmt: skip
    with pytest.raises(ValueError, match="another target"):
        BlockSpeculator(target, DFlashDraft(cfg))


class _BlockStub:
    """A DFlashDrafter stand-in: slot j's logits are table[anchor] + j * shift (a block drafted at once)."""

    def __init__(self, table, target_ids, block_size):
        from types import SimpleNamespace

        self.table, self.target_ids, self.n = table.float(), target_ids, 0
        self.draft = SimpleNamespace(cfg=SimpleNamespace(block_size=block_size))
        self.shift = torch.linspace(-1, 1, table.shape[1])

    def reset(self):
        self.n = 0

    def __len__(self):
        return self.n

    def extend(self, aux, positions):
        assert positions.tolist() == list(range(self.n, self.n + aux.shape[0]))
        self.n += aux.shape[0]

    def propose(self, anchor, position, k):
        assert position == self.n  # the anchor sits right after the context
        return torch.stack([self.table[anchor] + j * self.shift for j in range(k)])  # (k, Vd)


def test_sampled_block_decoding_keeps_the_target_distribution():
    """The joint law of the first 3 new tokens of sampled block decoding equals the target's."""
    from collections import Counter

    from test_speculate import BigramTarget, chi2_critical

    from specdraft.decode.block import block_generate
    from specdraft.decode.speculate import make_generator

    Vt, temp, N = 4, 0.8, 2000
    g = torch.Generator().manual_seed(5)
    t_table = torch.randn(Vt, Vt, generator=g) * 1.2
    d_ids = torch.tensor([0, 1, 3])  # token 2 is outside the draft vocabulary
    d_table = torch.randn(Vt, 3, generator=g) * 1.2
    P = torch.softmax(t_table / temp, -1)
    exact = {
        (a, b, c): float(P[1, a] * P[a, b] * P[b, c]) for a in range(Vt) for b in range(Vt) for c in range(Vt)
    }
    cfg = SpecConfig(k=3, temperature=temp, max_new_tokens=3)
    gen = make_generator(11)
    counts = Counter(
        tuple(block_generate(BigramTarget(t_table), _BlockStub(d_table, d_ids, 3), [1], cfg, gen).tokens)
        for _ in range(N)
    )
    cells = [c for c in exact if exact[c] * N >= 5]
    rest_e = N * sum(exact[c] for c in exact if c not in cells)
    rest_o = sum(v for c, v in counts.items() if c not in cells)
    chi2 = sum((counts[c] - N * exact[c]) ** 2 / (N * exact[c]) for c in cells)
    chi2 += (rest_o - rest_e) ** 2 / rest_e if rest_e > 0 else 0.0
    assert chi2 < chi2_critical(len(cells)), (chi2, len(cells))
    assert 0.5 * sum(abs(counts[c] / N - exact[c]) for c in exact) < 0.1


def test_shorter_block_than_trained():
    target = _repeat_target()
    spec = BlockSpeculator(target, _copy_draft(block_size=5))
    r = spec.generate([3, 9, 12, 40], SpecConfig(k=2, max_new_tokens=9))
    assert r.tokens == [40] * 9 and r.drafted == [2] * 3 and r.accepted == [2] * 3
    spec.close()

"""Parity: captured hidden states equal transformers' output_hidden_states at the same ids."""

import pytest
import torch
from conftest import ARCHS, build_tiny_model

from specdraft.capture.hf import HFCapture
from specdraft.targets import capture_layer_ids, default_aux_layer_ids, find_layout, wrap_model

SEQS = [[5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [12, 13, 14], [20, 21, 22, 23, 24, 25], [30]]


def reference(target, seq, ids):
    """HF's own hidden states for one sequence alone; id L compared after the final norm (HF convention)."""
    out = target.backbone(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    return out


def check_parity(target, seqs, atol=1e-5):
    L = target.num_layers
    ids = [0, 2, L - 1, L]
    batched = HFCapture(target, ids).run(seqs)
    for seq, h in zip(seqs, batched):
        assert h.shape == (len(seq), len(ids), target.hidden_size)  # (T, n_layers, H)
        alone = HFCapture(target, ids).run([seq])[0]
        torch.testing.assert_close(h, alone, atol=atol, rtol=1e-4)  # padding/batching changes nothing
        ref = reference(target, seq, ids)
        for j, i in enumerate(ids[:-1]):
            torch.testing.assert_close(h[:, j], ref[i][0], atol=atol, rtol=1e-4)
        # our id L is before the final norm; HF's hidden_states[L] is after it
        torch.testing.assert_close(target.norm(h[:, -1]), ref[L][0], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_tiny_architectures(arch):
    target = wrap_model(build_tiny_model(arch))
    check_parity(target, SEQS)


@pytest.mark.real
def test_parity_embedded_default(real_target):
    tok = real_target.tokenizer
    texts = ["The capital of France is Paris, and", "def fib(n):\n    return n", "Hi"]
    seqs = [tok(t)["input_ids"] for t in texts]
    check_parity(real_target, seqs, atol=2e-4)


def test_layer_ids_convention():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert capture_layer_ids(30) == [2, 15, 27, 30]
    assert capture_layer_ids(30, [27, 2, 15]) == [2, 15, 27, 30]
    with pytest.raises(ValueError, match="too shallow"):
        default_aux_layer_ids(4)
    with pytest.raises(ValueError, match="distinct"):
        capture_layer_ids(30, [2, 2, 5])
    with pytest.raises(ValueError, match="in \\[0, 29\\]"):
        capture_layer_ids(30, [2, 5, 30])


def test_unknown_layout_names_what_it_found():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="cannot find the decoder stack of Odd.*stack"):
        find_layout(Odd())

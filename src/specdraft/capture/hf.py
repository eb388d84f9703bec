"""Hidden-state capture from a transformers target with forward hooks on the chosen layers only.

Ids follow the convention of `specdraft.targets`: id k < L is the input of decoder layer k (a forward
pre-hook on layers[k]), id L is the output of layers[L-1] before the final norm (a forward hook).
The backbone (no lm_head) runs one prefill; nothing of vocabulary size is computed.

Batches are right-padded: with causal attention a real token never attends to a padded position, and
position ids count from 0 for every row, so each row's values equal those of the sequence run alone
(up to float noise of batched matmuls).
"""

from __future__ import annotations

import torch

from specdraft.targets import Target, layer_hidden


class HFCapture:
    """Capture the hidden states at `layer_ids` of a transformers target for batches of token ids."""

    def __init__(self, target: Target, layer_ids: list[int], pad_id: int = 0):
        L = target.num_layers
        bad = [i for i in layer_ids if not 0 <= i <= L]
        if bad:
            raise ValueError(f"layer ids {bad} out of range [0, {L}] for this {L}-layer target")
        self.target = target
        self.layer_ids = list(layer_ids)
        self.pad_id = pad_id
        self._slots: dict[int, torch.Tensor] = {}

    def _hooks(self):
        handles = []
        layers = self.target.layers
        for i in self.layer_ids:
            if i < len(layers):

                def pre(mod, args, kwargs, i=i):
                    self._slots[i] = layer_hidden(args, kwargs)

                handles.append(layers[i].register_forward_pre_hook(pre, with_kwargs=True))
            else:

                def post(mod, args, out, i=i):
                    self._slots[i] = layer_hidden(None, None, out)

                handles.append(layers[-1].register_forward_hook(post))
        return handles

    @torch.inference_mode()
    def run(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states per sequence: a list of (T_i, n_layers, H) tensors on the target's device."""
        assert batch, "empty batch"
        device = self.target.device
        T = max(len(s) for s in batch)
        ids = torch.full((len(batch), T), self.pad_id, dtype=torch.long, device=device)  # (B, T)
        att = torch.zeros((len(batch), T), dtype=torch.long, device=device)  # (B, T)
        for b, s in enumerate(batch):
            ids[b, : len(s)] = torch.as_tensor(s, device=device)
            att[b, : len(s)] = 1
        handles = self._hooks()
        try:
            self.target.backbone(input_ids=ids, attention_mask=att, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        missing = [i for i in self.layer_ids if i not in self._slots]
        assert not missing, f"hooks did not fire for layer ids {missing}"
        stacked = torch.stack([self._slots[i] for i in self.layer_ids], dim=2)  # (B, T, n_layers, H)
        self._slots.clear()
        return [stacked[b, : len(s)] for b, s in enumerate(batch)]  # each (T_b, n_layers, H)

"""The two models of speculative decoding behind small interfaces, each with its own KV cache.

`TargetRunner` is a causal LM over the accepted tokens x_0 .. x_{n-2} that verifies drafted tokens in one
forward (a tree mask for trees) and hands back the aux features of the draft's `fc` input; `Drafter` is a
draft over (target feature, next token) pairs that proposes tokens. `HFTargetRunner` and `EagleDrafter`
implement them for a transformers target and our `Eagle3Draft`; tests substitute stubs with fixed logits.
The round that drives them is `specdraft.decode.speculate`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdraft.model.draft import DraftKVCache, Eagle3Draft, draft_to_target_ids


class TargetRunner(Protocol):
    """A causal LM with a KV cache over the accepted tokens x_0 .. x_{n-2}."""

    def reset(self) -> None: ...

    def __len__(self) -> int: ...  # cached positions

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions (T,); tree_mask bool (T, T) among the new tokens, or (T, S_past + T) over the cache
        too (None = causal), True = attend -> fp32 logits
        (T, V) or (1, V) with last_only, and the aux features (T, A) of the new tokens (None if not captured).
        The new tokens are appended to the cache."""
        ...

    def keep(self, n_past: int, index: torch.Tensor) -> None:
        """Keep cached positions [0, n_past) and n_past + index (in that order); drop the rest."""
        ...


class Drafter(Protocol):
    """A draft with its own KV cache over (feature, next token) pairs."""

    target_ids: torch.Tensor  # (Vd,) target id of each draft-vocabulary index

    def reset(self) -> None: ...

    def __len__(self) -> int: ...

    def extend(
        self, aux: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs (target features aux (m, A), next tokens ids (m,)) causally -> the last position's
        hidden_out (H,) and draft logits (Vd,)."""
        ...

    def step(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed K draft tokens ids (K,) with hidden inputs (K, H) at positions (K,); mask bool
        (K, len(self) + K) True = attend (None = causal) -> hidden_out (K, H), logits (K, Vd)."""
        ...

    def crop(self, n: int) -> None: ...


class HFTargetRunner:
    """A transformers causal LM (`specdraft.targets.Target`) with a DynamicCache and hooks on its aux layers.

    aux features = cat of the hidden states ENTERING decoder layers `aux_layer_ids` (ascending), the inputs
    the draft's `fc` was trained on. Tree verification passes a 4D additive float mask (B, 1, T, S_past + T),
    which transformers uses as-is (eager and sdpa attention); `tests/test_speculate.py` checks it reproduces
    each branch run alone.
    """

    def __init__(self, target, aux_layer_ids: list[int] | None):
        from transformers import DynamicCache

        self.target = target
        self.model = target.model
        self._cache_cls = DynamicCache
        self.aux_layer_ids = sorted(aux_layer_ids) if aux_layer_ids else []
        bad = [i for i in self.aux_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(
                f"aux layer ids {bad} are outside this {target.num_layers}-layer target: the draft was trained "
                "for another target; pass the target it was trained on (see the draft's config.json)"
            )
        self._slots: dict[int, torch.Tensor] = {}
        self._handles = []
        from specdraft.targets import layer_hidden

        for i in self.aux_layer_ids:

            def pre(mod, args, kwargs, i=i):
                self._slots[i] = layer_hidden(args, kwargs)

            self._handles.append(target.layers[i].register_forward_pre_hook(pre, with_kwargs=True))
        self.cache = DynamicCache()
        self._dtype = next(self.model.parameters()).dtype

    def close(self) -> None:
        """Remove the hooks from the target."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def reset(self) -> None:
        self.cache = self._cache_cls()

    def __len__(self) -> int:
        return int(self.cache.get_seq_length())

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.target.device
        T = ids.shape[0]
        past = len(self)
        mask = None
        if tree_mask is not None:
            full = tree_mask.to(device)
            if full.shape == (T, T):  # among the new tokens; every new token sees the whole cache
                full = torch.cat(
                    [torch.ones(T, past, dtype=torch.bool, device=device), full], dim=1
                )  # (T, past + T)
            assert full.shape == (T, past + T), (
                f"tree mask {tuple(tree_mask.shape)} is neither ({T}, {T}) nor ({T}, {past + T})"
            )
            mask = torch.zeros(full.shape, dtype=self._dtype, device=device)  # (T, past + T)
            mask.masked_fill_(~full, torch.finfo(self._dtype).min)
            mask = mask[None, None]  # (1, 1, T, past + T)
        self._slots.clear()
        out = self.model(
            input_ids=ids.to(device)[None],  # (1, T)
            position_ids=positions.to(device)[None],  # (1, T)
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        assert len(self) == past + T, f"the cache grew to {len(self)}, expected {past + T}"
        logits = out.logits[0].float()  # (T or 1, V)
        aux = None
        if self.aux_layer_ids:
            missing = [i for i in self.aux_layer_ids if i not in self._slots]
            assert not missing, f"aux hooks did not fire for layers {missing}"
            aux = torch.cat([self._slots[i][0] for i in self.aux_layer_ids], dim=-1)  # (T, 3H)
            self._slots.clear()
        return logits, aux

    def keep(self, n_past: int, index: torch.Tensor) -> None:
        total = len(self)
        index = index.to(self.target.device)
        prefix = bool(torch.equal(index, torch.arange(index.numel(), device=index.device)))
        keep = torch.cat([torch.arange(n_past, device=index.device), n_past + index])  # (n_past + a,)
        layers = getattr(self.cache, "layers", None)
        if layers is None:  # transformers < 4.56: key_cache / value_cache lists
            for i in range(len(self.cache.key_cache)):
                self.cache.key_cache[i] = self.cache.key_cache[i].index_select(-2, keep)
                self.cache.value_cache[i] = self.cache.value_cache[i].index_select(-2, keep)
            return
        for layer in layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            if layer.keys.shape[-2] != total:
                raise ValueError(
                    f"the target's KV cache layer {type(layer).__name__} holds {layer.keys.shape[-2]} of {total} "
                    "positions (sliding window?): the reference decoder needs full-attention layers"
                )
            if prefix:
                n = n_past + index.numel()
                layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
            else:
                layer.keys = layer.keys.index_select(-2, keep)  # (B, kvh, n_past + a, d)
                layer.values = layer.values.index_select(-2, keep)  # (B, kvh, n_past + a, d)


class EagleDrafter:
    """An `Eagle3Draft` with its `DraftKVCache`, as a `Drafter`."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft.eval()
        self.cache = DraftKVCache()
        self.target_ids = draft_to_target_ids(draft.d2t)  # (Vd,)
        p = next(draft.parameters())
        self.device, self.dtype = p.device, p.dtype

    def reset(self) -> None:
        self.cache = DraftKVCache()

    def __len__(self) -> int:
        return len(self.cache)

    def crop(self, n: int) -> None:
        self.cache.crop(n)

    @torch.inference_mode()
    def extend(
        self, aux: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.draft
        h = d.fuse(aux.to(self.device, self.dtype)[None])  # (1, m, H)
        out, _ = d(ids.to(self.device)[None], h, positions.to(self.device)[None], None, self.cache, False)
        last = out[0, -1]  # (H,)
        return last, d.compute_logits(last[None, None])[0, 0].float()  # (H,), (Vd,)

    @torch.inference_mode()
    def step(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = None if mask is None else mask.to(self.device)[None, None]  # (1, 1, K, S + K)
        out, logits = self.draft(
            ids.to(self.device)[None], hidden.to(self.device, self.dtype)[None], positions.to(self.device)[None],
            m, self.cache,
        )  # fmt: skip
        return out[0], logits[0].float()  # (K, H), (K, Vd)

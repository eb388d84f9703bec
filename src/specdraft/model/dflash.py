"""The DFlash block-parallel draft (block diffusion draft, z-lab) as vLLM's `DFlashDraftModel` serves it.

One draft forward proposes a whole block. Inputs: the target's features f_t at context positions t (the
concatenation of the hidden states ENTERING target layers `aux_layer_ids`, as for EAGLE-3 but any number
of layers), and a block of Q = block_size tokens [anchor, mask, .., mask] at positions p .. p + Q - 1,
where the anchor x_p is the last token the target produced (its features are not known yet):

    ctx      = hidden_norm(fc(cat(f_1 .. f_n)))                  (B, C, H)   fused context features
    h        = embed(block)                                       (B, Q, H)   mask slots: mask_embedding
    per layer (Qwen3 style, q_norm/k_norm per head):
        x    = input_layernorm(h)
        q    = rope(q_norm(q_proj(x)))                            block queries only
        k, v = cat(rope(k_norm(k_proj(ctx))), rope(k_norm(k_proj(x)))), cat(v_proj(ctx), v_proj(x))
        h    = h + o_proj(attention(q, k, v, mask)); h = h + mlp(post_attention_layernorm(h))
    logits   = lm_head(norm(h))                                   (B, Q, Vd)  over the draft vocabulary

The block attends to every context position before the anchor and to every block token (non-causal
inside the block). Block slot i >= 1 predicts the token at its own position p + i (the anchor slot predicts
nothing: vLLM's `sample_from_anchor=False`), so a round drafts Q - 1 tokens.

This is what vLLM's `qwen3_dflash.py` computes for the same weights: its context K/V are the layers'
k/v projections of `hidden_norm(fc(aux))` (written to the KV cache before the block forward), and its
`input_layernorm`/`post_attention_layernorm` fused add-norms give the same pre-norm residual stream.
Module names follow that layout (`fc`, `hidden_norm`, `layers.i.self_attn.{q,k,v,o}_proj`, `q_norm`,
`k_norm`, `layers.i.mlp.{gate,up,down}_proj`, `norm`, `lm_head`, `d2t`). The target's embedding and LM head
are frozen copies (the head: the target's rows of the draft vocabulary, mapped to target ids by `d2t` as
EAGLE-3's; Vd = V is the target's head itself, what SGLang serves). The mask embedding starts at the
target's embedding of `mask_token_id` and is trained unless `train_mask_embedding` is False; vLLM reads a
trained one from `mask_embedding.pt` next to the weights, SGLang only serves the untrained one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.model.draft import _ACTS, DraftConfig, DraftMLP, RMSNorm, Rotary, apply_rotary

FORMAT = "specdraft.dflash"


@dataclass
class DFlashConfig:
    """Sizes and settings of a DFlash draft; the widths and rope derive from the target."""

    hidden_size: int  # H, the draft's width (the target's hidden size)
    intermediate_size: int  # width of each layer's gated MLP
    num_attention_heads: int  # query heads per layer
    num_key_value_heads: int  # key/value heads per layer (GQA when fewer)
    vocab_size: int  # V, the target's vocabulary (rows of the frozen embedding)
    draft_vocab_size: int = 32000  # Vd, rows of lm_head; capped at vocab_size
    num_hidden_layers: int = 1  # draft decoder layers
    block_size: int = 8  # Q, tokens per block: the anchor then Q - 1 mask slots (Q - 1 drafted per round)
    aux_layer_ids: list[int] = field(
        default_factory=list
    )  # target layers whose INPUT hidden states are fused
    mask_token_id: int = 0  # token id the served format puts in mask slots (its embedding is mask_embedding)
    head_dim: int = 0  # per-head width; 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_parameters: dict = field(default_factory=dict)  # rope settings, transformers style
    max_position_embeddings: int = 4096  # the target's context length
    target_hidden_size: int = 0  # width of each captured hidden state; 0 = hidden_size
    target_num_layers: int = 0  # L of the target
    hidden_act: str = "silu"  # MLP activation
    train_mask_embedding: bool = (
        True  # False: the mask slots keep the target's embedding of mask_token_id (SGLang)
    )
    loss_decay_gamma: float = 0.0  # position decay of the block loss, exp(-(i-1)/gamma); 0 = block_size / 2
    target_name: str = ""  # the target this draft was built for
    target_config_hash: str = ""  # the target's config hash

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.draft_vocab_size = min(self.draft_vocab_size, self.vocab_size)
        self.rope_parameters = dict(self.rope_parameters) or {"rope_type": "default", "rope_theta": 10000.0}
        self.rope_parameters.setdefault("rope_type", self.rope_parameters.get("type", "default"))
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        self.loss_decay_gamma = float(self.loss_decay_gamma or self.block_size / 2)
        errors = []
        if self.num_attention_heads % self.num_key_value_heads:
            errors.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            errors.append(f"block_size must be at least 2 (anchor + 1 mask), not {self.block_size}")
        if self.num_hidden_layers < 1:
            errors.append(f"num_hidden_layers must be positive, not {self.num_hidden_layers}")
        ids = self.aux_layer_ids
        if not ids or ids != sorted(set(ids)) or ids[0] < 0:
            errors.append(f"aux_layer_ids {ids} must be distinct non-negative ids in ascending order")
        if self.target_num_layers and ids and ids[-1] >= self.target_num_layers:
            errors.append(f"aux_layer_ids {ids} reach past the target's {self.target_num_layers} layers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            errors.append(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary of {self.vocab_size}"
            )
        if self.hidden_act not in _ACTS:
            errors.append(f"hidden_act {self.hidden_act!r} unsupported; use one of {sorted(_ACTS)}")
        if errors:
            raise ValueError("DFlashConfig: " + "; ".join(errors))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target(cls, text_config, aux_layer_ids: list[int], **kw) -> DFlashConfig:
        """A DFlash config sized like the target's text config; `kw` sets the draft's own fields."""
        base = DraftConfig.from_target(text_config, kw.get("draft_vocab_size", 32000), [0, 1, 2])
        keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings", "target_hidden_size",
                "target_num_layers")  # fmt: skip
        return cls(**{k: getattr(base, k) for k in keep}, aux_layer_ids=sorted(aux_layer_ids), **kw)

    def rope_config(self) -> DraftConfig:
        """The EAGLE-3 config carrying the same rope settings (the shared `Rotary` reads it)."""
        return DraftConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size, head_dim=self.head_dim, rope_parameters=self.rope_parameters,
            max_position_embeddings=self.max_position_embeddings, hidden_act=self.hidden_act,
        )  # fmt: skip


class DFlashAttention(nn.Module):
    """Block queries attending to the context's keys/values (projected from ctx) and the block's own."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        d, nh, nkv, H = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, nkv * d, bias=False)
        self.v_proj = nn.Linear(H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after k_norm and rope) and values of x (B, T, H): (B, nkv, T, d) each."""
        B, T, _ = x.shape
        nkv, d = self.cfg.num_key_value_heads, self.cfg.head_dim
        k = self.k_norm(self.k_proj(x).view(B, T, nkv, d)).transpose(1, 2)  # (B, nkv, T, d)
        v = self.v_proj(x).view(B, T, nkv, d).transpose(1, 2)  # (B, nkv, T, d)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """x (B, Q, H) block; ctx_k/v (B, nkv, C, d); mask bool (B, 1|nh, Q, C + Q) True = attend."""
        B, Q, _ = x.shape
        nh, nkv, d = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        q = apply_rotary(
            self.q_norm(self.q_proj(x).view(B, Q, nh, d)).transpose(1, 2), cos, sin
        )  # (B, nh, Q, d)
        k, v = self.kv(x, cos, sin)  # (B, nkv, Q, d)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)  # (B, nkv, C + Q, d)
        if nkv != nh:
            k = k.repeat_interleave(nh // nkv, dim=1)  # (B, nh, C + Q, d)
            v = v.repeat_interleave(nh // nkv, dim=1)  # (B, nh, C + Q, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, nh * d))  # (B, Q, H)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg.rope_config())

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)  # (B, Q, H)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, Q, H)


class DFlashDraft(nn.Module):
    """DFlash draft: fc fusion of the target's layers, N non-causal layers over a block, draft-vocab head."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's embeddings
        self.mask_embedding = nn.Parameter(
            torch.zeros(H), requires_grad=cfg.train_mask_embedding
        )  # mask slots' input
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's head rows of the draft vocabulary, frozen
        self.rotary = Rotary(cfg.rope_config())
        vd = cfg.draft_vocab_size
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # (Vd,) offsets
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[:vd] = True
        self.register_buffer("t2d", t2d)  # (V,)

    def init_from_target(
        self, embed: torch.Tensor, lm_head: torch.Tensor | None = None, norm: torch.Tensor | None = None
    ) -> None:
        """Copy the target's embedding (V, H), the draft vocabulary's rows of its LM head and its final norm's
        weight (the draft's `norm` starts as the target's, so the frozen head reads outputs at its scale);
        the mask embedding starts at the embedding of `mask_token_id`."""
        with torch.no_grad():
            if norm is not None:
                self.norm.weight.copy_(norm)
            self.embed_tokens.weight.copy_(embed)
            self.mask_embedding.copy_(embed[self.cfg.mask_token_id])
            if lm_head is not None:
                ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
                self.lm_head.weight.copy_(lm_head[ids.to(lm_head.device)])

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Fused context features: aux (B, C, A) -> hidden_norm(fc(aux)) (B, C, H)."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(
        self, ctx: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of the fused context ctx (B, C, H) at positions (B, C)."""
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def embed_block(self, ids: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """Block inputs: ids (B, Q) embedded, mask slots (is_mask True) replaced by mask_embedding."""
        e = self.embed_tokens(ids)  # (B, Q, H)
        return torch.where(is_mask[..., None], self.mask_embedding.to(e.dtype), e)

    def forward(
        self,
        ids: torch.Tensor,
        is_mask: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Block ids, is_mask, positions (B, Q); ctx_kv from `context_kv`; mask bool (B, 1, Q, C + Q)
        (None = every block token sees all context and the whole block) -> logits (B, Q, Vd)."""
        h = self.embed_block(ids, is_mask)  # (B, Q, H)
        cos, sin = self.rotary(positions, h.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, ck, cv, mask)  # (B, Q, H)
        return self.lm_head(self.norm(h))  # (B, Q, Vd)

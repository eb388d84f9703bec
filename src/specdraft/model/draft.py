"""The EAGLE-3 draft model (arXiv 2503.01840) as vLLM serves it, its KV cache, vocabulary map and file names.

One forward step of the draft, for tokens at positions p with input token ids x and an input hidden
state h (the fused target features `fc(cat(aux_1, aux_2, aux_3))` on the first step, the draft's own
previous `hidden_out` on later steps):

    e        = input_layernorm(embed_tokens(x))                  (B, T, H)   embeddings are the target's, frozen
    residual = h;  g = hidden_norm(h)                            (norm_before_residual=False, the default)
    residual = g = hidden_norm(h)                                (norm_before_residual=True)
    a        = o_proj(attention(rope(q(cat(e, g))), rope(k(.)), v(.)))   q/k/v read 2H, o_proj writes H
    residual = residual + a
    residual = residual + mlp(post_attention_layernorm(residual))
    hidden_out = residual                                        (B, T, H)   fed to the next draft step
    logits   = lm_head(norm(hidden_out))                         (B, T, Vd)  over the draft vocabulary

This is numerically what vLLM's `llama_eagle3.py` computes for the same weights (its fused
add-and-norm `norm(x, residual)` returns (norm(x + residual), x + residual), and the draft's next-step
hidden state is that pre-norm sum unless the config sets `norm_output`).

EAGLE-3.1 (options): `fc_norm`, an RMSNorm on each aux layer's state before fc, and `norm_output`, the
post-norm hidden state fed back as the next step's `hidden` (lm_head then reads it without another norm).
Deeper drafts (`num_hidden_layers` N > 1): layers 1 .. N-1 are plain pre-norm Llama layers over the H-wide
residual stream (`later_layers.j`, vLLM's `layers.{j+1}`), each with its own KV cache; the final norm and
`hidden_out` follow the last one.

Module names follow the plain EAGLE-3 checkpoint layout: `fc`, `midlayer.{self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj, input_layernorm, hidden_norm, post_attention_layernorm}`, `norm`, `lm_head`,
`d2t`, `t2d` (and `embed_tokens`, a frozen copy of the target's); the speculators format names the
decoder layer `layers.0` instead of `midlayer`.

Draft vocabulary: the Vd most frequent target token ids (over loss-masked tokens), ascending; draft
index i is target id `i + d2t[i]`, and `t2d[j]` says whether target id j is in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "specdraft.eagle3"


# ---------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------


@dataclass
class DraftConfig:
    """Sizes and settings of an EAGLE-3 draft; everything but the vocabulary derives from the target."""

    hidden_size: int  # H, the draft's width (equal to the target's hidden size, as vLLM requires)
    intermediate_size: int  # width of the draft layer's gated MLP
    num_attention_heads: int  # query heads of the draft layer
    num_key_value_heads: int  # key/value heads (GQA when fewer than the query heads)
    vocab_size: int  # V, the target's vocabulary (rows of the frozen embedding)
    draft_vocab_size: int = 32000  # Vd, rows of lm_head; capped at vocab_size
    head_dim: int = 0  # per-head width; 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_parameters: dict = field(default_factory=dict)  # rope settings, transformers style (rope_theta, ...)
    max_position_embeddings: int = 4096  # the target's context length (used by scaled rope types)
    target_hidden_size: int = 0  # width of each aux hidden state; 0 = hidden_size
    aux_layer_ids: list[int] = field(default_factory=list)  # the target's 3 aux ids, ascending (fc order)
    target_num_layers: int = 0  # L of the target (its final capture id)
    norm_before_residual: bool = False  # residual is hidden_norm(h) instead of h (False = plain EAGLE-3)
    num_hidden_layers: int = 1  # decoder layers: the first reads cat(embedding, hidden) (2H), later ones H
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux hidden state before fc (vLLM's `fc_norm`)
    norm_output: bool = (
        False  # EAGLE-3.1: the next step's hidden state is the post-norm one (vLLM's `norm_output`)
    )
    hidden_act: str = "silu"  # MLP activation
    attention_bias: bool = False  # biases on q/k/v/o projections
    mlp_bias: bool = False  # biases on the MLP projections
    target_name: str = ""  # the target this draft was built for (name or path), for manifests
    target_config_hash: str = ""  # the target's config hash, for refusing mismatched pairs

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.draft_vocab_size = min(self.draft_vocab_size, self.vocab_size)
        self.rope_parameters = dict(self.rope_parameters) or {"rope_type": "default", "rope_theta": 10000.0}
        self.rope_parameters.setdefault("rope_type", self.rope_parameters.get("type", "default"))
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        errors = []
        if self.num_attention_heads % self.num_key_value_heads:
            errors.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads {self.num_key_value_heads}")  # fmt: skip
        if self.draft_vocab_size < 1:
            errors.append(f"draft_vocab_size must be positive, not {self.draft_vocab_size}")
        if self.aux_layer_ids and (
            len(set(self.aux_layer_ids)) != 3 or self.aux_layer_ids != sorted(self.aux_layer_ids)
        ):
            errors.append(f"aux_layer_ids {self.aux_layer_ids} must be 3 distinct ids in ascending order")
        if self.num_hidden_layers < 1:
            errors.append(f"num_hidden_layers must be at least 1, not {self.num_hidden_layers}")
        if self.hidden_act not in _ACTS:
            errors.append(f"hidden_act {self.hidden_act!r} unsupported; use one of {sorted(_ACTS)}")
        if errors:
            raise ValueError("DraftConfig: " + "; ".join(errors))

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_target(
        cls,
        text_config,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        norm_before_residual: bool = False,
        target_name: str = "",
        target_config_hash: str = "",
        num_hidden_layers: int = 1,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> DraftConfig:
        """A draft config sized like the target's text config (a transformers PretrainedConfig)."""
        c = text_config
        rope = getattr(c, "rope_parameters", None)
        if not rope:  # transformers < 5: rope_theta + rope_scaling
            rope = dict(getattr(c, "rope_scaling", None) or {})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope["rope_theta"] = float(getattr(c, "rope_theta", 10000.0))
        if (
            isinstance(rope, dict) and "rope_theta" not in rope and rope
        ):  # per-layer-type dict (Gemma-3 style)
            rope = rope.get("full_attention") or next(iter(rope.values()))
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or 1e-6),
            rope_parameters=dict(rope),
            max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
            target_hidden_size=c.hidden_size,
            aux_layer_ids=sorted(aux_layer_ids),
            target_num_layers=c.num_hidden_layers,
            norm_before_residual=norm_before_residual,
            num_hidden_layers=num_hidden_layers,
            fc_norm=fc_norm,
            norm_output=norm_output,
            target_name=target_name,
            target_config_hash=target_config_hash,
        )

    def to_llama_config(self):
        """The draft layers as a transformers LlamaConfig: rope setup, and the export's layer config."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
            tie_word_embeddings=False,
        )


_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


# ---------------------------------------------------------------------------------------------------------
# vocabulary map
# ---------------------------------------------------------------------------------------------------------


def vocab_counts(token_counts: np.ndarray | torch.Tensor, vocab_size: int) -> np.ndarray:
    """A dataset's token counts over the target's whole vocabulary (V,): zeros past the tokenizer's ids (model
    vocabularies are often padded beyond it); counts over more ids than V are another tokenizer's (refused)."""
    counts = np.asarray(token_counts)
    if counts.shape[0] > vocab_size:
        raise ValueError(f"token counts cover {counts.shape[0]} ids but the target's vocabulary has only {vocab_size}: "
                         "the dataset was prepared with another tokenizer")  # fmt: skip
    return np.pad(counts, (0, vocab_size - counts.shape[0]))


def build_vocab_map(
    token_counts: np.ndarray | torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary: the `draft_vocab_size` most frequent target ids (ties: lower id first).

    Returns (d2t int64 [Vd]: target_id = i + d2t[i], ids ascending; t2d bool [V]: id kept).
    Tokens never seen fill the remaining places in id order when fewer than Vd were seen.
    """
    counts = np.asarray(token_counts, dtype=np.int64)
    assert counts.ndim == 1, f"token_counts must be 1-D, got shape {counts.shape}"
    V = counts.shape[0]
    vd = min(draft_vocab_size, V)
    top = np.sort(np.argsort(-counts, kind="stable")[:vd])  # (Vd,) kept target ids, ascending
    d2t = torch.from_numpy(top - np.arange(vd)).long()  # (Vd,)
    t2d = torch.zeros(V, dtype=torch.bool)  # (V,)
    t2d[torch.from_numpy(top)] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary, (Vd,) int64."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


# ---------------------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as Llama (transformers and vLLM) computes it."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (neox layout: halves rotated) with the target's rope settings."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        rope = cfg.rope_parameters
        if rope["rope_type"] == "default":
            base = float(rope["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
            scale = 1.0
        else:  # scaled variants (llama3, yarn, linear, ...) through transformers' own init functions
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope["rope_type"] not in ROPE_INIT_FUNCTIONS or rope["rope_type"] == "dynamic":
                raise ValueError(f"rope type {rope['rope_type']!r} is not supported by the draft; "
                                 f"supported: default, {sorted(set(ROPE_INIT_FUNCTIONS) - {'dynamic'})}")  # fmt: skip
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg.to_llama_config(), "cpu")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scale = float(scale)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (B, 1, T, head_dim) for position_ids (B, T)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # (B, T, d/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, d)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d) rotated: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (B, heads, T, d)
    return x * cos + rotated * sin


class DraftKVCache:
    """Keys and values of the draft's single attention layer: (B, kv_heads, S, head_dim) each.

    Keys are stored after rotary embedding. `crop(n)` rolls back to the first n positions (rejected
    draft tokens).
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.later: list[DraftKVCache] = []  # the caches of decoder layers 1 .. N-1 (deeper drafts)

    def layer(self, j: int) -> DraftKVCache:
        """The cache of decoder layer j + 1 (made on first use)."""
        while len(self.later) <= j:
            self.later.append(DraftKVCache())
        return self.later[j]

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add T new positions; returns the full keys and values (B, kv_heads, S + T, d)."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            assert k.shape[0] == self.k.shape[0], f"batch {k.shape[0]} != cached batch {self.k.shape[0]}"
            self.k = torch.cat([self.k, k], dim=2)  # (B, kvh, S + T, d)
            self.v = torch.cat([self.v, v], dim=2)  # (B, kvh, S + T, d)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep the first n positions."""
        assert 0 <= n <= len(self), f"cannot crop a cache of {len(self)} positions to {n}"
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
        for c in self.later:
            c.crop(n)


class DraftAttention(nn.Module):
    """Attention whose q/k/v read the 2H-wide cat(embedding, hidden) input (the first layer; `width` H later)."""

    def __init__(self, cfg: DraftConfig, width: int = 0):
        super().__init__()
        self.cfg = cfg
        d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        width = width or 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, nh * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(width, nkv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(width, nkv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * d, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        kv_cache: DraftKVCache | None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        d, nh, nkv = self.cfg.head_dim, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        q = self.q_proj(x).view(B, T, nh, d).transpose(1, 2)  # (B, nh, T, d)
        k = self.k_proj(x).view(B, T, nkv, d).transpose(1, 2)  # (B, nkv, T, d)
        v = self.v_proj(x).view(B, T, nkv, d).transpose(1, 2)  # (B, nkv, T, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        past = 0
        if kv_cache is not None:
            past = len(kv_cache)
            k, v = kv_cache.append(k, v)  # (B, nkv, past + T, d)
        S = k.shape[2]
        if nkv != nh:
            k = k.repeat_interleave(nh // nkv, dim=1)  # (B, nh, S, d)
            v = v.repeat_interleave(nh // nkv, dim=1)  # (B, nh, S, d)
        is_causal = False
        if attn_mask is None:
            if past == 0:
                is_causal = True
            else:  # causal with an offset: query t sees keys 0 .. past + t
                attn_mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(past)  # (T, S)
        else:
            assert attn_mask.shape[-1] == S and attn_mask.shape[-2] == T, (
                f"attn_mask {tuple(attn_mask.shape)} must end in (T={T}, S_past+T={S})"
            )
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal
        )  # (B, nh, T, d)
        out = out.transpose(1, 2).reshape(B, T, nh * d)  # (B, T, nh * d)
        return self.o_proj(out)  # (B, T, H)


class DraftMLP(nn.Module):
    """Llama's gated MLP."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The draft's one decoder layer (named `midlayer` in EAGLE-3 checkpoints, `layers.0` in speculators)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        kv_cache: DraftKVCache | None,
    ) -> torch.Tensor:
        """embeds, hidden (B, T, H) -> the layer output (B, T, H), before the final norm."""
        e = self.input_layernorm(embeds)  # (B, T, H)
        if self.norm_before_residual:
            g = self.hidden_norm(hidden)  # (B, T, H)
            residual = g
        else:
            residual = hidden
            g = self.hidden_norm(hidden)  # (B, T, H)
        x = torch.cat([e, g], dim=-1)  # (B, T, 2H): embedding first, as vLLM concatenates
        residual = residual + self.self_attn(x, cos, sin, attn_mask, kv_cache)  # (B, T, H)
        residual = residual + self.mlp(self.post_attention_layernorm(residual))  # (B, T, H)
        return residual


class LaterDecoderLayer(nn.Module):
    """Decoder layer 1 .. N-1 of a deeper draft: a plain pre-norm Llama layer over the H-wide residual stream
    (vLLM's `layers.j` for j >= 1: q/k/v read H, the fused add-norm gives the same sums)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, x, cos, sin, attn_mask, kv_cache) -> torch.Tensor:
        """x (B, T, H) the residual stream -> (B, T, H)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_cache)  # (B, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, H)


# ---------------------------------------------------------------------------------------------------------
# the draft
# ---------------------------------------------------------------------------------------------------------


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft: fc fusion of 3 target layers, one decoder layer, final norm, reduced-vocabulary head."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's embeddings
        if cfg.fc_norm:  # EAGLE-3.1: one norm per aux layer, low, mid, high
            self.fc_norm = nn.ModuleList(
                [RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)]
            )
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        if cfg.num_hidden_layers > 1:  # exported as layers.1 .. layers.N-1
            self.later_layers = nn.ModuleList(
                [LaterDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers - 1)]
            )
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        vd = cfg.draft_vocab_size
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # (Vd,) offsets
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[:vd] = True
        self.register_buffer("t2d", t2d)  # (V,)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Llama-style init: normal(0, std) weights, zero biases, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (from `build_vocab_map`)."""
        assert d2t.shape == self.d2t.shape and t2d.shape == self.t2d.shape, (
            "vocab map sizes do not match the config"
        )
        assert int(t2d.sum()) == d2t.shape[0], "t2d must mark exactly Vd target ids"
        assert torch.equal(torch.nonzero(t2d).flatten().cpu(), draft_to_target_ids(d2t).cpu()), (
            "d2t and t2d disagree"
        )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, T, 3H_target): the 3 aux hidden states concatenated in ascending id order -> (B, T, H)."""
        if self.cfg.fc_norm:  # each aux layer's state normed alone (vLLM's fc_norm)
            parts = aux.chunk(3, dim=-1)  # 3 x (B, T, H_target)
            aux = torch.cat([n(x) for n, x in zip(self.fc_norm, parts)], dim=-1)  # (B, T, 3H_target)
        return self.fc(aux)

    def output(self, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream (B, T, H) -> hidden_out, the next step's input: the stream itself, or
        (norm_output, EAGLE-3.1) the final norm of it."""
        return self.norm(residual) if self.cfg.norm_output else residual

    def compute_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """hidden_out (B, T, H) (`output`) -> logits over the draft vocabulary (B, T, Vd): the final norm then
        lm_head (with norm_output the norm is already in hidden_out)."""
        return self.lm_head(hidden_out if self.cfg.norm_output else self.norm(hidden_out))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        kv_cache: DraftKVCache | None = None,
        compute_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step.

        Args:
            input_ids: (B, T) target token ids (the token AFTER the position whose features are in `hidden`).
            hidden: (B, T, H) fused target features (`fuse`) or the previous step's hidden_out.
            position_ids: (B, T) rotary positions.
            attn_mask: bool (B or 1, 1, T, S_past + T), True = attend; None = causal over cache + new tokens.
            kv_cache: the draft's cache; the new keys/values are appended to it.
            compute_logits: False returns (hidden_out, None) (training computes its head loss separately).

        Returns:
            hidden_out (B, T, H) (`output`: before the final norm, unless norm_output) (the next step's
            `hidden`), logits (B, T, Vd).
        """
        embeds = self.embed_tokens(input_ids)  # (B, T, H)
        cos, sin = self.rotary(position_ids, embeds.dtype)  # (B, 1, T, d) each
        x = self.midlayer(embeds, hidden.to(embeds.dtype), cos, sin, attn_mask, kv_cache)  # (B, T, H)
        for j, layer in enumerate(getattr(self, "later_layers", ())):
            x = layer(x, cos, sin, attn_mask, None if kv_cache is None else kv_cache.layer(j))  # (B, T, H)
        hidden_out = self.output(x)  # (B, T, H)
        return hidden_out, self.compute_logits(hidden_out) if compute_logits else None

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids (any shape) to target ids."""
        return draft_ids + self.d2t[draft_ids]


def build_draft(
    target,
    token_counts: np.ndarray | torch.Tensor,
    aux_layer_ids: list[int],
    draft_vocab_size: int = 32000,
    norm_before_residual: bool = False,
    init_lm_head: bool = True,
    seed: int = 0,
    fc_init: str = "random",
    num_hidden_layers: int = 1,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> Eagle3Draft:
    """A fresh draft for a `specdraft.targets.Target`: sized from its config, its embeddings copied and frozen,
    the draft vocabulary from `token_counts`, lm_head rows from the target's (when `init_lm_head`), fc random
    (EAGLE-3) or, with `fc_init="high"`, passing the highest aux layer's hidden state through unchanged."""
    assert fc_init in ("random", "high"), fc_init
    cfg = DraftConfig.from_target(
        target.text_config,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=aux_layer_ids,
        norm_before_residual=norm_before_residual,
        num_hidden_layers=num_hidden_layers,
        fc_norm=fc_norm,
        norm_output=norm_output,
        target_name=getattr(target, "path", "") or getattr(target, "name", ""),
        target_config_hash=getattr(target, "config_hash", ""),
    )
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"the target's config (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) disagrees with its weights "
            f"(hidden {target.hidden_size}, vocab {target.vocab_size}); pass a consistent model"
        )
    counts = vocab_counts(token_counts, cfg.vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(cfg)
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    draft.set_vocab_map(d2t, t2d)
    with torch.no_grad():
        emb = target.embed_tokens.weight
        draft.embed_tokens.weight.copy_(emb[: cfg.vocab_size].float().cpu())
        head = getattr(target.lm_head, "weight", None)
        if init_lm_head and head is not None and head.shape[1] == cfg.hidden_size:
            draft.lm_head.weight.copy_(head[t2d.to(head.device)].float().cpu())
        if fc_init == "high":  # the residual stream starts at the target's own late hidden state
            H = cfg.hidden_size
            assert cfg.target_hidden_size == H, "identity fc needs aux states as wide as the draft"
            draft.fc.weight.zero_()  # (H, 3H): blocks low, mid, high
            draft.fc.weight[:, 2 * H :].copy_(torch.eye(H))  # (H, H) identity on the high block
    return draft


# ---------------------------------------------------------------------------------------------------------
# cost
# ---------------------------------------------------------------------------------------------------------


def flops_per_token(cfg: DraftConfig, ttt_steps: int) -> float:
    """Approximate training FLOPs per token (forward + backward = 3x forward matmuls) for `ttt_steps` steps."""
    H, d = cfg.hidden_size, cfg.head_dim
    layer = (
        2 * H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d + cfg.num_attention_heads * d * H
    )
    later = layer - H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d  # q/k/v read H, not 2H
    layer += (
        3 * H * cfg.intermediate_size
        + H * cfg.draft_vocab_size
        + (cfg.num_hidden_layers - 1) * (later + 3 * H * cfg.intermediate_size)
    )
    return 2.0 * 3 * (3 * cfg.target_hidden_size * H + ttt_steps * layer)

"""The target's tensors a draft shares with it, read alone: input embeddings, final norm, lm_head, config.

A draft needs only these few tensors of its target (the embeddings it looks tokens up in, the final norm
and lm_head its teacher applies to the captured final hidden state); the decoder layers (all but ~1% of
a 1T-parameter MoE) are never read. :func:`load_frozen` reads them from the target's safetensors files
through `model.safetensors.index.json` (or the single/only files) with `safe_open(...).get_tensor(name)`,
so a machine that trains on extracted hidden states needs neither the target's memory nor its load time.

Tensor names come from the architecture itself: the model is built on the `meta` device (no memory) from
its config, and the names of the modules `get_input_embeddings()`, `get_output_embeddings()` and the final
norm (`targets.find_layout`) give the names to read; the modules themselves, materialised with just those
tensors, compute exactly what the loaded target's do (Gemma's `(1 + w)` norm, GPT-2's LayerNorm, scaled
embeddings). Checkpoints that name tensors otherwise (multimodal wrappers saved as `language_model.model.*`)
are matched by known prefix rewrites, then by a unique suffix outside the decoder layers; otherwise a clear
error lists what was looked for. Tied embeddings (the meta model ties lm_head to the embeddings) share one
tensor, as in the loaded target.

`FrozenParts` quacks like `targets.Target` where `build_draft` and the trainer's `TeacherHead` look
(`text_config`, `embed_tokens`, `norm`, `lm_head`, `hidden_size`, `vocab_size`, `num_layers`,
`config_hash`, `logit_softcap`, `path`, `name`), so either builds a draft and its teacher.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdraft.fileio import DTYPES, fingerprint_matches, weights_fingerprint
from specdraft.targets import EMBEDDED_DEFAULT, config_hash, find_layout, locate_target

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# (module-name prefix, checkpoint prefix) pairs: the same tensor saved under an older/other layout
_PREFIX_REWRITES = (
    ("model.language_model.", "language_model.model."),
    ("model.language_model.", "model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),
    ("model.", ""),
)
_LAYER_INDEX = re.compile(r"\.\d+\.")  # a name inside a decoder layer (`model.layers.3.`, MTP layers too)


@dataclass(frozen=True)
class EmbedSource:
    """Where a saved draft's frozen embeddings come from when its checkpoint omits them."""

    target: str  # the target's local directory
    weights_fingerprint: str  # `fileio.weights_fingerprint` of that directory when the draft was saved
    tensor: str  # the embedding tensor's name in the target's safetensors files

    def to_dict(self) -> dict:
        return {"from": "target", "target": self.target, "weights_fingerprint": self.weights_fingerprint,
                "tensor": self.tensor}  # fmt: skip


@dataclass
class FrozenParts:
    """The target's shared tensors (frozen, eval mode) and what describes it; a stand-in for a Target."""

    name: str  # what the user passed (dir, hub id or `smollm2-135m`)
    path: str  # the local directory read
    config: object  # the full transformers config (the wrapper's, for multimodal targets)
    embed_tokens: nn.Module  # input embeddings (the architecture's own module class)
    norm: nn.Module  # the final norm
    lm_head: nn.Module  # output projection (shares the embedding weight when tied)
    num_layers: int  # L
    hidden_size: int  # H
    vocab_size: int  # rows of lm_head
    config_hash: str  # equal to `load_target(name).config_hash`
    weights_fingerprint: str  # `fileio.weights_fingerprint(path)`
    tensor_names: dict  # role ("embed_tokens", "norm.weight", ...) -> the name read from the files
    tied: bool  # lm_head shares the embedding tensor
    logit_softcap: float | None = None  # Gemma-2 style final logit soft-capping

    @property
    def text_config(self):
        return self.config.get_text_config()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def embed_source(self) -> EmbedSource:
        """What `save_draft(..., embed_from=...)` records so `load_draft` can re-attach the embeddings."""
        return EmbedSource(self.path, self.weights_fingerprint, self.tensor_names["embed_tokens.weight"])

    def logits_from_final(self, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher logits from the final captured hidden state (id L, before the norm): lm_head(norm(h))."""
        logits = self.lm_head(self.norm(hidden))
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


# ---------------------------------------------------------------------------------------------------------
# the files
# ---------------------------------------------------------------------------------------------------------


def weight_map(directory: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors file name of a model directory (index, single file, or the files' headers)."""
    d = Path(directory)
    if (d / INDEX_FILE).exists():
        return dict(json.loads((d / INDEX_FILE).read_text())["weight_map"])
    files = sorted(d.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for ext in ("bin", "pt", "gguf") for p in d.glob(f"*.{ext}"))
        raise FileNotFoundError(
            f"{d} has no safetensors weights ({others[:4] or 'no weight files at all'}): reading the target's "
            "shared tensors alone needs safetensors; convert it once (load it with transformers and "
            "save_pretrained), or load the whole target instead"
        )
    from safetensors import safe_open

    out: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update(dict.fromkeys(h.keys(), f.name))
    return out


def read_tensors(directory: str | Path, names: list[str], wmap: dict[str, str] | None = None) -> dict:
    """Exactly the named tensors, each read alone from its safetensors file (nothing else is touched)."""
    from safetensors import safe_open

    d = Path(directory)
    wmap = weight_map(d) if wmap is None else wmap
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(wmap[n], []).append(n)
    out = {}
    for fname, ns in by_file.items():
        with safe_open(str(d / fname), framework="pt") as h:
            for n in ns:
                out[n] = h.get_tensor(n)
    return out


def _find_name(want: str, wmap: dict[str, str]) -> str | None:
    """The checkpoint's name of module parameter `want`: itself, a known rewrite, or a unique suffix match."""
    if want in wmap:
        return want
    for new, old in _PREFIX_REWRITES:
        if want.startswith(new) and old + want[len(new) :] in wmap:
            return old + want[len(new) :]
    tail = ".".join(want.split(".")[-2:])
    hits = [n for n in wmap if (n == tail or n.endswith("." + tail)) and not _LAYER_INDEX.search(n)]
    hits = [n for n in hits if not any(v in n for v in ("vision", "visual", "mm_projector", "audio"))] or hits
    return hits[0] if len(hits) == 1 else None


# ---------------------------------------------------------------------------------------------------------
# the architecture on the meta device
# ---------------------------------------------------------------------------------------------------------


def _shallow(config):
    """A copy of `config` with one decoder layer (built faster on meta); None when it cannot be made."""
    c = copy.deepcopy(config)
    text = c.get_text_config()
    try:
        text.num_hidden_layers = 1
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:1]
    except Exception:  # noqa: BLE001 - a config that refuses: build the full (meta, free) model instead
        return None
    return c


def _meta_model(config, trust_remote_code: bool) -> nn.Module:
    """The architecture built on the meta device: module names and classes, no memory."""
    from transformers import AutoModelForCausalLM

    def build(cfg):
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
            except ValueError:  # multimodal wrappers register as image-text-to-text
                from transformers import AutoModelForImageTextToText

                return AutoModelForImageTextToText.from_config(cfg, trust_remote_code=trust_remote_code)

    shallow = _shallow(config)
    if shallow is not None:
        try:
            return build(shallow)
        except Exception:  # noqa: BLE001 - some architectures need their full layer pattern
            pass
    return build(config)


def _materialise(module: nn.Module, prefix: str, tensors: dict[str, torch.Tensor], init_weights) -> nn.Module:
    """A real copy of meta `module` holding `tensors` (keys relative to the module).

    Non-persistent buffers (never in a checkpoint, e.g. Gemma's `embed_scale`) are computed by the
    architecture's own `_init_weights`, which skips the tensors just loaded (flagged initialised, as
    transformers' loader flags them).
    """
    real = copy.deepcopy(module)
    real.load_state_dict(tensors, strict=True, assign=True)
    for t in [*real.parameters(), *real.buffers()]:
        if not t.is_meta:
            t._is_hf_initialized = True
    metas = [n for n, b in real.named_buffers() if b.is_meta]
    if metas:
        for n in metas:
            owner, _, leaf = n.rpartition(".")
            sub = real.get_submodule(owner)
            sub._buffers[leaf] = torch.empty_like(
                sub._buffers[leaf], device=next(iter(tensors.values())).device
            )
        for m in real.modules():
            init_weights(m)
    left = [n for n, t in [*real.named_parameters(), *real.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(
            f"{prefix or 'module'} keeps tensors not saved in the checkpoint ({left}): not supported"
        )
    return real.eval().requires_grad_(False)


def load_frozen(
    name: str = EMBEDDED_DEFAULT,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
) -> FrozenParts:
    """The target's input embeddings, final norm and lm_head (+ config, hashes), never its decoder layers.

    Args:
        name: the target (HF dir, hub id in the local cache, or the embedded default `smollm2-135m`).
        device: where the tensors go.
        dtype: their dtype (a name of `fileio.DTYPES` or a torch dtype).
        trust_remote_code: allow the target's own config/modelling code (to build its architecture on meta).
    """
    from transformers import AutoConfig

    tdtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    d = locate_target(name, need="config")
    try:
        config = AutoConfig.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ValueError(f"target {name} ships its own code (auto_map in its config): pass "
                             "--trust-remote-code if you trust it") from e  # fmt: skip
        raise
    meta = _meta_model(config, trust_remote_code)
    embed, head = meta.get_input_embeddings(), meta.get_output_embeddings()
    if embed is None or head is None:
        raise ValueError(f"{type(meta).__name__} exposes no input/output embeddings: is {name} a causal LM?")
    _, _, norm = find_layout(meta)
    tied = head.weight is embed.weight
    names = {id(m): n for n, m in meta.named_modules()}
    wanted = {  # role -> (module, its parameter/buffer names)
        "embed_tokens": (embed, list(embed.state_dict())),
        "norm": (norm, list(norm.state_dict())),
        "lm_head": (head, [] if tied else list(head.state_dict())),
    }
    wmap = weight_map(d)
    found: dict[str, str] = {}
    missing = []
    for role, (module, params) in wanted.items():
        for p in params:
            want = f"{names[id(module)]}.{p}"
            got = _find_name(want, wmap)
            if got is None:
                missing.append(want)
            else:
                found[f"{role}.{p}"] = got
    if missing:
        sample = sorted(n for n in wmap if not _LAYER_INDEX.search(n))[:12]
        raise ValueError(
            f"cannot find the target's shared tensors {missing} in {d} (looked for those names, with the prefixes "
            f"{sorted({o for _, o in _PREFIX_REWRITES if o})} and by a unique suffix outside the layers); its "
            f"non-layer tensors are {sample}. Load the whole target instead, or open an issue with this message"
        )
    raw = read_tensors(d, sorted(set(found.values())), wmap)
    bad = sorted({str(t.dtype) for t in raw.values() if not t.is_floating_point() or t.element_size() < 2})
    if bad:
        raise ValueError(f"the target's shared tensors in {d} are stored as {bad} (quantised): specdraft needs "
                         "them in float32/bfloat16/float16")  # fmt: skip

    def part(role: str, module: nn.Module) -> nn.Module:
        sd = {k.split(".", 1)[1]: raw[v].to(device=device, dtype=tdtype) for k, v in found.items()
              if k.startswith(role + ".")}  # fmt: skip
        return _materialise(module, names[id(module)], sd, meta._init_weights)

    embed_real = part("embed_tokens", embed)
    norm_real = part("norm", norm)
    if tied:
        head_real = copy.deepcopy(head)
        head_real.weight = embed_real.weight
        if getattr(head_real, "bias", None) is not None:
            raise ValueError(f"{name}: a tied lm_head with a bias is not supported")
        head_real = head_real.eval().requires_grad_(False)
    else:
        head_real = part("lm_head", head)
    text = config.get_text_config()
    return FrozenParts(
        name=name,
        path=str(d),
        config=config,
        embed_tokens=embed_real,
        norm=norm_real,
        lm_head=head_real,
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(embed_real.weight.shape[1]),
        vocab_size=int(head_real.weight.shape[0]),
        config_hash=config_hash(text),
        weights_fingerprint=weights_fingerprint(d),
        tensor_names=found,
        tied=tied,
        logit_softcap=getattr(text, "final_logit_softcapping", None),
    )


def load_embeddings(source: EmbedSource | dict, target: str | None = None) -> torch.Tensor:
    """The embedding tensor a saved draft refers to, after checking the target's weights did not change.

    `target` overrides the recorded directory (the same weights moved elsewhere); the fingerprint must match.
    """
    src = (
        EmbedSource(**{k: v for k, v in source.items() if k != "from"})
        if isinstance(source, dict)
        else source
    )
    d = locate_target(target or src.target, need="any")
    if not fingerprint_matches(src.weights_fingerprint, d):
        now = weights_fingerprint(d)
        raise ValueError(
            f"the target's weights in {d} changed since this draft was saved (weights fingerprint "
            f"{src.weights_fingerprint} then, {now} now): the draft's frozen embeddings are read from them, "
            f"so it cannot be loaded against these. Fix: point at the original target's weights "
            f"(it was {src.target}), or start training anew for this target"
        )
    wmap = weight_map(d)
    if src.tensor not in wmap:
        raise ValueError(f"{d} has no tensor {src.tensor!r} (the draft's embeddings): is it the same target?")
    return read_tensors(d, [src.tensor], wmap)[src.tensor]

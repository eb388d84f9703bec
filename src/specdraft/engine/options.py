"""`--engine-args`: a user's extra `vllm.LLM(...)` options, parsed and checked before any engine loads.

One parser for every command that takes `--engine-args` (extract, regenerate, eval) and one check that each
key is an option the installed vLLM accepts (a field of `vllm.EngineArgs` or a parameter of `vllm.LLM`),
read through the engine contract. What a backend sets itself is that backend's own check
(`specdraft.capture.vllm.check_engine_args`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from specdraft.engine import contract as engines

__all__ = ["check_known_options", "parse_engine_args"]

EXAMPLE = "'{\"enable_expert_parallel\": true}'"


def parse_engine_args(text: str) -> dict[str, Any]:
    """The JSON object of `--engine-args` ({} when empty); ValueError saying what is wrong with it."""
    if not text.strip():
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--engine-args is not valid JSON ({e.msg} at character {e.pos}): {text!r}"
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(f"--engine-args must be a JSON object like {EXAMPLE}, not {text!r}")
    return parsed


def check_known_options(user: Mapping[str, Any]) -> None:
    """ValueError naming every key the installed vLLM does not accept as an option, with close matches."""
    import dataclasses
    import difflib
    import inspect

    if not user:
        return
    known = {f.name for f in dataclasses.fields(engines.get("vllm.EngineArgs"))}
    known |= {n for n in inspect.signature(engines.get("vllm.LLM")).parameters if n not in ("self", "kwargs")}
    unknown = sorted(k for k in user if k not in known)
    if unknown:
        hints = {k: difflib.get_close_matches(k, known, n=2) for k in unknown}
        raise ValueError(
            f"engine option(s) {unknown} are not vllm.EngineArgs fields of the installed vLLM"
            + "".join(f"; {k}: did you mean {h}?" for k, h in hints.items() if h)
        )

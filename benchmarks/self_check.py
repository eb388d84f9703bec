"""The sample self-check's cost (issue 36): prepare's conversation -> samples step with and without it.

    python benchmarks/self_check.py [--conversations 10000] [--target smollm2-135m] [--max-chars 8000]

Two workloads of N conversations each, on the target's tokenizer:
- `sharegpt`: the first N usable ShareGPT conversations (each cut to its first turns within --max-chars
  characters) with the target's own template (the embedded default: ChatML, one sample per conversation);
- `hybrid`: N synthetic multi-turn conversations with reasoning fields, tool calls and results through the
  hybrid-thinking stand-in template of tests/templates (one sample per assistant turn, markers as text).
Each is timed once, the check's own functions timed inside the same run (so the share does not depend on what
else the machine does between two runs); prints the seconds, conversations/s, the check's seconds and share of
the time, and how many conversations it dropped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdraft.data import render
from specdraft.data.messages import Dropped, normalize_record
from specdraft.data.sources import ReadReport, read_records
from specdraft.targets import load_tokenizer

HYBRID = Path(__file__).parent.parent / "tests" / "templates" / "hybrid_thinking.jinja"


def sharegpt(n: int, max_chars: int) -> list:
    out = []
    for _, rec in read_records("sharegpt", ReadReport()):
        conv, why = normalize_record(rec)
        if why:
            continue
        msgs, size = [], 0
        for m in conv.messages:
            size += len(m["content"])
            if (
                size > max_chars
                and any(x["role"] == "assistant" for x in msgs)
                and msgs[-1]["role"] == "assistant"
            ):
                break
            msgs.append(m)
        conv.messages = msgs
        out.append(conv)
        if len(out) == n:
            return out
    return out


def synthetic(n: int) -> list:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = []
    for i in range(n):
        call = {
            "type": "function",
            "id": f"c{i}",
            "function": {"name": "get_weather", "arguments": {"city": f"C{i}"}},
        }
        rec = {"tools": tools, "messages": [
            {"role": "user", "content": f"Hello number {i}, what is the weather in C{i}?"},
            {"role": "assistant", "content": "", "reasoning_content": f"I need the tool for C{i}.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"sunny, {i % 30} C"},
            {"role": "assistant", "content": f"It is sunny and {i % 30} C.", "reasoning_content": "The tool answered."},
            {"role": "user", "content": "Thanks! And tomorrow?"},
            {"role": "assistant", "content": "I cannot know tomorrow's weather yet.", "reasoning_content": "No tool."}]}  # fmt: skip
        out.append(normalize_record(rec)[0])
    return out


def timed(tok, convs, kwargs) -> tuple[float, int, int]:
    """(seconds, samples, conversations dropped by the self-check)."""
    t0, samples, dropped = time.perf_counter(), 0, 0
    for conv in convs:
        try:
            samples += len(render.conversation_samples(tok, conv, kwargs))
        except Dropped as e:
            dropped += str(e).startswith("self-check")
    return time.perf_counter() - t0, samples, dropped


def clocked(fn, spent: list[float]):
    """`fn`, adding the seconds each call takes to spent[0]."""

    def run(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=10000)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--max-chars", type=int, default=8000)
    a = ap.parse_args()
    tok = load_tokenizer(a.target)
    own = tok.chat_template
    results = {}
    for name, convs, template in (("sharegpt", sharegpt(a.conversations, a.max_chars), own),
                                  ("hybrid", synthetic(a.conversations), HYBRID.read_text())):  # fmt: skip
        tok.chat_template = template
        timed(tok, convs[:50], {})  # warm caches (template compile, probes)
        spent = [0.0]
        checks = render._check_whole, render._check_turn
        render._check_whole, render._check_turn = (clocked(f, spent) for f in checks)
        try:
            total, samples, dropped = timed(tok, convs, {})
        finally:
            render._check_whole, render._check_turn = checks
        results[name] = {"conversations": len(convs), "samples": samples, "seconds": round(total, 2),
                         "check_seconds": round(spent[0], 2), "check_share": round(spent[0] / total, 3),
                         "conversations_per_s": round(len(convs) / total, 1), "self_check_drops": dropped}  # fmt: skip
        print(name, json.dumps(results[name]), flush=True)


if __name__ == "__main__":
    main()

"""The installed engine's result cache is keyed by content: two processes compute the same key (issue 46, item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.doctor.command import content
from specdraft.engine.contract import CONTRACTS, VLLM_CONTRACT
from specdraft.engine.formats import EngineDefault

SRC = Path(__file__).resolve().parents[1] / "src"

_KEY = """
import json, sys
from specdraft.doctor.command import _contract_fingerprint, content
from specdraft.engine.contract import CONTRACTS
print(json.dumps({
    "content": {name: json.dumps(content(c), sort_keys=True) for name, c in sorted(CONTRACTS.items())},
    "fingerprint": {name: _contract_fingerprint(c, "cpu", ["LlamaForCausalLM"]) for name, c in sorted(CONTRACTS.items())},
}))
"""


def _key_in_a_new_process() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _KEY], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_two_processes_compute_the_same_key():
    first, second = _key_in_a_new_process(), _key_in_a_new_process()
    assert first == second
    assert set(first["content"]) == set(CONTRACTS)


def test_the_key_holds_no_address():
    """The aux-layer default is a lambda: its qualified name and a hash of its source, not `<function ... at 0x>`."""
    text = json.dumps(content(VLLM_CONTRACT), sort_keys=True)
    assert " at 0x" not in text and "<lambda>" in text
    a = EngineDefault("m:f", "(2,)", "doc", value=lambda n: [2, n // 2, n - 3])
    b = EngineDefault("m:f", "(2,)", "doc", value=lambda n: [1, n // 2, n - 3])
    assert content(a) != content(b)  # another body is another key
    assert content(a)["value"]["@"] == "test_the_key_holds_no_address.<locals>.<lambda>"


def test_every_contract_is_json_data():
    for c in CONTRACTS.values():
        assert json.loads(json.dumps(content(c))) == content(c)


@pytest.mark.parametrize("obj", [{"b": 1, "a": (2, 3)}, frozenset({"x", "y"}), None, 1.5])
def test_content_does_not_depend_on_order(obj):
    assert json.dumps(content(obj)) == json.dumps(content(obj))

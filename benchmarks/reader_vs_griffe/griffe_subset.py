"""Lower bound for griffe if it could load only the modules our reader touched: griffe.visit() on just those
files (no cross-module alias resolution, no extensions across modules), vs ast.parse of the same files.
Run: (from run_all.sh) griffe venv python griffe_subset.py  (after ours.py wrote ours.json)"""

import ast
import json
import os
import time
from pathlib import Path

SITE = Path(os.environ["SITE"])
mods = [m for m in json.load(open("ours.json"))["__timing__"]["modules"] if m.startswith("vllm")]
files = []
for m in mods:
    base = SITE.joinpath(*m.split("."))
    files.append((m, base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")))
t0 = time.perf_counter()
import griffe  # noqa: E402 (timed import)

t1 = time.perf_counter()
for m, f in files:
    griffe.visit(m.rsplit(".", 1)[-1], filepath=f, code=f.read_text())
t2 = time.perf_counter()
for _m, f in files:
    ast.parse(f.read_text())
t3 = time.perf_counter()
print(
    f"{len(files)} vllm modules: griffe.visit {t2 - t1:.2f}s (import griffe {t1 - t0:.2f}s); ast.parse {t3 - t2:.2f}s"
)

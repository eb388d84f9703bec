"""Run: (from run_all.sh) griffe venv python attrs_griffe.py"""

import json
import os
import time

t0 = time.perf_counter()
import griffe  # noqa: E402 (timed import)

pkg = griffe.load("vllm", search_paths=[os.environ["SITE"]], allow_inspection=False)
out = {}
for sym, attrs in json.load(open("attrs.json")):
    module, _, qual = sym.partition(":")
    try:
        cls = pkg[".".join(x for x in (module.partition(".")[2], qual) if x)]
        names = set(cls.all_members)
        out[sym] = {a: a in names for a in attrs}
    except Exception as exc:
        out[sym] = f"{type(exc).__name__}: {exc}"
json.dump(out, open("attrs_griffe_out.json", "w"), indent=1)
print(f"griffe attrs {time.perf_counter() - t0:.2f}s", out)

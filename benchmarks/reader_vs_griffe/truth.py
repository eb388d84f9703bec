"""Ground truth: import vllm and take inspect.signature, exactly as specdraft.doctor.check does.
Run: (from run_all.sh) .venv/bin/python truth.py"""

import json
import os
import time

t0 = time.perf_counter()
from specdraft.doctor.check import _import_entry, _imported_sig  # noqa: E402 (timed import)
from specdraft.engine.contract import Entry  # noqa: E402 (timed import)

out = {}
for sym, _why in json.load(open(os.environ.get("SYMS", "symbols.json"))):
    try:
        obj, drop = _import_entry(Entry("x", sym))
        s = _imported_sig(obj, drop)
        out[sym] = {"params": [[p.name, p.kind, p.required] for p in s.params], "text": s.text}
    except Exception as exc:
        out[sym] = {"error": f"{type(exc).__name__}: {exc}"}
json.dump(out, open(os.environ.get("OUT", "truth.json"), "w"), indent=1)
print(f"truth: {time.perf_counter() - t0:.1f}s")

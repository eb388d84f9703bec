"""Our static reader: SourceTree + signature() over site-packages, timed from a cold process.
Run: (from run_all.sh) .venv/bin/python ours.py [SITE]"""

import json
import os
import sys
import time

t0 = time.perf_counter()
from specdraft.doctor.source.reader import SourceTree, signature  # noqa: E402 (timed import)

SITE = sys.argv[1] if len(sys.argv) > 1 else os.environ["SITE"]
t1 = time.perf_counter()
tree = SourceTree(SITE)
out = {}
for sym, _why in json.load(open(os.environ.get("SYMS", "symbols.json"))):
    found, whynot = tree.resolve(sym)
    if found is None:
        out[sym] = {"error": whynot}
        continue
    s = signature(tree, found)
    if s is None:
        out[sym] = {"error": f"no signature ({found.kind} at {found.location})"}
        continue
    out[sym] = {
        "params": [[p.name, p.kind, p.required] for p in s.params],
        "text": s.text,
        "origin": s.origin,
    }
t2 = time.perf_counter()
out["__timing__"] = {
    "import": t1 - t0,
    "signatures": t2 - t1,
    "total": t2 - t0,
    "modules_parsed": len(tree._parsed),
    "modules": sorted(m for m, t in tree._parsed.items() if t is not None),
}
json.dump(out, open(os.environ.get("OUT", "ours.json"), "w"), indent=1)
print(
    f"ours: import {t1 - t0:.3f}s, {len(tree._parsed)} modules parsed, signatures {t2 - t1:.3f}s, total {t2 - t0:.3f}s"
)

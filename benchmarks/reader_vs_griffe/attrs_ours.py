"""Run: (from run_all.sh) .venv/bin/python attrs_ours.py"""

import json
import os
import time

t0 = time.perf_counter()
from specdraft.doctor.source.reader import SourceTree, instance_attributes  # noqa: E402 (timed import)

tree = SourceTree(os.environ["SITE"])
out = {}
for sym, attrs in json.load(open("attrs.json")):
    found, why = tree.resolve(sym)
    names = instance_attributes(tree, found) if found else None
    out[sym] = {a: (names is None or a in names) for a in attrs} if found else why
json.dump(out, open("attrs_ours_out.json", "w"), indent=1)
print(f"ours attrs {time.perf_counter() - t0:.2f}s", out)

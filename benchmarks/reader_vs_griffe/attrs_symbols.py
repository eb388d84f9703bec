"""attrs.json: [symbol, [attributes specdraft reads on its instances]] from the contract.
Run: (from run_all.sh) .venv/bin/python attrs_symbols.py"""

import json

from specdraft.engine.contract import VLLM_CONTRACT

out = {}
for e in VLLM_CONTRACT.entries:
    if e.attributes:
        out.setdefault(e.symbol, set()).update(e.attributes)
for ext in VLLM_CONTRACT.extensions:
    for w in ext.worker_classes:
        out.setdefault(w, set()).update(ext.worker_methods + ext.worker_attributes)
json.dump([[k, sorted(v)] for k, v in out.items()], open("attrs.json", "w"), indent=1)
print(len(out))

"""Write symbols.json: every vLLM symbol specdraft's contract declares (+ kwargs targets, worker classes)
and a few vLLM config classes (pydantic dataclasses via @config) as extra cases.
Run: (from run_all.sh) .venv/bin/python symbols.py"""

import json

from specdraft.engine.contract import VLLM_CONTRACT

syms = []


def add(s, why):
    if s not in [x[0] for x in syms]:
        syms.append((s, why))


for e in VLLM_CONTRACT.entries:
    add(e.symbol, "declared")
    if e.forwards_kwargs_to:
        add(e.forwards_kwargs_to, "kwargs target")
for ext in VLLM_CONTRACT.extensions:
    for w in ext.worker_classes:
        add(w, "worker class")
# extra: the config classes behind the dict-valued options we pass (speculative_config, kv_transfer_config)
for s in [
    "vllm.config:SpeculativeConfig",
    "vllm.config:KVTransferConfig",
    "vllm.config:ModelConfig",
    "vllm.config:CacheConfig",
    "vllm.config:VllmConfig",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner",
]:
    add(s, "extra")
json.dump(syms, open("symbols.json", "w"), indent=1)
print(len(syms), "symbols")

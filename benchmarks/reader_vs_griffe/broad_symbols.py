"""broad.json: every name vllm exports lazily (MODULE_ATTRS) + every name vllm.config imports in __init__,
read from source (no import). Run: python3 broad_symbols.py [SITE]"""

import ast
import json
import os
import sys

SITE = sys.argv[1] if len(sys.argv) > 1 else os.environ["SITE"]
syms = []
t = ast.parse(open(f"{SITE}/vllm/__init__.py").read())
for s in ast.walk(t):
    if isinstance(s, ast.Assign) and any(getattr(x, "id", "") == "MODULE_ATTRS" for x in s.targets):
        syms += [[f"vllm:{k.value}", "MODULE_ATTRS"] for k in s.value.keys]
t = ast.parse(open(f"{SITE}/vllm/config/__init__.py").read())
for s in t.body:
    if isinstance(s, ast.ImportFrom):
        syms += [[f"vllm.config:{a.asname or a.name}", "vllm.config"] for a in s.names]
json.dump(syms, open("broad.json", "w"), indent=1)
print(len(syms))

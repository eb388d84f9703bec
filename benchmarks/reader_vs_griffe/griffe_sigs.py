"""griffe's static view of the same symbols, timed from a cold process.
Run: (from run_all.sh) griffe venv python griffe_sigs.py [--resolve] [--nosource] [SITE]
--resolve: griffe.load(..., resolve_aliases=True); default: aliases resolved lazily on access."""

import json
import os
import sys
import time

t0 = time.perf_counter()
import griffe  # noqa: E402 (timed import)

args = [a for a in sys.argv[1:] if not a.startswith("--")]
SITE = args[0] if args else os.environ["SITE"]
resolve = "--resolve" in sys.argv
t1 = time.perf_counter()
pkg = griffe.load(
    "vllm",
    search_paths=[SITE],
    allow_inspection=False,
    resolve_aliases=resolve,
    store_source="--nosource" not in sys.argv,
    extensions=griffe.load_extensions(*[a[6:] for a in sys.argv if a.startswith("--ext=")]),
)
t2 = time.perf_counter()
KIND = {
    "positional_only": "POSITIONAL_ONLY",
    "positional_or_keyword": "POSITIONAL_OR_KEYWORD",
    "var_positional": "VAR_POSITIONAL",
    "keyword_only": "KEYWORD_ONLY",
    "var_keyword": "VAR_KEYWORD",
}
VAR = ("VAR_POSITIONAL", "VAR_KEYWORD")


def params_of(params, drop_first):
    ps = list(params)
    if drop_first and ps and KIND[ps[0].kind.name] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
        ps = ps[1:]
    out = []
    for p in ps:
        k = KIND[p.kind.name]
        out.append([p.name, k, p.default is None and k not in VAR])
    return out


out = {}
for sym, _why in json.load(open(os.environ.get("SYMS", "symbols.json"))):
    module, _, qual = sym.partition(":")
    path = ".".join(x for x in (module.partition(".")[2], qual) if x)
    try:
        obj = pkg[path]
        target = obj.final_target if obj.is_alias else obj
        if target.is_class:
            members = target.all_members
            init = members.get("__init__")
            if init is None:
                out[sym] = {
                    "params": [],
                    "text": "()",
                    "origin": "no __init__ found (griffe returns empty Parameters)",
                    "no_init": True,
                }
                continue
            init_t = init.final_target if init.is_alias else init
            ps = params_of(init_t.parameters, True)
            origin = f"__init__ of {init_t.parent.path}" + (" (synthesized)" if init_t.lineno == 0 else "")
        elif target.is_function:
            drop = target.parent.is_class and "staticmethod" not in target.labels
            ps = params_of(target.parameters, drop)
            origin = "def"
        else:
            out[sym] = {"error": f"not callable: {target.kind}"}
            continue
        out[sym] = {
            "params": ps,
            "text": "(" + ", ".join(n if r or k in VAR else n + "=..." for n, k, r in ps) + ")",
            "origin": origin,
        }
    except Exception as exc:
        out[sym] = {"error": f"{type(exc).__name__}: {exc}"}
t3 = time.perf_counter()
n_mod = sum(1 for _ in pkg.modules_collection.members)  # top-level packages loaded
out["__timing__"] = {
    "import": t1 - t0,
    "load": t2 - t1,
    "signatures": t3 - t2,
    "total": t3 - t0,
    "resolve_aliases": resolve,
}
json.dump(out, open(os.environ.get("OUT", "griffe.json"), "w"), indent=1)
print(
    f"griffe: import {t1 - t0:.3f}s load {t2 - t1:.3f}s (resolve_aliases={resolve}) signatures {t3 - t2:.3f}s total {t3 - t0:.3f}s"
)

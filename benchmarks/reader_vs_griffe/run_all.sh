#!/bin/bash
# Our static engine-source reader (specdraft.doctor.source.reader) against griffe, with inspect.signature of the
# imported engine as truth. Run from the repo root after `make install-vllm`:
#   bash benchmarks/reader_vs_griffe/run_all.sh [REPEATS]     (~4-5 min with REPEATS=3; results in RESULTS.md)
# griffe goes into its own venv (never specdraft's): $GRIFFE_VENV, default /tmp/griffe-venv.
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MAIN=$ROOT/.venv/bin/python
GV=${GRIFFE_VENV:-/tmp/griffe-venv}
[ -x "$GV/bin/python" ] || { python3 -m venv "$GV" && "$GV/bin/pip" install -q griffe; }
GR=$GV/bin/python
export PYTHONPATH=$ROOT/src SITE=$($MAIN -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
WORK=${WORK:-/tmp/reader_vs_griffe}; mkdir -p "$WORK"; cp "$(dirname "$0")"/*.py "$WORK"; cd "$WORK"
R=${1:-3}
$MAIN symbols.py; python3 broad_symbols.py
python3 - <<'P'
import json
a = json.load(open("symbols.json")); b = json.load(open("broad.json")); seen = {s for s, _ in a}
json.dump(a + [x for x in b if x[0] not in seen], open("all.json", "w"), indent=1)
P
echo "== contract symbols (timed, $R cold processes each)"
for i in $(seq $R); do $MAIN ours.py; done
for i in $(seq $R); do $GR griffe_sigs.py 2>/dev/null; done
OUT=griffe_resolved.json $GR griffe_sigs.py --resolve 2>/dev/null
$MAIN truth.py 2>/dev/null
echo "== contract + MODULE_ATTRS + vllm.config exports (one import of vllm for the truth)"
SYMS=all.json OUT=ours_all.json $MAIN ours.py
SYMS=all.json OUT=griffe_all.json $GR griffe_sigs.py 2>/dev/null
SYMS=all.json OUT=truth_all.json $MAIN truth.py 2>/dev/null
$MAIN ours.py >/dev/null; $GR griffe_subset.py
echo "== attributes"
$MAIN attrs_symbols.py; $MAIN attrs_ours.py; $GR attrs_griffe.py 2>/dev/null
python3 compare.py > compare_contract.txt; python3 compare.py _all > compare_all.txt
grep exact compare_contract.txt compare_all.txt
echo "per-symbol detail: $WORK/compare_contract.txt, $WORK/compare_all.txt"

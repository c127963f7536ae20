#!/usr/bin/env bash
# The matmul_cm tile sweep (issue 15) on a lent GPU machine, in one call:
#   here:   .venv/bin/python -m vramd.bench.matmul --compile-sweep .cm-sweep   (glslang; all VARIANTS)
#   device: native/device_run.sh native/cm_sweep.sh   (carry .gl .whl .cm-sweep; timeout_s 420)
# Runs, each bounded so that the rest still runs: the committed kernels' correctness on
# the GPU (test_matmul_cm.py, native_gpu), the sweep (vramd bench matmul --sweep), then
# the same correctness tests on the sweep's best variants at their own tile edges
# (VRAMD_CM_SWEEP: the three best at 2,000 tokens and the best at 256), so that the
# winner can be adopted with its GPU check done.  Logs and JSON into $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
SWEEP=${SWEEP:-.cm-sweep}
TYPES=${TYPES:-F16,Q8_0,Q4_K,MXFP4}
mkdir -p "$OUT"
t() { local s=$1; shift; echo "== $*" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
export VRAMD_TEST_DEVICE=native   # the tests' conftest: this machine's driver, not lavapipe
t 60 python3 -m pytest -q -p no:cacheprovider -m native_gpu tests/engine/test_matmul_cm.py > "$OUT/cm_tests.log" 2>&1
tail -2 "$OUT/cm_tests.log"
t "${SWEEP_S:-200}" python3 -m vramd.bench.matmul --sweep "$SWEEP" --types "$TYPES" --tokens 256,2000 --reps 5 \
    --json-out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
grep -A400 "median of" "$OUT/sweep.log" | grep -v "check " | head -60
best=$(python3 -c 'import json, sys
b = json.load(open(sys.argv[1]))["best"]
v = b.get("2000", {}).get("ranking", [])[:3] + b.get("256", {}).get("ranking", [])[:1]
print(",".join(dict.fromkeys(v)))' "$OUT/sweep.json" 2>/dev/null)
echo "variants tested: $best" | tee "$OUT/variants.txt"
if [ -n "$best" ]; then
    VRAMD_CM_SWEEP=$SWEEP VRAMD_CM_VARIANTS=$best t "${VARIANT_S:-100}" python3 -m pytest -q -p no:cacheprovider \
        -m native_gpu tests/engine/test_matmul_cm.py -k sweep_variant > "$OUT/variant_tests.log" 2>&1
    tail -3 "$OUT/variant_tests.log"
fi
grep -E "FAILED|Error" "$OUT"/cm_tests.log "$OUT"/variant_tests.log 2>/dev/null | head -20

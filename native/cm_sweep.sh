#!/usr/bin/env bash
# The matmul_cm tile sweep (issue 15) on a lent GPU machine, in one call:
#   here:   .venv/bin/python -m vramd.bench.matmul --compile-sweep .cm-sweep   (glslang; ~1 min)
#   device: native/device_run.sh native/cm_sweep.sh   (carry .gl .whl .cm-sweep; ~3 min, timeout_s 360)
# Runs, each bounded so that the rest still runs: the committed kernels' correctness on
# the GPU (test_matmul_cm.py, native_gpu), the sweep (vramd bench matmul --sweep), an 8B
# Q4_K prefill of 2,000 tokens with the prefill profile, the engine tests in GPU mode.
# Logs and JSON into $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
SWEEP=${SWEEP:-.cm-sweep}
mkdir -p "$OUT"
t() { local s=$1; shift; echo "== $*" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
export VRAMD_TEST_DEVICE=native   # the tests' conftest: this machine's driver, not lavapipe
t 60 python3 -m pytest -q -p no:cacheprovider -m native_gpu tests/engine/test_matmul_cm.py > "$OUT/cm_tests.log" 2>&1
t 100 python3 -m vramd.bench.matmul --sweep "$SWEEP" --tokens 256,2000 --reps 5 --json-out "$OUT/sweep.json" \
    > "$OUT/sweep.log" 2>&1
t 45 python3 -m vramd.bench.decode --shape 8b --type Q4_K --prompt 2000 --tokens 4 --ctx 2048 --profile-prefill \
    --profile-steps 3 --json-out "$OUT/prefill_q4_k.json" > "$OUT/prefill_q4_k.log" 2>&1
t 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_forward.py \
    tests/engine/test_kernels.py tests/engine/test_replay.py tests/engine/test_fused_ops.py tests/engine/test_moe.py \
    tests/engine/test_arch.py > "$OUT/engine_tests.log" 2>&1
tail -3 "$OUT"/cm_tests.log "$OUT"/engine_tests.log; grep -A200 "median of" "$OUT/sweep.log" | head -80

#!/usr/bin/env bash
# The decode-rows matvec kernels (matvec_t<NT>_<type>, matvec_w_t<NT>_<type>; issue 16) on a lent
# GPU machine, after native/device_run.sh's setup (carry .gl and .whl as it says):
#   native/device_run.sh native/mv_tokens_sweep.sh          (timeout_s 600)
# First their bit-for-bit check on the GPU (test_matvec_tokens.py, native_gpu: each decode row's
# result that of its lone kernel, 1 .. 17 rows, NT 4, 8, 16), then `vramd bench slots` for each
# TYPES x CAPS, CAPS the VRAMD_MV_TOKENS values (1: every decode row through its lone kernel, the
# form before these kernels; 4 / 8 / 16: NT up to that), each run bounded by RUN_S so that the
# rest still runs.  Logs and one JSON a run into $OUT; $OUT/summary.txt: step ms per slot count.
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
TYPES=${TYPES:-Q4_K F16 Q8_0}
CAPS=${CAPS:-1 4 8 16}
SLOTS=${SLOTS:-1,2,4,8,16}
mkdir -p "$OUT"
export VRAMD_TEST_DEVICE=native
timeout "${TEST_S:-120}" python3 -m pytest -q -p no:cacheprovider -m native_gpu tests/engine/test_matvec_tokens.py \
    > "$OUT/mv_tests.log" 2>&1
echo "== tests rc $?"; tail -3 "$OUT/mv_tests.log"
for t in $TYPES; do
  for c in $CAPS; do
    VRAMD_MV_TOKENS=$c timeout "${RUN_S:-150}" python3 -m vramd.cli bench slots --shape 8b --type "$t" \
        --slots "$SLOTS" --prompt 128 --tokens 16 --ctx 512 --json > "$OUT/slots-$t-nt$c.json" 2> "$OUT/slots-$t-nt$c.err"
    echo "== $t VRAMD_MV_TOKENS=$c rc $?"
    python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1])))[:1500])' "$OUT/slots-$t-nt$c.json" 2>&1 \
        | tee -a "$OUT/summary.txt"
  done
done

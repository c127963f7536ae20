#!/usr/bin/env bash
# Issue 15's side-by-side run on a lent H200, in one device call (after native/device_run.sh set
# the machine up): prefill and decode tokens/s of vramd and llama.cpp (the packed prebuilt
# llama-server, .peer/, -ngl 99 -fa on -np 1) on the same zero-weight 8B llama files, F16, Q8_0
# and Q4_K, at 512 / 2,000 / 4,096 / 8,000 tokens, decode 32 tokens after each; F16 also with
# the 512-token chunk to choose the chunk default.  Each step bounded so the rest still runs.
#   device: native/device_run.sh native/bench_prefill_h200.sh   (carry .gl .whl .peer)
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT" /tmp/lsv && tar xJf .peer/llama-server-vulkan.tar.xz -C /tmp/lsv
PEER=/tmp/lsv/bin/llama-server
t() { local s=$1; shift; echo "== $*" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
CHUNK=${CHUNK:-2048}
for ty in F16 Q8_0 Q4_K; do
  t 150 python3 -m vramd.cli bench prefill --peer $PEER --shape 8b --type $ty --lengths 512,2000,4096,8000 \
      --reps 2 --decode 32 --chunk $CHUNK --json-out "$OUT/prefill_$ty.json" 2>&1 | tee "$OUT/prefill_$ty.log"
done
t 80 python3 -m vramd.cli bench prefill --peer $PEER --shape 8b --type F16 --lengths 512,2000 --reps 2 \
    --chunk 512 --json-out "$OUT/prefill_F16_c512.json" 2>&1 | tee "$OUT/prefill_F16_c512.log"

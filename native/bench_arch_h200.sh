#!/usr/bin/env bash
# Issue 17's side-by-side run on a lent H200, in one device call (after native/device_run.sh set
# the machine up): prefill at 512 / 2,000 / 8,000 tokens and decode (128 tokens after each prompt)
# of vramd and llama.cpp (the packed prebuilt llama-server, .peer/, -ngl 99 -fa on -np 1) on the
# same zero-weight files of the three 2026 shapes (vramd/bench/arch_models.py).  Each step bounded
# so the rest still runs.  Chunks: 2,048 for the dense shape, 512 for the MoE ones.
#   device: native/device_run.sh native/bench_arch_h200.sh   (carry .gl .whl .peer; ~8 min)
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT" /tmp/lsv && tar xJf .peer/llama-server-vulkan.tar.xz -C /tmp/lsv
PEER=/tmp/lsv/bin/llama-server
t() { local s=$1; shift; echo "== $*" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
for st in ${SHAPES:-qwen35-27b:Q4_K:2048 qwen35moe-35b-a3b:Q4_K:512 gptoss-20b:MXFP4:512 qwen35-27b:Q8_0:2048}; do
  IFS=: read -r s ty ch <<<"$st"
  t "${STEP_S:-110}" python3 -m vramd.cli bench prefill --peer $PEER --shape "$s" --type "$ty" \
      --lengths 512,2000,8000 --reps 2 --decode 128 --chunk "$ch" --json-out "$OUT/arch_${s}_$ty.json" \
      2>&1 | tee -a "$OUT/arch.log" | tail -14
done

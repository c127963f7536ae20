#!/usr/bin/env bash
# Issue 16's benchmarks on a lent H200, in one device call (after native/device_run.sh set the
# machine up; carry .gl .whl .peer), each step bounded so the rest still runs:
#   1. vramd bench parallel: aggregate decode tokens/s of 1, 4, 8 and 16 concurrent streams,
#      `vramd serve --parallel k` vs the packed prebuilt llama-server (.peer/) `-np k -ngl 99 -fa on`,
#      on the same zero-weight 8B llama files, Q4_K then F16; 128-token prompts, 128 tokens a
#      stream, 2 rounds each (median), per-stream latency (ITL p50/p90, TTFT) at every count;
#   2. vramd bench pause: the wait of a streaming generation on A while B (two 16 GiB F16 models,
#      --residency exclusive, one arena) serves a 1-token request, against the two DMAs.
# Device time (estimates, not measured yet): setup ~1 min; per stream count each engine starts
# on the file (vramd reads every byte into its host shadow: ~5-10 s Q4_K, ~10-20 s F16;
# llama-server ~5 s), a warm-up and 2 x 2 rounds of ~1-3 s: ~30 s Q4_K, ~45 s F16, so ~2 + ~3 min;
# pause: two 16 GiB loads (~10-20 s each), a 4 GiB link probe, 3 generations of 512 tokens:
# ~1 min.  About 7 minutes in all; the bounds below (180 + 220 + 110 s) keep it under 9.
# Needs `vramd serve --parallel N` above 1 (the lead's continuous batching); before it lands
# STREAMS=1 runs the single-stream row only.
#   device: native/device_run.sh native/bench_parallel_h200.sh   (carry .gl .whl .peer)
# Files back: device.txt, build.log (device_run), parallel_Q4_K.json, parallel_F16.json,
# pause.json, bench.log (every step's text output).
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT" /tmp/lsv && tar xJf .peer/llama-server-vulkan.tar.xz -C /tmp/lsv
PEER=/tmp/lsv/bin/llama-server
STREAMS=${STREAMS:-1,4,8,16}
t() { local s=$1; shift; echo "== $*" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
{
t 180 python3 -m vramd.cli bench parallel --peer $PEER --shape 8b --type Q4_K --streams "$STREAMS" \
    --prompt 128 --tokens 128 --reps 2 --json-out "$OUT/parallel_Q4_K.json"
t 220 python3 -m vramd.cli bench parallel --peer $PEER --shape 8b --type F16 --streams "$STREAMS" \
    --prompt 128 --tokens 128 --reps 2 --json-out "$OUT/parallel_F16.json"
t 110 python3 -m vramd.cli bench pause --gib 16 --reps 3 --tokens 512 --before 64 --json-out "$OUT/pause.json"
} 2>&1 | tee "$OUT/bench.log"

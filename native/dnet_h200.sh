#!/usr/bin/env bash
# The DeltaNet decode forms on the H200 (issue 17): the recurrent delta rule's per-head kernel
# (gated_delta, VRAMD_DELTA_SPLIT=0) against the split one (gated_delta_split, =1) on
# Qwen3.5-27B's shape.  Run inside native/device_run.sh (its environment: the loader, the
# wheels, the built core):
#   bash native/device_run.sh native/dnet_h200.sh        (carry .gl .whl)
# Steps, each bounded so that the whole stays under 4 minutes:
#   1. the DeltaNet kernels' tests on the GPU (the split form against gated_delta and numpy,
#      the default forms there: split; rms_norm_gated's bits against rms_norm + silu_mul);
#   2. the kernel A/B (scripts/delta_kernel_ab.py) at the 27B's layer geometry (16 key / 48
#      value heads of 128): one token, then one token of each of 4 sequences;
#   3. `vramd bench decode --shape qwen35-27b --type Q4_K` with each form, --profile on both
#      in round 1 (the profiled steps come after the timed ones, not in decode_tps): the
#      synthetic file is a hole (instant); loading its 14.4 GiB, a 512-token prefill and
#      64 + 8 decode steps take ~40-60 s a run (estimate: no measured load of this shape yet).
#      Round 1: 0 then 1, profiled; round 2: 1 then 0, unprofiled, if under 140 s have gone.
# Logs and JSON in $OUT: dnet_tests.txt, dnet_kernel_ab.txt, dnet_decode_{0a,1a,1b,0b}.json/.err,
# dnet.txt (the summary: decode tok/s, roofline ratio, GPU vs wall ms a step, the top kernels and
# the DeltaNet ones).
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT"
t() { local s=$1; shift; echo "== $* (limit ${s}s)" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
t0=$(date +%s)
VRAMD_TEST_DEVICE=native t 30 python3 -m pytest -q -p no:cacheprovider tests/engine/test_deltanet_kernels.py \
    > "$OUT/dnet_tests.txt" 2>&1
tail -2 "$OUT/dnet_tests.txt"
{ t 20 python3 scripts/delta_kernel_ab.py 16 48 128 1 60
  t 20 python3 scripts/delta_kernel_ab.py 16 48 128 1 60 4; } > "$OUT/dnet_kernel_ab.txt" 2>&1
cat "$OUT/dnet_kernel_ab.txt"
# round 1 profiled; round 2 (the forms the other way round) only where the time allows
for run in 0a 1a 1b 0b; do
  form=${run:0:1}; extra=--profile
  if [ "${run:1}" = b ]; then
    extra=; [ $(( $(date +%s) - t0 )) -gt 140 ] && { echo "== round 2 skipped: $(( $(date +%s) - t0 )) s gone" >&2; break; }
  fi
  VRAMD_DELTA_SPLIT=$form t 80 python3 -m vramd.cli bench decode --shape qwen35-27b --type Q4_K --prompt 512 \
      --tokens 64 --ctx 1024 $extra --json > "$OUT/dnet_decode_$run.json" 2> "$OUT/dnet_decode_$run.err"
  tail -3 "$OUT/dnet_decode_$run.err"
done
python3 - "$OUT" > "$OUT/dnet.txt" 2>&1 <<'EOF'
import json, sys
out = sys.argv[1]
DELTANET = ("gated_delta", "gated_delta_split", "ssm_conv_silu", "rms_norm_gated", "sigmoid_mul")
for run in ("0a", "1a", "1b", "0b"):
    try:
        r = json.load(open(f"{out}/dnet_decode_{run}.json"))
    except (OSError, ValueError) as e:
        print(f"VRAMD_DELTA_SPLIT={run[0]} ({run}): no result ({type(e).__name__})")
        continue
    p = r.get("profile", {})
    print(f"VRAMD_DELTA_SPLIT={run[0]} ({run}): decode {r['decode_tps']:.1f} tok/s ({r['decode_ms_p50']:.2f} ms p50, "
          f"{r['decode_ms_p99']:.2f} p99), roofline {r['roofline_ratio'] or 0:.3f}, prefill {r['prefill_tps']:.0f} tok/s, "
          f"load {r['load_s']:.1f} s" + (f"; GPU {p['gpu_ms_per_step']:.3f} of {p['wall_ms_per_step']:.3f} ms a step"
                                         if p else ""))
    rows = p.get("by_kernel", [])
    for k in rows[:12] + [k for k in rows[12:] if k["kernel"] in DELTANET]:
        print(f"    {k['kernel']:<28} {k['dispatches']:5d} x {k['us']:9.1f} us {100 * k['share']:5.1f} %")
EOF
cat "$OUT/dnet.txt"
echo "total $(( $(date +%s) - t0 )) s"

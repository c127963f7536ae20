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
#      (the profiled steps come after the timed ones and are not in decode_tps): the
#      synthetic file is a hole (instant); loading its 14.4 GiB, a 512-token prefill and
#      64 + 8 decode steps take ~40-60 s a run (estimate: no measured load of this shape yet).
# Logs and JSON in $OUT: dnet_tests.txt, dnet_kernel_ab.txt, dnet_decode_{0,1}.json/.err, dnet.txt
# (the summary: decode tok/s, roofline ratio, GPU vs wall ms per step, the top kernels).
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT"
t() { local s=$1; shift; echo "== $* (limit ${s}s)" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
t0=$(date +%s)
VRAMD_TEST_DEVICE=native t 40 python3 -m pytest -q -p no:cacheprovider tests/engine/test_deltanet_kernels.py \
    > "$OUT/dnet_tests.txt" 2>&1
tail -2 "$OUT/dnet_tests.txt"
{ t 25 python3 scripts/delta_kernel_ab.py 16 48 128 1 100
  t 25 python3 scripts/delta_kernel_ab.py 16 48 128 1 100 4; } > "$OUT/dnet_kernel_ab.txt" 2>&1
cat "$OUT/dnet_kernel_ab.txt"
for form in 0 1; do
  VRAMD_DELTA_SPLIT=$form t 75 python3 -m vramd.cli bench decode --shape qwen35-27b --type Q4_K --prompt 512 \
      --tokens 64 --ctx 1024 --profile --json > "$OUT/dnet_decode_$form.json" 2> "$OUT/dnet_decode_$form.err"
  tail -3 "$OUT/dnet_decode_$form.err"
done
python3 - "$OUT" > "$OUT/dnet.txt" 2>&1 <<'EOF'
import json, sys
out = sys.argv[1]
for form in "01":
    try:
        r = json.load(open(f"{out}/dnet_decode_{form}.json"))
    except (OSError, ValueError) as e:
        print(f"VRAMD_DELTA_SPLIT={form}: no result ({e})")
        continue
    p = r.get("profile", {})
    print(f"VRAMD_DELTA_SPLIT={form}: decode {r['decode_tps']:.1f} tok/s ({r['decode_ms_p50']:.2f} ms p50, "
          f"{r['decode_ms_p99']:.2f} p99), roofline {r['roofline_ratio'] or 0:.3f}, prefill {r['prefill_tps']:.0f} tok/s, "
          f"load {r['load_s']:.1f} s; GPU {p.get('gpu_ms_per_step', 0):.3f} of {p.get('wall_ms_per_step', 0):.3f} ms a step")
    for k in p.get("by_kernel", [])[:14]:
        print(f"    {k['kernel']:<28} {k['dispatches']:5d} x {k['us']:9.1f} us {100 * k['share']:5.1f} %")
EOF
cat "$OUT/dnet.txt"
echo "total $(( $(date +%s) - t0 )) s"

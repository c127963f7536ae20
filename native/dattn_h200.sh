#!/usr/bin/env bash
# Decode attention at long context on a lent H200: the long-context form (attention_dec_n*,
# VRAMD_DECODE_ATTN=new, the GPUs' default) against the old one (attention_split.comp,
# VRAMD_DECODE_ATTN=old), after native/device_run.sh set the machine up (carry .gl .whl):
#   bash native/device_run.sh native/dattn_h200.sh
# First the decode attention tests on the NVIDIA driver (subgroups of 32, where lavapipe's
# are 8), then `vramd bench decode` old/new at 8,000 and 512 tokens for the 8B Q4_K (the
# 8,000 one with --profile: the kernels' GPU us a step) and gpt-oss-20b MXFP4.  Logs in $OUT:
# dattn.log (everything), dattn_<shape>_<prompt>_<form>.json (each run's JSON).
# Time: each run makes its synthetic file in /dev/shm and loads it (8B Q4_K 4.6 GiB, gpt-oss
# ~12 GiB), prefills and decodes 64 tokens: ~20-35 s; the steps stop at their timeouts and
# none starts after 215 s, so the whole stays under 4 minutes (device_run's setup ~15 s).
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT"
t() { local s=$1; shift; echo "== $* ($SECONDS s)" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
run() { # shape type prompt form timeout [extra bench args]
  local shape=$1 type=$2 prompt=$3 form=$4 limit=$5; shift 5
  if [ "$SECONDS" -gt 215 ]; then echo "== skipped $shape $prompt $form (${SECONDS} s)" >&2; return; fi
  VRAMD_DECODE_ATTN=$form t "$limit" python3 -m vramd.cli bench decode --shape "$shape" --type "$type" \
      --prompt "$prompt" --tokens 64 --ctx 8192 --json "$@" > "$OUT/dattn_${shape}_${prompt}_${form}.json"
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); d = r["placements"][0] if "placements" in r else r
print("  decode", round(d["decode_tps"], 1), "tok/s;", *["%s %.0f us" % (k["kernel"], k["us"])
      for k in (r.get("profile") or {}).get("by_kernel", []) if "attention" in k["kernel"]])' \
      "$OUT/dattn_${shape}_${prompt}_${form}.json" 2>&1 | tail -n 2 >&2
}
{
VRAMD_TEST_DEVICE=native t 40 python3 -m pytest -q -x -p no:cacheprovider -m "native_gpu or not native_gpu" \
    tests/engine/test_attention_split.py tests/engine/test_attention_sinks.py tests/engine/test_replay.py 2>&1 | tail -n 6
run 8b Q4_K 8000 old 40 --profile --profile-steps 4
run 8b Q4_K 8000 new 40 --profile --profile-steps 4
run gptoss-20b MXFP4 8000 old 45
run gptoss-20b MXFP4 8000 new 45
run 8b Q4_K 512 old 30
run 8b Q4_K 512 new 30
run gptoss-20b MXFP4 512 old 35
run gptoss-20b MXFP4 512 new 35
echo "== done ($SECONDS s)"
} 2>&1 | tee "$OUT/dattn.log"

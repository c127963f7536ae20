#!/usr/bin/env bash
# Decode attention at long context on a lent H200: the long-context form (attention_dec_n*,
# VRAMD_DECODE_ATTN=new, the GPUs' default) against the old one (attention_split.comp,
# VRAMD_DECODE_ATTN=old), after native/device_run.sh set the machine up (carry .gl .whl):
#   bash native/device_run.sh native/dattn_h200.sh
# First the decode attention tests on the NVIDIA driver (subgroups of 32, where lavapipe's
# are 8); then the kernel-level A/B (scripts/decode_attn_ab.py: 32 layers' attention + merge
# replayed, us per step, the 8B's and gpt-oss's shapes at 8,000 keys, gpt-oss's 128-key
# window with sinks, the new form's work groups a token at 256 / 1024 besides the default
# 512, and its _qs variants, q in shared memory, VRAMD_DEC_Q=shared); then `vramd bench decode` old/new at 8,000 and 512 tokens for the 8B Q4_K
# (the 8,000 one with --profile: the kernels' GPU us a step) and gpt-oss-20b MXFP4.  Logs in
# $OUT: dattn.log (everything), dattn_<shape>_<prompt>_<form>.json (each run's JSON).
# Time: a kernel A/B ~5 s; a bench run makes its synthetic file in /dev/shm and loads it (8B
# Q4_K 4.6 GiB, gpt-oss ~12 GiB), prefills and decodes 64 tokens: ~20-35 s.  Every step has
# a timeout and none starts that could end after 225 s, so the whole stays under 4 minutes
# with device_run's setup (~15 s); what is skipped runs in a second call with STAGES naming
# the stages wanted (default "tests ab 8000 512 tune"), e.g. STAGES="512 tune".
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT"
t() { local s=$1; shift; echo "== $* ($SECONDS s)" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
run() { # shape type prompt form timeout [extra bench args]
  local shape=$1 type=$2 prompt=$3 form=$4 limit=$5; shift 5
  if [ $((SECONDS + limit)) -gt 225 ]; then echo "== skipped $shape $prompt $form (${SECONDS} s)" >&2; return; fi
  VRAMD_DECODE_ATTN=$form t "$limit" python3 -m vramd.cli bench decode --shape "$shape" --type "$type" \
      --prompt "$prompt" --tokens 64 --ctx 8192 --json "$@" > "$OUT/dattn_${shape}_${prompt}_${form}.json"
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); d = r["placements"][0] if "placements" in r else r
print("  " + sys.argv[2], "decode", round(d["decode_tps"], 1), "tok/s;", *["%s %.0f us" % (k["kernel"], k["us"])
      for k in (r.get("profile") or {}).get("by_kernel", []) if "attention" in k["kernel"]])' \
      "$OUT/dattn_${shape}_${prompt}_${form}.json" "$shape $prompt $form" 2>&1 | tail -n 2 >&2
}
has() { case " ${STAGES:-tests ab 8000 512 tune} " in *" $1 "*) return 0;; esac; return 1; }
ab() { # [VAR=value ...] heads kv_heads head_dim position rounds [window sinks]: the kernel A/B, 20 s at most
  local envs=()
  while [[ "$1" == *=* ]]; do envs+=("$1"); shift; done
  if [ $((SECONDS + 20)) -gt 225 ]; then echo "== skipped ab ${envs[*]-} $* (${SECONDS} s)" >&2; return; fi
  echo "== ab ${envs[*]-} $* (${SECONDS} s)"
  env DECODE_AB_LAYERS=32 "${envs[@]+"${envs[@]}"}" timeout 20 python3 scripts/decode_attn_ab.py "$@" 2>&1 | tail -n 3
}
{
if has tests; then
  VRAMD_TEST_DEVICE=native t 40 python3 -m pytest -q -x -p no:cacheprovider -m "native_gpu or not native_gpu" \
      tests/engine/test_attention_split.py tests/engine/test_attention_sinks.py tests/engine/test_replay.py 2>&1 | tail -n 6
fi
if has ab; then
  echo "== kernel A/B: 8B 32 q / 8 KV heads of 128; gpt-oss 64 / 8 of 64, full and 128-key window with sinks"
  ab 32 8 128 8000 10
  ab 64 8 64 8000 10
  ab 64 8 64 8000 10 128 1
fi
for prompt in 8000 512; do
  has $prompt || continue
  if [ $prompt = 8000 ]; then prof="--profile --profile-steps 4"; else prof=""; fi
  run 8b Q4_K $prompt old 40 $prof
  run 8b Q4_K $prompt new 40 $prof
  run gptoss-20b MXFP4 $prompt old 45
  run gptoss-20b MXFP4 $prompt new 45
done
if has tune; then
  echo "== tuning (kernel A/B): work groups a token 256 / 1024 (default 512); q in shared memory (_qs)"
  ab VRAMD_DEC_GROUPS=256 32 8 128 8000 10
  ab VRAMD_DEC_GROUPS=1024 32 8 128 8000 10
  ab VRAMD_DEC_Q=shared 32 8 128 8000 10
  ab VRAMD_DEC_Q=shared 64 8 64 8000 10
fi
echo "== done ($SECONDS s)"
} 2>&1 | tee "$OUT/dattn.log"

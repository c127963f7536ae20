#!/usr/bin/env bash
# This session's GPU run on a lent H200, in two device calls (after native/device_run.sh set the
# machine up; carry .gl .whl .peer), each step bounded so the rest still runs:
#   PART=a  the GPU-only tests (native_gpu + the engine tests on the NVIDIA driver) of the kernels
#           merged this session (tensor-core matmuls after the sweep + MXFP4, several sequences'
#           attention, decode attention by KV head); decode A/B of attention_split_gqa
#           (VRAMD_SPLIT_GQA=0/1) at 8,000 tokens; bench slots
#   PART=b  the grouped expert matmul's tests; gpt-oss, qwen35moe and qwen35-27b against
#           llama.cpp, the 27B's prefill profile
#   device: PART=a native/device_run.sh native/session_h200.sh
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT" /tmp/lsv && tar xJf .peer/llama-server-vulkan.tar.xz -C /tmp/lsv
PEER=/tmp/lsv/bin/llama-server
t() { local s=$1; shift; echo "== $*" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
vs() { # shape type chunk lengths decode seconds
  t "$6" python3 -m vramd.cli bench prefill --peer $PEER --shape "$1" --type "$2" --chunk "$3" --lengths "$4" \
      --reps 2 --decode "$5" --json-out "$OUT/arch_$1_$2.json"
}
if [ "${PART:-a}" = a ]; then
  TESTS=$(ls tests/engine/test_matmul_cm.py tests/engine/test_attention_flash_cm.py tests/engine/test_attention_split.py \
          tests/engine/test_slots.py tests/engine/test_gemma4_moe.py tests/engine/test_forward.py tests/engine/test_kernels_mxfp4.py 2>/dev/null)
  VRAMD_TEST_DEVICE=native t 170 python3 -m pytest -q -p no:cacheprovider -m "native_gpu or not native_gpu" $TESTS \
      > "$OUT/gpu_tests.log" 2>&1
  tail -n 15 "$OUT/gpu_tests.log"
  {
  for g in 0 1 0 1; do
    VRAMD_SPLIT_GQA=$g t 40 python3 -m vramd.cli bench decode --shape 8b --type Q4_K --prompt 8000 --tokens 64 --ctx 8192
  done
  for g in 0 1; do
    VRAMD_SPLIT_GQA=$g t 45 python3 -m vramd.cli bench decode --shape gptoss-20b --type MXFP4 --prompt 8000 --tokens 64 --ctx 8192
  done
  t 60 python3 -m vramd.cli bench slots --shape 8b --type Q8_0 --slots 1,2,4,8,16
  vs 8b Q8_0 2048 2000,8000 0 70   # the tensor-core matmuls after the sweep
  } 2>&1 | tee "$OUT/part_a.log"
else
  TESTS=$(ls tests/engine/test_moe_matmul_id.py tests/engine/test_slots.py 2>/dev/null)
  VRAMD_TEST_DEVICE=native t 70 python3 -m pytest -q -p no:cacheprovider -m "native_gpu or not native_gpu" $TESTS \
      > "$OUT/gpu_tests_b.log" 2>&1
  tail -n 8 "$OUT/gpu_tests_b.log"
  {
  for g in 0 1; do   # the grouped expert matmul against matvec_id, prefill of 2,000 tokens
    VRAMD_MOE_GROUPED=$g t 45 python3 -m vramd.cli bench decode --shape qwen35moe-35b-a3b --type Q4_K --prompt 2000 \
        --tokens 4 --ctx 2100
  done
  t 50 python3 -m vramd.cli bench slots --shape 8b --type Q8_0 --slots 1,4,8,16 --tokens 8   # linear.CM_FROM
  vs gptoss-20b MXFP4 512 512,2000,8000 128 110
  vs qwen35moe-35b-a3b Q4_K 512 512,2000,8000 128 110
  vs qwen35-27b Q4_K 2048 512,2000 64 190
  } 2>&1 | tee "$OUT/part_b.log"
fi

#!/usr/bin/env bash
# The session's GPU-only checks on a lent H200, in one short device call (after native/device_run.sh
# set the machine up): the engine's kernel tests on the NVIDIA driver (VRAMD_TEST_DEVICE=native: the
# native_gpu cooperative-matrix tests run, everything else as on lavapipe; tests/gpu/test_shaders.py
# needs glslc, absent there), then A/B runs of the measurement switches (VRAMD_Q8_DECODE for Q8_0
# decode; VRAMD_FLASH_K16, VRAMD_FLASH_CM for the prefill attention's kernels) and the image request's first token.
#   device: native/device_run.sh native/gpu_checks_h200.sh   (carry .gl .whl)
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT"
t() { local s=$1; shift; echo "== $*" >&2; timeout "$s" "$@"; echo "== rc $?" >&2; }
export VRAMD_TEST_DEVICE=native
TESTS=$(ls tests/engine/test_attention_flash_cm.py tests/engine/test_attention_flash.py tests/engine/test_attention_sinks.py \
        tests/engine/test_matvec_q8_dp.py tests/engine/test_deltanet_kernels.py tests/engine/test_kernels_mxfp4.py \
        tests/engine/test_forward.py tests/engine/test_qwen35_engine.py tests/engine/test_gptoss.py 2>/dev/null)
# pyproject's addopts deselect native_gpu: select both kinds here
t 80 python3 -m pytest -q -p no:cacheprovider -m "native_gpu or not native_gpu" $TESTS > "$OUT/gpu_tests.log" 2>&1
tail -n 12 "$OUT/gpu_tests.log"
{
# the prefill attention at 4,096 tokens: 16-key tiles, 32-key tiles, the tensor-core kernel
VRAMD_FLASH_CM=0 VRAMD_FLASH_K16=1 t 30 python3 -m vramd.cli bench decode --shape 8b --type Q4_K --prompt 4096 --tokens 4 --ctx 4200
VRAMD_FLASH_CM=0 t 30 python3 -m vramd.cli bench decode --shape 8b --type Q4_K --prompt 4096 --tokens 4 --ctx 4200
VRAMD_FLASH_CM=1 t 30 python3 -m vramd.cli bench decode --shape 8b --type Q4_K --prompt 4096 --tokens 4 --ctx 4200
for q in old new; do
  VRAMD_Q8_DECODE=$q t 30 python3 -m vramd.cli bench decode --shape 8b --type Q8_0 --prompt 128 --tokens 32 --ctx 512
done
t 45 python3 -m vramd.cli bench encode --shape vit-l --reps 2
} 2>&1 | tee "$OUT/ab.log"

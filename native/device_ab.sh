#!/usr/bin/env bash
# A/B on a lent GPU machine (the device tool): `vramd bench decode` (prefill of 128 tokens, then 32
# decode steps) of an older engine and of this tree, one run, the same machine, alternating, two
# rounds; then (unless SKIP_TESTS=1) the engine tests on the real GPU.  Make the older tree here:
#   mkdir -p .carry/old && git archive REV vramd native setup.py pyproject.toml | tar -x -C .carry/old
# plus the Gemma 3 270M header in .carry/ (docs/benchmarks.md says how), and carry .gl, .whl and
# .carry as native/device_run.sh describes (.carry/ is git-excluded).  Results: $OUT/ab.txt.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for f in .gl/*.deb; do case "$f" in *libvulkan-dev*) ;; *) dpkg -x "$f" /;; esac; done; ldconfig
mkdir -p /tmp/vkdev && dpkg -x .gl/libvulkan-dev_*.deb /tmp/vkdev
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
export PYTHONUNBUFFERED=1 VULKAN_INCLUDE=/tmp/vkdev/usr/include
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; [ -f "$icd" ] && export VK_DRIVER_FILES=$icd
ROOT=$PWD
for d in "$ROOT/.carry/old" "$ROOT"; do (cd "$d" && PYTHONPATH=/tmp/site python3 native/build_ffi.py > "$OUT/build.log" 2>&1) || { tail -20 "$OUT/build.log"; exit 1; }; done
cp .carry/gemma3-270m.header /dev/shm/gemma.gguf && truncate -s 253113024 /dev/shm/gemma.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/ab.txt"
for round in 1 2; do
  for t in F16 Q8_0 Q4_K gemma; do
    for v in old new; do
      d=$ROOT; [ $v = old ] && d=$ROOT/.carry/old
      if [ $t = gemma ]; then args="--model /dev/shm/gemma.gguf"; else args="--shape 8b --type $t"; fi
      (cd "$d" && PYTHONPATH=/tmp/site:$d timeout 300 python3 -m vramd.cli bench decode $args --prompt 128 --tokens 32 --ctx 512 --json-out "$OUT/$v-$t-$round.json" > /dev/null 2>> "$OUT/ab-err.txt")
      PYTHONPATH= python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], sys.argv[4], {k: r[k] for k in r if isinstance(r[k], (int, float))})" "$OUT/$v-$t-$round.json" $round $t $v >> "$OUT/ab.txt" 2>&1
    done
  done
done
rm -f "$OUT"/*-?.json
[ -n "${SKIP_TESTS:-}" ] && exit 0
cd "$ROOT" && VRAMD_TEST_DEVICE=native PYTHONPATH=/tmp/site:$ROOT timeout 400 python3 -m pytest -q -p no:cacheprovider -x -k "not real" tests/engine/test_forward.py tests/engine/test_replay.py tests/engine/test_moe_replay.py tests/engine/test_gemma3.py tests/engine/test_arch.py tests/engine/test_matvec_paths.py > "$OUT/pytest.txt" 2>&1; tail -3 "$OUT/pytest.txt"

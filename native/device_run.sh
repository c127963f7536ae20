#!/usr/bin/env bash
# Builds the residency core and runs the residency benchmark on a lent GPU
# machine (the device tool), which has the NVIDIA driver but no Vulkan
# loader, no Python `vulkan`/`cffi` and no Vulkan headers.  Carry:
#   .gl/   libvulkan1, libglvnd0 and the other GL dispatch .debs (the NVIDIA
#          ICD lives in libGLX_nvidia, which needs libglvnd), and libvulkan-dev
#   .whl/  vulkan, cffi, pycparser wheels for CPython 3.12 (pip download)
# The loader is unpacked into / (the device README's recipe); the headers
# into /tmp only.  Nothing built here is carried: the core compiles there.
# Usage: native/device_run.sh [bench args ...]; logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/vramd-out}
mkdir -p "$OUT"
for f in .gl/*.deb; do case "$f" in *libvulkan-dev*) ;; *) dpkg -x "$f" /;; esac; done
ldconfig
mkdir -p /tmp/vkdev && dpkg -x .gl/libvulkan-dev_*.deb /tmp/vkdev
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export VULKAN_INCLUDE=/tmp/vkdev/usr/include
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES=$icd
python3 native/build_ffi.py > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c 'import json; from vramd.gpu.device import Device; d = Device(); print(json.dumps(d.describe())); print(d.budget()); d.close()' 2>&1 | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 | tee -a "$OUT/device.txt"
# Anything after the options runs here, with this environment.
if [ $# -gt 0 ]; then bash -c "$*"; fi

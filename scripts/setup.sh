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

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'

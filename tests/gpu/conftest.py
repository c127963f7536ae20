"""Fixtures for tests on real Vulkan.

CI has no GPU: the tests run on Mesa's lavapipe (a CPU Vulkan device, Debian
mesa-vulkan-drivers), forced through VK_DRIVER_FILES before the loader is
first used.  VRAMD_TEST_DEVICE=native runs them on the machine's default
device instead (the H200 through the device tool, say).
"""
import os
import pathlib

import pytest

LAVAPIPE = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"
NATIVE = os.environ.get("VRAMD_TEST_DEVICE") == "native"
if not NATIVE:
    os.environ["VK_DRIVER_FILES"] = LAVAPIPE

MiB = 1 << 20


@pytest.fixture(scope="session")
def device():
    if not NATIVE and not pathlib.Path(LAVAPIPE).is_file():
        pytest.fail(f"lavapipe is missing ({LAVAPIPE}): apt install mesa-vulkan-drivers (scripts/setup.sh does)")
    from vramd.gpu.device import Device

    dev = Device()
    yield dev
    dev.close()


@pytest.fixture
def res(device):
    """A residency core with 1 MiB blocks, so small regions span several."""
    from vramd.gpu.residency import Residency

    r = Residency(device, block_bytes=MiB)
    yield r
    r.close()


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(12345)

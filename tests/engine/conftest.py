"""Fixtures for the engine tests: real Vulkan, on Mesa's lavapipe unless
VRAMD_TEST_DEVICE=native (the same rule as tests/gpu/conftest.py; the driver
is chosen through VK_DRIVER_FILES before the loader is first used)."""
import os
import pathlib

import pytest

LAVAPIPE = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"
NATIVE = os.environ.get("VRAMD_TEST_DEVICE") == "native"
if not NATIVE:
    os.environ["VK_DRIVER_FILES"] = LAVAPIPE


@pytest.fixture(scope="session")
def device():
    if not NATIVE and not pathlib.Path(LAVAPIPE).is_file():
        pytest.fail(f"lavapipe is missing ({LAVAPIPE}): apt install mesa-vulkan-drivers (scripts/setup.sh does)")
    from vramd.gpu.device import Device

    dev = Device()
    yield dev
    dev.close()

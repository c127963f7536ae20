"""The device context: choice of device, queues, extensions, budget."""
import os
import subprocess
import sys

import pytest

from tests.gpu.conftest import NATIVE
from vramd.errors import DeviceError
from vramd.gpu.device import Device, list_devices


@pytest.mark.skipif(NATIVE, reason="describes lavapipe")
def test_lavapipe_one_queue_no_budget_extension(device):
    assert device.type == "cpu"
    assert device.compute_family == device.transfer_family and not device.dedicated_transfer
    assert device.timeline
    assert "VK_EXT_external_memory_host" in device.extensions
    assert not device.memory_budget
    assert device.limits["maxStorageBufferRange"] == 128 << 20


def test_select_by_index_and_uuid(device):
    devices = list_devices()
    assert devices and devices[device.index]["uuid"] == device.uuid
    with Device(device.index) as d:
        assert d.uuid == device.uuid
    dashed = "-".join([device.uuid[:8], device.uuid[8:12], device.uuid[12:]]).upper()
    with Device(dashed) as d:
        assert d.index == device.index


def test_bad_selection_is_one_clear_line():
    with pytest.raises(DeviceError, match=r"no Vulkan device 99: this machine has \d"):
        Device(99)
    with pytest.raises(DeviceError, match="no Vulkan device with UUID 00ff"):
        Device("00ff")


def test_no_driver_gives_one_line_with_what_to_install(tmp_path):
    code = ("import sys\nfrom vramd.errors import DeviceError\nfrom vramd.gpu.device import Device\n"
            "try:\n    Device()\nexcept DeviceError as e:\n    print(e); sys.exit(e.exit_code)\n")
    env = dict(os.environ, VK_DRIVER_FILES=str(tmp_path / "none.json"))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == DeviceError.exit_code, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "apt install libvulkan1 mesa-vulkan-drivers" in lines[0]


def test_budget_per_heap_counts_our_memory(res, device):
    before = res.budget()
    assert [b["heap"] for b in before] == [h["index"] for h in device.heaps]
    heap = res.limits["device_heap"]
    r = res.region("weights", "w", {"t": 3 << 20})
    res.restore(["weights"])
    after = res.budget()
    grown = after[heap]["usage"] - before[heap]["usage"]
    if device.memory_budget:
        assert after[heap]["source"] == "driver" and grown > 0
    else:
        # Own accounting: the shadow (imported into this heap on lavapipe)
        # and the device copy, to the byte.
        assert after[heap]["source"] == "own"
        assert after[heap]["budget"] == device.heaps[heap]["size"]
        info = r.info()
        assert grown == info["host"] + info["device"]

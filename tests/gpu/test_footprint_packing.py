"""vramd/model/footprint.py's `packed_bytes` is the residency core's packing (vramd_region_seal).

`vramd plan` sizes regions without a device from it; here each kind of region,
with many tensor sizes and both block sizes, against what the core lays out.
"""
import random

import pytest

from vramd.gpu.residency import Residency
from vramd.model.footprint import DEFAULT_LIMITS, packed_bytes

MiB = 1 << 20


@pytest.mark.parametrize("block_bytes", [0, MiB])
def test_packed_bytes_are_the_cores(device, block_bytes):
    rng = random.Random(block_bytes)
    with Residency(device, block_bytes=block_bytes) as res:
        for i in range(150):
            sizes = [1, 7, 255, 256, 4096, 65537, rng.randrange(1, 3 * MiB), rng.randrange(1, 40 * MiB)]
            layout = [(f"t{j}", rng.choice(sizes)) for j in range(rng.randrange(1, 30))]
            region = res.region(("weights", "state", "scratch", "encoder")[i % 4], f"r{i}", layout)
            assert region.info()["bytes"] == packed_bytes(layout, res.limits), layout
            assert region.info()["host"] == (0 if region.kind == "scratch" else region.info()["bytes"])
            region.destroy()


def test_the_default_limits_pack_as_this_device_does(device):
    # `vramd plan` assumes DEFAULT_LIMITS: on this device (storage alignment <= 256 B) the same bytes.
    with Residency(device) as res:
        layout = [("a", 3), ("b", 70_000), ("c", 20 * MiB), ("d", 100)]
        assert packed_bytes(layout, DEFAULT_LIMITS) == packed_bytes(layout, res.limits) == \
            res.region("weights", "w", layout).info()["bytes"]

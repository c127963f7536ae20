"""The paths for devices without timeline semaphores: fences on the host
order copies and compute instead."""
import numpy as np

from vramd.gpu.device import Device
from tests.gpu.state_step import StateStep
from vramd.gpu.residency import Residency

MiB = 1 << 20


def test_without_timeline_semaphores_state_and_compute_stay_ordered(device, rng):
    with Device(device.index, timeline=False) as dev:
        assert not dev.timeline
        res = Residency(dev, block_bytes=MiB)
        try:
            step = StateStep(res)
            w = res.region("weights", "w", {"a": 2 * MiB + 3})
            s = res.region("state", "kv", {"k": 3 * MiB})
            wd = rng.integers(0, 256, w.tensors["a"].nbytes, dtype=np.uint8)
            w.tensors["a"].host()[:] = wd
            x = rng.integers(0, 2**32, 3 * MiB // 4, dtype=np.uint32)
            s.tensors["k"].write(x)
            for cycle in range(30):
                res.restore()
                for i in range(3):  # queued; release must wait for them
                    step(s.tensors["k"], 7, cycle + i)
                    x = x * np.uint32(7) + np.uint32(cycle + i)
                res.release()
            assert np.array_equal(s.tensors["k"].read(np.uint32), x)
            res.restore()
            assert np.array_equal(w.tensors["a"].read(), wd)
            step.close()
        finally:
            res.close()

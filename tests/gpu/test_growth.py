"""No growth of device or host memory over 500 release/restore cycles."""
import os

import numpy as np

from tests.gpu.state_step import StateStep

MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pin_malloc_mmap_threshold():
    """glibc raises its mmap threshold each time a large block is freed, so
    large blocks (lavapipe's device memory is malloc'd) move from mmap into
    the heap and RSS creeps up for ~1000 cycles without any leak.  A fixed
    threshold returns freed blocks to the kernel: RSS then measures leaks."""
    import ctypes

    M_MMAP_THRESHOLD = -3
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 256 * 1024)


def test_500_cycles_hold_memory_flat(res, rng, tmp_path):
    from tests.engine.models_vision import write_mmproj
    from vramd.engine.vision import VisionEncoder
    pin_malloc_mmap_threshold()
    w = res.region("weights", "w", {"a": 2 * MiB, "b": MiB + 1})
    s = res.region("state", "kv", {"k": MiB})
    sc = res.region("scratch", "tmp", {"t": 2 * MiB})
    enc = VisionEncoder(str(write_mmproj(tmp_path / "mm.gguf", "mlp")), res)   # the daemon's encoder session
    step = StateStep(res)
    x = rng.integers(0, 2**32, MiB // 4, dtype=np.uint32)
    s.tensors["k"].write(x)

    def cycle(i):
        res.restore()
        sc.tensors["t"].buffer()
        step(s.tensors["k"], 5, i)
        with enc.session():
            pass
        res.release()

    for i in range(20):  # warm-up: descriptor and command pools, staging
        cycle(i)
        x = x * np.uint32(5) + np.uint32(i)
    res.drain()
    rss0, usage0, fds0 = rss_bytes(), res.heap_usage(), open_fds()
    per_cycle = sum(r.info()["bytes"] for r in (w, s, sc, enc.region, enc.act))

    for i in range(20, 520):
        cycle(i)
        x = x * np.uint32(5) + np.uint32(i)
    res.drain()

    assert res.heap_usage() == usage0  # device memory: back to the byte
    assert all(v["device"] == 0 for v in res.breakdown().values())
    grown = rss_bytes() - rss0
    # A leak of one cycle's buffers would be 500 x this; one command buffer
    # per step (6 KB) was 3 MiB.  Allow malloc noise well below that.
    assert grown < 2 * MiB, f"RSS grew {grown / MiB:.1f} MiB ({per_cycle / MiB:.1f} MiB moved per cycle)"
    assert open_fds() == fds0
    enc.close()
    assert np.array_equal(s.tensors["k"].read(np.uint32), x)
    step.close()

"""Tensors beyond maxStorageBufferRange are split into views; tensors beyond
maxMemoryAllocationSize are refused with a clear error."""
import numpy as np
import pytest

from vramd.errors import UsageError
from tests.gpu.state_step import StateStep

MiB = 1 << 20


def test_tensor_larger_than_storage_range_is_viewed_in_pieces(res, rng):
    rng_limit = res.limits["max_storage_range"]
    if rng_limit > 512 * MiB:
        pytest.skip("the device's storage range is too large to exceed cheaply")
    nbytes = rng_limit + 4 * MiB
    s = res.region("state", "big", {"small": 4096, "huge": nbytes})
    t = s.tensors["huge"]
    x = rng.integers(0, 2**32, nbytes // 4, dtype=np.uint32)
    t.write(x)
    res.restore(["state"])
    views = t.views()
    assert len(views) == 2
    assert all(n <= rng_limit and o % res.limits["storage_alignment"] == 0 for _, o, n in views)
    assert views[0][1] == t.offset and views[1][1] == views[0][1] + views[0][2]
    assert sum(n for _, _, n in views) == nbytes
    step = StateStep(res)
    step(t, 3, 11)  # one dispatch per view
    res.release(["state"])
    assert np.array_equal(t.read(np.uint32), x * np.uint32(3) + np.uint32(11))
    step.close()


def test_tensor_larger_than_one_allocation_is_refused(res):
    too_big = res.limits["max_allocation"] + 1
    with pytest.raises(UsageError, match="larger than the device's largest allocation"):
        res.region("weights", "w", {"t": too_big})
    assert res.regions == [] and res.breakdown()["weights"] == {"device": 0, "host": 0}


def test_tensor_size_that_would_wrap_when_rounded_is_refused(res):
    """2^64 - 1 rounded up to any granule wraps to a small size: refused, not passed."""
    with pytest.raises(UsageError, match="larger than the device's largest allocation"):
        res.region("weights", "w", {"t": (1 << 64) - 1})
    assert res.regions == [] and res.breakdown()["weights"] == {"device": 0, "host": 0}

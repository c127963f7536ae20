"""Breakdown per kind: device bytes and host bytes, released counts zero."""
import pytest

from vramd.errors import UsageError
from vramd.gpu.residency import KINDS

MiB = 1 << 20


def test_shape_and_numbers(res):
    w1 = res.region("weights", "a", {"x": 3 * MiB, "y": 5000})
    w2 = res.region("weights", "b", {"z": MiB // 2})
    s = res.region("state", "kv", {"k": 2 * MiB})
    e = res.region("encoder", "mmproj", {"e": MiB})
    sc = res.region("scratch", "tmp", {"t": MiB})
    b = res.breakdown()
    assert list(b) == list(KINDS) and all(set(v) == {"device", "host"} for v in b.values())
    # Released: shadows only, zero device bytes.
    assert b["weights"] == {"device": 0, "host": w1.info()["bytes"] + w2.info()["bytes"]}
    assert b["state"] == {"device": 0, "host": s.info()["bytes"]}
    assert b["encoder"] == {"device": 0, "host": e.info()["bytes"]}
    assert b["scratch"] == {"device": 0, "host": 0}
    # Host bytes are the blocks: tensors, alignment, page rounding.
    assert w1.info()["bytes"] >= 3 * MiB + 5000 and w1.info()["bytes"] % 65536 == 0

    res.restore()
    sc.tensors["t"].buffer()
    b = res.breakdown()
    assert b["weights"]["device"] == w1.info()["device"] + w2.info()["device"] >= b["weights"]["host"]
    assert b["state"]["device"] == s.info()["device"] >= s.info()["bytes"]
    assert b["encoder"]["device"] == 0  # just in time only
    assert b["scratch"] == {"device": sc.info()["device"], "host": 0} and sc.info()["device"] >= MiB

    res.release(["weights"])
    b = res.breakdown()
    assert b["weights"]["device"] == 0 and b["state"]["device"] > 0 and b["scratch"]["device"] > 0
    res.release()
    assert all(v["device"] == 0 for v in res.breakdown().values())


def test_unknown_kind_is_a_usage_error(res):
    with pytest.raises(UsageError, match="unknown region kind 'kv'"):
        res.release(["kv"])
    with pytest.raises(UsageError, match="unknown region kind"):
        res.region("kv", "x", {"t": 1})


def test_thousands_of_tensors_are_a_few_allocations(res, rng):
    import numpy as np

    sizes = {f"blk.{i}": int(n) for i, n in enumerate(rng.integers(1, 2000, 3000))}
    w = res.region("weights", "many", sizes)
    info = w.info()
    # 3000 tensors of < 2 KB, 256-byte aligned, in 1 MiB blocks.
    assert info["tensors"] == 3000 and info["blocks"] <= 8
    picks = [w.tensors[f"blk.{i}"] for i in (0, 1, 1500, 2999)]
    data = [rng.integers(0, 256, t.nbytes, dtype=np.uint8) for t in picks]
    for t, d in zip(picks, data):
        t.host()[:] = d
    res.restore(["weights"])
    assert all(np.array_equal(t.read(), d) for t, d in zip(picks, data))
    places = sorted((t.block, t.offset, t.offset + t.nbytes) for t in w.tensors.values())
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(places, places[1:]))  # no overlap

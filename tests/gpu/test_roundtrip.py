"""Release/restore cycles of every kind, bit for bit."""
import numpy as np
import pytest

from vramd.errors import UsageError
from tests.gpu.state_step import StateStep

MiB = 1 << 20
# Sizes that cross the 1 MiB blocks of the `res` fixture in every way: a
# tensor larger than a block, odd sizes, one byte.
SIZES = {"big": 2 * MiB + 12345, "odd": 700_001, "one": 1, "page": 65536, "tail": 333_333}


def fill(region, rng):
    data = {}
    for name, t in region.tensors.items():
        data[name] = rng.integers(0, 256, t.nbytes, dtype=np.uint8)
        t.host()[:] = data[name]
    return data


def test_weights_bit_exact_over_200_cycles(res, rng):
    w = res.region("weights", "backbone", SIZES)
    assert w.info()["blocks"] >= 3
    data = fill(w, rng)
    for cycle in range(200):
        res.restore(["weights"])
        if cycle % 10 == 0 or cycle == 199:
            for name, t in w.tensors.items():
                assert np.array_equal(t.read(), data[name]), (cycle, name)  # the device copy
        res.release(["weights"])
        assert w.info()["device"] == 0
    for name, t in w.tensors.items():
        assert np.array_equal(t.host(), data[name])  # the shadow was never written


def test_state_changed_by_compute_is_preserved(res, rng):
    step = StateStep(res)
    s = res.region("state", "kv", {"k": 3 * MiB, "v": 1 * MiB + 4096})
    ref = {n: rng.integers(0, 2**32, t.nbytes // 4, dtype=np.uint32) for n, t in s.tensors.items()}
    for n, t in s.tensors.items():
        t.write(ref[n])
    for cycle in range(100):
        res.restore(["state"])
        mul, add = 2 * cycle + 3, 7 * cycle + 1
        for n, t in s.tensors.items():
            step(t, mul, add)
            ref[n] = ref[n] * np.uint32(mul) + np.uint32(add)
        res.release(["state"])  # waits for the steps, copies back, frees
        assert s.info()["device"] == 0
        if cycle % 10 == 0 or cycle == 99:
            for n, t in s.tensors.items():
                assert np.array_equal(t.read(np.uint32), ref[n]), (cycle, n)  # from the shadow
    step.close()


def test_release_waits_for_inflight_compute(res, rng):
    step = StateStep(res)
    s = res.region("state", "kv", {"k": 8 * MiB})
    x = rng.integers(0, 2**32, 2 * MiB, dtype=np.uint32)
    s.tensors["k"].write(x)
    res.restore(["state"])
    for i in range(20):  # queued, not waited for
        step(s.tensors["k"], 3, i)
        x = x * np.uint32(3) + np.uint32(i)
    res.release(["state"])
    assert np.array_equal(s.tensors["k"].read(np.uint32), x)
    step.close()


def test_state_kept_resident_when_policy_says_so(res, rng):
    s = res.region("state", "kv", {"k": MiB}, evict=False)
    x = rng.integers(0, 256, MiB, dtype=np.uint8)
    s.tensors["k"].write(x)
    res.restore(["state"])
    res.release(["state"])
    assert s.resident and s.info()["device"] > 0
    s.release()  # explicit: copies back whatever the policy
    assert not s.resident and np.array_equal(s.tensors["k"].read(), x)


def test_encoder_just_in_time_evicts_weights_when_tight(res, rng, tmp_path):
    # The daemon's encoder session (VisionEncoder.session), over raw weights and state.
    from tests.engine.models_vision import write_mmproj
    from vramd.engine.vision import VisionEncoder
    w = res.region("weights", "backbone", {"w": 3 * MiB})
    s = res.region("state", "kv", {"k": MiB})
    enc = VisionEncoder(str(write_mmproj(tmp_path / "mm.gguf", "mlp")), res)
    try:
        e = enc.region
        wd, sd = fill(w, rng), fill(s, rng)
        ed = {n: t.host().copy() for n, t in e.tensors.items()}
        res.restore()  # weights and state; the encoder stays in host memory
        assert not e.resident
        with enc.session() as phases:  # fits: nothing else moves
            assert e.resident and w.resident and not phases["evicted_weights"]
            assert all(np.array_equal(t.read(), ed[n]) for n, t in e.tensors.items())
        assert not e.resident and not enc.act.resident and w.resident
        # Now the device holds the weights and the state only: one byte short of room for the
        # encoder and its activations beside them (the weights' room is more than enough).
        beside = w.info()["device"] + s.info()["device"] + e.info()["bytes"] + enc.act.info()["bytes"]
        res.set_device_limit(beside - 1)
        with enc.session() as phases:
            assert e.resident and not w.resident and s.resident and phases["evicted_weights"]  # KV untouched
            assert all(np.array_equal(t.read(), ed[n]) for n, t in e.tensors.items())
        assert not e.resident and w.resident and s.resident
        assert np.array_equal(w.tensors["w"].read(), wd["w"])
        assert np.array_equal(s.tensors["k"].read(), sd["k"])
    finally:
        res.set_device_limit(0)
        enc.close()


def test_scratch_freed_without_copy_and_recreated_lazily(res):
    sc = res.region("scratch", "compute", {"a": 2 * MiB, "b": 100})
    assert sc.info()["host"] == 0 and not sc.resident
    res.restore()  # scratch is not restored eagerly
    assert not sc.resident
    buf, off = sc.tensors["b"].buffer()  # first use creates it
    assert buf and sc.resident and sc.info()["device"] >= 2 * MiB
    sc.tensors["a"].write(np.full(2 * MiB, 7, np.uint8))
    assert (sc.tensors["a"].read() == 7).all()
    res.release(["scratch"])
    assert not sc.resident and res.breakdown()["scratch"] == {"device": 0, "host": 0}
    with pytest.raises(UsageError, match="scratch and released"):
        sc.tensors["a"].read()


def test_double_release_and_restore_are_noops(res, rng):
    w = res.region("weights", "w", {"t": 3 * MiB})
    data = fill(w, rng)
    res.release()
    res.release(["weights"])
    res.restore(["weights"])
    held = res.breakdown()
    usage = res.heap_usage()
    res.restore(["weights"])
    w.restore()
    assert res.breakdown() == held and res.heap_usage() == usage
    res.release(["weights"])
    res.release(["weights"])
    w.release()
    assert res.breakdown()["weights"]["device"] == 0
    res.restore(["weights"])
    assert np.array_equal(w.tensors["t"].read(), data["t"])


def test_device_access_to_released_weights_is_refused(res):
    w = res.region("weights", "w", {"t": 4096})
    with pytest.raises(UsageError, match="'w' \\(weights\\) is released: restore it first"):
        w.tensors["t"].buffer()

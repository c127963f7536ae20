"""Failpoints in the residency core: a fault between two steps of a release or a
restore leaves every region consistent, and a state shadow is always a
complete copy (the previous one or the new one), never a mix.

The daemon-level tests (kill and raise at every failpoint, two daemons) are
tests/integration/test_failpoints.py; these check the core's promises byte by
byte, in one process."""

import numpy as np
import pytest

from vramd import failpoints
from vramd.errors import DeviceError, InjectedFault, UsageError
from tests.gpu.state_step import StateStep
from vramd.gpu.residency import native_failpoints

MiB = 1 << 20


@pytest.fixture(autouse=True)
def disarmed():
    failpoints.arm("")
    yield
    failpoints.arm("")


def u32(rng, nbytes):
    return rng.integers(0, 2**32, nbytes // 4, dtype=np.uint32)


def shadow(region) -> dict:
    """The shadow's bytes, even while the region is resident (Tensor.read would read the device)."""
    return {n: t.host().view(np.uint32).copy() for n, t in region.tensors.items()}


def device(region) -> dict:
    assert region.resident
    return {n: t.read(np.uint32) for n, t in region.tensors.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture
def kv(res, rng):
    """A state region of several blocks with a first content evicted once (shadow generation 1),
    then restored and changed on the device by compute: device != shadow."""
    step = StateStep(res)
    s = res.region("state", "kv", {"k": 3 * MiB, "v": 2 * MiB + 4096})
    old = {n: u32(rng, t.nbytes) for n, t in s.tensors.items()}
    for n, t in s.tensors.items():
        t.write(old[n])
    res.restore(["state"])
    res.release(["state"])
    assert s.info()["shadow_generation"] == 1 and s.info()["shadow_valid"]
    res.restore(["state"])
    new = {}
    for n, t in s.tensors.items():
        step(t, 5, 11)
        new[n] = old[n] * np.uint32(5) + np.uint32(11)
    res.sync()
    yield s, old, new
    step.close()


def test_native_and_python_tables_name_the_same_native_points():
    assert native_failpoints() == [n for n, (side, _) in failpoints.POINTS.items() if side == "native"]


def test_a_fault_mid_eviction_keeps_the_device_copy_and_the_previous_complete_shadow(res, kv):
    s, old, new = kv
    failpoints.arm("evict.mid=raise")
    with pytest.raises(DeviceError, match="failpoint evict.mid: injected fault"):
        res.release(["state"])
    info = s.info()
    assert info["resident"] and info["device"] > 0
    assert same(device(s), new)                      # the device copy is untouched and still the truth
    assert same(shadow(s), old)                      # the shadow is the previous complete copy...
    assert info["shadow_generation"] == 1 and info["shadow_valid"]   # ...and says so
    res.release(["state"])                           # the failpoint fired once: the retry completes
    assert s.info()["shadow_generation"] == 2 and not s.resident
    assert same({n: t.read(np.uint32) for n, t in s.tensors.items()}, new)


def test_a_fault_after_the_eviction_copy_keeps_both_copies_and_frees_nothing(res, kv):
    s, _old, new = kv
    failpoints.arm("evict.copied=raise")
    with pytest.raises(DeviceError, match="evict.copied"):
        res.release(["state"])
    info = s.info()
    assert info["resident"] and info["shadow_valid"] and info["shadow_generation"] == 2
    assert same(device(s), new) and same(shadow(s), new)   # the new complete copy, device not yet freed
    res.release(["state"])
    assert not s.resident and s.info()["shadow_generation"] == 3
    res.restore(["state"])
    assert same(device(s), new)


def test_a_fault_between_regions_leaves_each_region_wholly_released_or_wholly_resident(res, rng):
    w = res.region("weights", "w", {"a": 2 * MiB + 5})
    s = res.region("state", "s", {"k": MiB})
    sc = res.region("scratch", "sc", {"x": MiB})
    wd, sd = u32(rng, w.tensors["a"].nbytes // 4 * 4), u32(rng, MiB)
    w.tensors["a"].host()[: wd.nbytes] = wd.view(np.uint8)
    s.tensors["k"].write(sd)
    res.restore(["weights", "state"])
    sc.tensors["x"].buffer()
    failpoints.arm("release.mid=raise")
    with pytest.raises(DeviceError, match="release.mid"):
        res.release()
    # Three regions, the fault before the second: the first is released, the others whole.
    assert [r.resident for r in (w, s, sc)] == [False, True, True]
    assert w.info()["device"] == 0 and s.info()["device"] > 0 and sc.info()["device"] > 0
    b = res.breakdown()
    assert b["weights"]["device"] == 0 and b["state"]["device"] == s.info()["device"]
    assert s.info()["shadow_generation"] == 1          # the state was copied before anything was freed
    res.release()
    assert all(not r.resident for r in (w, s, sc)) and sum(v["device"] for v in res.breakdown().values()) == 0
    res.restore(["weights", "state"])
    assert np.array_equal(w.tensors["a"].read(np.uint32, 0, wd.nbytes), wd)
    assert np.array_equal(s.tensors["k"].read(np.uint32), sd)


def test_a_fault_mid_restore_leaves_everything_released_with_the_shadows_intact(res, rng):
    w = res.region("weights", "w", {f"t{i}": MiB for i in range(4)})
    s = res.region("state", "s", {"k": MiB})
    data = {n: u32(rng, MiB) for n in w.tensors}
    for n, t in w.tensors.items():
        t.host()[:] = data[n].view(np.uint8)
    usage = res.heap_usage()
    failpoints.arm("restore.mid=raise")
    with pytest.raises(DeviceError, match="restore of the requested regions failed, left released"):
        res.restore(["weights", "state"])
    assert not w.resident and not s.resident and res.heap_usage() == usage
    res.restore(["weights", "state"])
    assert same({n: t.read(np.uint32) for n, t in w.tensors.items()}, data)


def test_at_n_counts_hits_and_log_reports_every_hit(res, capfd):
    w = res.region("weights", "w", {"a": MiB, "b": MiB})
    w2 = res.region("weights", "w2", {"a": MiB})
    failpoints.arm("restore.mid=raise@2")
    res.restore(["weights"])                          # hit 1 passes
    res.release(["weights"])
    with pytest.raises(DeviceError, match="restore.mid"):
        res.restore(["weights"])                      # hit 2 fails
    res.restore(["weights"])                          # hit 3 passes again
    failpoints.arm("release.mid=log")
    res.release(["weights"])
    res.restore(["weights"])
    res.release(["weights"])
    assert capfd.readouterr().err.count("vramd: failpoint release.mid reached") == 2   # once per release
    assert not w.resident and not w2.resident


def test_python_failpoints_raise_an_injected_fault_once():
    failpoints.arm("warm.after_token=raise@2")
    failpoints.failpoint("warm.after_token")
    with pytest.raises(InjectedFault, match="failpoint warm.after_token: injected fault"):
        failpoints.failpoint("warm.after_token")
    failpoints.failpoint("warm.after_token")
    assert InjectedFault.exit_code == DeviceError.exit_code


@pytest.mark.parametrize("spec, why", [
    ("warm.after_tokn=raise", "unknown failpoint"), ("restore.mid=explode", "action"),
    ("restore.mid", "unknown failpoint"), ("restore.mid=kill@0", "positive"), ("restore.mid=kill@x", "positive"),
])
def test_a_bad_spec_is_a_usage_error_naming_it(spec, why):
    with pytest.raises(UsageError, match=why):
        failpoints.arm(spec)


def test_an_unarmed_failpoint_only_tests_one_global(monkeypatch):
    """'Free' when off: failpoint() tests the armed set and returns, looking up
    nothing (its cost is measured, not asserted here: vramd/failpoints.py)."""
    def must_not_run(name):
        raise AssertionError(f"_fire({name!r}) ran with nothing armed")
    failpoints.arm("")
    monkeypatch.setattr(failpoints, "_fire", must_not_run)
    for name in failpoints.POINTS:
        assert failpoints.failpoint(name) is None
    failpoints.arm("warm.after_token=log")  # armed: the lookup happens
    try:
        with pytest.raises(AssertionError, match="_fire"):
            failpoints.failpoint("warm.after_token")
    finally:
        failpoints.arm("")

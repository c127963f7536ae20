"""Native errors become vramd errors carrying the native message."""
import pytest

from vramd.errors import DeviceError, OutOfDeviceMemory, UsageError
from vramd.gpu.residency import check, kind_mask, lib


def test_check_maps_status_and_keeps_the_native_message(res):
    r = res.region("weights", "w", {"t": 100})
    with pytest.raises(UsageError, match=r"region 'w' tensor 0: bytes 90..110 are outside its 100 bytes"):
        r.tensors["t"].read(offset=90, nbytes=20)
    check(lib.VRAMD_OK)
    assert issubclass(OutOfDeviceMemory, DeviceError)


def test_sealed_region_takes_no_more_tensors(res):
    r = res.region("state", "s", {"t": 100})
    from vramd.gpu.residency import ffi
    with pytest.raises(UsageError, match="region 's' is sealed"):
        check(lib.vramd_region_add_tensor(r._r, 10, ffi.new("uint32_t*")))


def test_kind_mask():
    assert kind_mask("weights") == 1 and kind_mask(["state", "scratch"]) == 0b1010
    with pytest.raises(UsageError):
        kind_mask(["weights", "nope"])

"""Fixtures for the engine tests: real Vulkan, on Mesa's lavapipe unless
VRAMD_TEST_DEVICE=native (the same rule as tests/gpu/conftest.py; the driver
is chosen through VK_DRIVER_FILES before the loader is first used)."""
import os
import pathlib

import numpy as np
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


@pytest.fixture(scope="module")
def res(device):
    """A residency core per test module (its regions are the module's buffers)."""
    from vramd.gpu.residency import Residency

    r = Residency(device)
    yield r
    r.close()


@pytest.fixture(scope="module")
def ops(res):
    """The kernel kit over the module's residency core."""
    from vramd.engine.ops import Ops

    o = Ops(res)
    yield o
    o.close()


@pytest.fixture
def rng():
    return np.random.default_rng(20261130)


@pytest.fixture
def bufs(res):
    """bufs(kind, name=array or nbytes, ...) -> {name: Tensor}, uploaded and
    resident; every region made is destroyed after the test."""
    made = []

    def make(kind="state", **items):
        sizes = {k: (v.nbytes if isinstance(v, np.ndarray) else int(v)) for k, v in items.items()}
        r = res.region(kind, f"{kind}{len(made)}", sizes)
        made.append(r)
        for k, v in items.items():
            if isinstance(v, np.ndarray):
                r.tensors[k].write(v)
        r.restore()
        return r.tensors

    yield make
    res.sync()
    for r in made:
        r.destroy()


@pytest.fixture(params=["gpu-form", "cpu-form"])
def linear_form(ops, request):
    """Both matvec forms on the one test device: linear.select() picks the
    row-per-invocation kernels (matvec_c_<type>) on a CPU device such as
    lavapipe and the subgroup ones elsewhere; tests of matvec run each."""
    was = ops.cpu
    ops.cpu = request.param == "cpu-form"
    yield request.param
    ops.cpu = was

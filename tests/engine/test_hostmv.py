"""The native host matvec (vramd/engine/hostmv.py, native/src/hostmv.c) against numpy.

The reference dequantizes with gguf.quants (an implementation that shares
nothing with the C kernels) and multiplies in float64; the kernels
accumulate in float32, so results agree to ~1e-6 relative.  No device is
needed: the host matvec is plain CPU code in the native core.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from vramd.engine import hostmv
from vramd.errors import UsageError

TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "MXFP4": Q.MXFP4}
BLOCKED = {"Q8_0", "Q4_0", "MXFP4"}   # rows are whole blocks of 32
TOL = 1e-5


@pytest.fixture
def threads():
    """Sets the pool's size for a test and puts the default back after it."""
    yield hostmv.set_threads
    hostmv.set_threads(0)


def quantized(rng, rows: int, cols: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A random matrix as GGUF bytes [rows, row_bytes] and as what they mean (float64)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = np.ascontiguousarray(quants.quantize(w, TYPES[name])).view(np.uint8).reshape(rows, -1)
    exact = quants.dequantize(raw, TYPES[name]).reshape(rows, cols).astype(np.float64)
    return raw, exact


def rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("rows", [1, 7, 37, 333])
def test_each_type_matches_numpy(rng, name, rows):
    for cols in ([32, 96, 2048] if name in BLOCKED else [1, 19, 100, 2048]):
        raw, w = quantized(rng, rows, cols, name)
        x = rng.standard_normal(cols).astype(np.float32)
        y = hostmv.matvec(raw, int(TYPES[name]), rows, cols, x)
        assert y.shape == (rows,) and y.dtype == np.float32
        assert rel_err(y, w @ x) < TOL, (name, rows, cols)


@pytest.mark.parametrize("name", list(TYPES))
def test_several_vectors_in_one_job(rng, name):
    rows, cols = 45, 160
    raw, w = quantized(rng, rows, cols, name)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    y = hostmv.matvec(raw, int(TYPES[name]), rows, cols, x)
    assert y.shape == (5, rows)
    assert rel_err(y, x @ w.T) < TOL


def test_q8_0_as_moe_computed_it_before(rng):
    """Q8_0 against the numpy formula vramd used before the native path
    (scale times the int8 dot of each block), on an expert's shape."""
    rows, cols = 768, 2048
    raw, _ = quantized(rng, rows, cols, "Q8_0")
    x = rng.standard_normal(cols).astype(np.float32)
    blocks = raw.reshape(rows, cols // 32, 34)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float64)[:, :, 0]
    q = blocks[:, :, 2:].view(np.int8).astype(np.float64)
    want = (np.einsum("rbk,bk->rb", q, x.reshape(cols // 32, 32).astype(np.float64)) * d).sum(axis=1)
    assert rel_err(hostmv.matvec(raw, int(Q.Q8_0), rows, cols, x), want) < TOL


@pytest.mark.parametrize("cols", [16, 1])   # the vector loop, and the scalar tail
def test_every_f16_value_converts_exactly(cols):
    """All 65536 halves (subnormals, -0, Inf, NaN) through the kernel: with x
    one-hot, each output is one weight times 1 plus exact zeros."""
    w = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(-1, cols)
    eye = np.eye(cols, dtype=np.float32)
    y = hostmv.matvec(w.view(np.uint8), int(Q.F16), len(w), cols, eye)
    with np.errstate(invalid="ignore"):
        want = np.einsum("rc,vc->vr", w.astype(np.float32), eye)   # 0 * Inf is NaN here too
    np.testing.assert_array_equal(y, want)


def test_every_bf16_value_converts_exactly():
    bits = np.arange(65536, dtype=np.uint32)
    w = bits.astype(np.uint16).reshape(-1, 16)
    eye = np.eye(16, dtype=np.float32)
    y = hostmv.matvec(w.view(np.uint8), int(Q.BF16), len(w), 16, eye)
    with np.errstate(invalid="ignore"):
        want = np.einsum("rc,vc->vr", (w.astype(np.uint32) << 16).view(np.float32), eye)
    np.testing.assert_array_equal(y, want)


def test_thread_counts_give_the_same_bits(rng, threads):
    """Every row is computed by one thread with the same code: the pool's
    size changes who computes it, not the result."""
    raw, _ = quantized(rng, 1000, 512, "Q8_0")
    x = rng.standard_normal((3, 512)).astype(np.float32)
    results = []
    for n in (1, 2, 3, 7):
        threads(n)
        assert hostmv.threads() == n
        results.append(hostmv.matvec(raw, int(Q.Q8_0), 1000, 512, x))
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])


def test_default_pool_is_sized_to_the_usable_cpus(threads):
    import os

    threads(0)
    assert hostmv.threads() == min(len(os.sched_getaffinity(0)), 16)


@pytest.mark.parametrize("n_threads", [1, 4])
def test_batched_jobs_equal_each_job_alone(rng, threads, n_threads):
    """One call of many jobs of mixed types, shapes and vector counts, some
    reading the same x (the core permutes it once per way of reading it),
    some empty, equals the jobs one at a time."""
    threads(n_threads)
    cols = 256
    x = rng.standard_normal((4, cols)).astype(np.float32)
    specs = [("Q8_0", 768, 1), ("F16", 33, 1), ("Q8_0", 5, 1), ("Q4_0", 64, 4), ("BF16", 17, 2),
             ("F32", 9, 3), ("Q8_0", 0, 1), ("Q4_0", 3, 0), ("Q8_0", 100, 2)]
    mats = [quantized(rng, max(rows, 1), cols, name)[0][:rows] for name, rows, _ in specs]
    outs = [np.full((n, rows), np.nan, dtype=np.float32) for _, rows, n in specs]
    jobs = np.zeros(len(specs), hostmv.JOB)
    for i, ((name, rows, n), raw, y) in enumerate(zip(specs, mats, outs)):
        raw = mats[i] = np.ascontiguousarray(raw)
        jobs[i] = (hostmv.address(raw), hostmv.address(x), hostmv.address(y), int(TYPES[name]), rows, cols, n)
    hostmv.run(jobs)
    for (name, rows, n), raw, y in zip(specs, mats, outs):
        if rows and n:
            np.testing.assert_array_equal(y, hostmv.matvec(raw, int(TYPES[name]), rows, cols, x[:n]))


def test_many_jobs_sharing_one_input(rng, threads):
    """A prefill-sized call: 200 jobs, 64 of them in a row on one x (past the
    window the core looks back over to share a permuted copy)."""
    threads(3)
    cols, rows = 64, 40
    experts = [quantized(rng, rows, cols, "Q8_0") for _ in range(200)]
    x = rng.standard_normal((2, cols)).astype(np.float32)
    ys = np.empty((200, rows), dtype=np.float32)
    jobs = np.zeros(200, hostmv.JOB)
    for i, (raw, _) in enumerate(experts):
        jobs[i] = (hostmv.address(raw), hostmv.address(x[i % 2 if i >= 64 else 0]), hostmv.address(ys[i]),
                   int(Q.Q8_0), rows, cols, 1)
    hostmv.run(jobs)
    for i, (_, w) in enumerate(experts):
        assert rel_err(ys[i], w @ x[i % 2 if i >= 64 else 0]) < TOL


def test_bad_jobs_are_usage_errors(rng):
    raw, _ = quantized(rng, 4, 64, "Q8_0")
    x = np.ones(64, dtype=np.float32)
    y = np.empty(4, dtype=np.float32)

    def job(**change):
        j = np.zeros(1, hostmv.JOB)
        j[0] = (hostmv.address(raw), hostmv.address(x), hostmv.address(y), int(Q.Q8_0), 4, 64, 1)
        for k, v in change.items():
            j[k] = v
        return j

    with pytest.raises(UsageError, match="type 12 is not one the host matvec reads"):
        hostmv.run(job(type=int(Q.Q4_K)))
    with pytest.raises(UsageError, match="48 columns of type 8"):
        hostmv.run(job(cols=48))
    with pytest.raises(UsageError, match="NULL"):
        hostmv.run(job(y=0))
    with pytest.raises(UsageError, match="columns"):
        hostmv.run(job(type=int(Q.F32), cols=0))
    with pytest.raises(UsageError, match="hostmv.JOB"):
        hostmv.run(np.zeros(3, np.uint64))
    with pytest.raises(UsageError, match="not 0..256"):
        hostmv.set_threads(100000)
    with pytest.raises(UsageError, match="does not read"):
        hostmv.matvec(raw, int(Q.Q4_K), 4, 64, x)
    with pytest.raises(UsageError, match="bytes, not"):
        hostmv.matvec(raw[:3], int(Q.Q8_0), 4, 64, x)
    assert not hostmv.supports(int(Q.Q8_0), 48) and hostmv.supports(int(Q.F16), 48)


def test_a_forked_child_gets_a_pool_of_its_own(rng, threads):
    """fork() copies the pool's state but none of its threads: the child
    starts a pool of its own on its first call instead of waking no one."""
    import os

    threads(3)
    raw, w = quantized(rng, 300, 128, "Q8_0")
    x = rng.standard_normal(128).astype(np.float32)
    want = hostmv.matvec(raw, int(Q.Q8_0), 300, 128, x)
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child reports through its exit status
        ok = hostmv.threads() == min(len(os.sched_getaffinity(0)), 16) and np.array_equal(
            hostmv.matvec(raw, int(Q.Q8_0), 300, 128, x), want)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(hostmv.matvec(raw, int(Q.Q8_0), 300, 128, x), want)   # the parent's pool still works

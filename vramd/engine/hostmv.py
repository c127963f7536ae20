"""The native host matvec (native/include/vramd/hostmv.h): y = W x on the CPU,
straight from a GGUF tensor's bytes, for the expert tensors `--n-cpu-moe`
keeps in host memory.

    jobs = np.zeros(2, hostmv.JOB)            # one row per (matrix, inputs, outputs)
    jobs["w"] = hostmv.address(raw) + ...     # the arrays stay alive until run() returns
    ...
    hostmv.run(jobs)                          # one call: every job, on the whole thread pool

or, for one matrix, `hostmv.matvec(raw, type, rows, cols, x)`.  The types
are F32, F16, BF16, Q8_0, Q4_0 and MXFP4 (`supports`); others (K-quants) are for
the caller to dequantize (vramd/engine/moe.py does, with gguf.quants).  The
pool has one thread per CPU the process may use, at most 16, unless
`set_threads` says otherwise.
"""

from __future__ import annotations

import numpy as np

from vramd.errors import UsageError
from vramd.gpu.residency import check, ffi, lib

# vramd_hostmv_job, field for field: a job array is filled by numpy (a whole
# token's experts in a few vector operations) and handed over as it is.
JOB = np.dtype([("w", "<u8"), ("x", "<u8"), ("y", "<u8"), ("type", "<u4"), ("rows", "<u4"),
                ("cols", "<u4"), ("n", "<u4")])
if JOB.itemsize != ffi.sizeof("vramd_hostmv_job"):  # pragma: no cover - a header changed without this
    raise ImportError(f"vramd_hostmv_job is {ffi.sizeof('vramd_hostmv_job')} bytes, JOB {JOB.itemsize}")

TYPES = {lib.VRAMD_HOSTMV_F32: "F32", lib.VRAMD_HOSTMV_F16: "F16", lib.VRAMD_HOSTMV_Q4_0: "Q4_0",
         lib.VRAMD_HOSTMV_Q8_0: "Q8_0", lib.VRAMD_HOSTMV_BF16: "BF16", lib.VRAMD_HOSTMV_MXFP4: "MXFP4"}


def row_bytes(type_id: int, cols: int) -> int:
    """Bytes of a row of `cols` elements; 0 if the host matvec cannot read it."""
    return int(lib.vramd_hostmv_row_bytes(int(type_id), int(cols))) if 0 < cols < 2**32 else 0


def supports(type_id: int, cols: int) -> bool:
    return row_bytes(type_id, cols) > 0


def address(a: np.ndarray) -> int:
    """The address of a contiguous array's first byte (for JOB's w, x and y).
    Through cffi: numpy's __array_interface__ costs ~10x more, and a decode
    step asks for a dozen of these per host layer."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(a)))


def run(jobs: np.ndarray) -> None:
    """Runs a JOB array in one native call.  The caller keeps every array
    the addresses point into alive until this returns (the GIL is released
    meanwhile)."""
    if jobs.dtype != JOB or not jobs.flags.c_contiguous:
        raise UsageError("host matvec jobs must be a contiguous array of hostmv.JOB")
    if len(jobs):
        check(lib.vramd_hostmv(ffi.from_buffer("vramd_hostmv_job[]", jobs), len(jobs)))


def matvec(w: np.ndarray, type_id: int, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """W x for one matrix: `w` its GGUF bytes (rows x row_bytes), x [cols] or
    [n, cols] (float32); y [rows] or [n, rows]."""
    rb = row_bytes(type_id, cols)
    if not rb:
        raise UsageError(f"the host matvec does not read type {type_id} with {cols} columns")
    w = np.ascontiguousarray(w).reshape(-1).view(np.uint8)
    if w.nbytes != rows * rb:
        raise UsageError(f"a {rows} x {cols} matrix of type {TYPES[type_id]} is {rows * rb} bytes, not {w.nbytes}")
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, cols)
    y = np.empty((len(x2), rows), dtype=np.float32)
    job = np.zeros(1, JOB)
    job[0] = (address(w), address(x2), address(y), type_id, rows, cols, len(x2))
    run(job)
    return y if np.ndim(x) == 2 else y[0]


def threads() -> int:
    """Threads a call runs on, the caller included."""
    return int(lib.vramd_hostmv_threads())


def set_threads(n: int = 0) -> None:
    """Resizes the pool (0: one thread per usable CPU, at most 16).  Joins
    the old threads and starts new ones: for setup, not per call."""
    if not 0 <= n <= lib.VRAMD_HOSTMV_MAX_THREADS:
        raise UsageError(f"host matvec threads: {n}, not 0..{lib.VRAMD_HOSTMV_MAX_THREADS}")
    check(lib.vramd_hostmv_set_threads(n))

"""Kernel-level A/B of linear kernels on a CPU device (lavapipe), same data, rounds alternating.

    VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json \\
    python scripts/cpu_kernel_ab.py Q8_0 262144 640 1 matvec_c_q8_0_any,matvec_c_q8_0 6

Arguments: weight type, rows, columns, tokens, kernel names (native/shaders/<name>.spv: an old
form can be compiled there under another name), rounds.  One random weight (the tests'
generators, tests/engine/test_kernels*.py) is uploaded once; each round runs every kernel once
to warm it and once timed (ops.matvec then sync, wall time), the order reversed every other
round so that a shared machine's load falls on all alike; every result is checked against numpy.
Prints the median and min per kernel and the load average.  A development tool, not a test.
"""
import os
import sys
import time

os.environ.setdefault("VK_DRIVER_FILES", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from vramd.engine import linear  # noqa: E402
from vramd.engine.ops import Ops, Weight  # noqa: E402
from vramd.gpu.device import Device  # noqa: E402
from vramd.gpu.residency import Residency  # noqa: E402
from tests.engine.test_kernels import weights  # noqa: E402
from tests.engine.test_kernels_kquants import TYPES as K_TYPES, blocks  # noqa: E402


def main(qname, rows, cols, n_tokens, names, rounds):
    qt, rows, cols, nt, rounds = Q[qname], int(rows), int(cols), int(n_tokens), int(rounds)
    names = names.split(",")
    rng = np.random.default_rng(1)
    raw, w = (blocks if qt in K_TYPES else weights)(rng, qt, rows, cols)
    x = rng.standard_normal((nt, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    ops = Ops(Residency(Device()))
    regions = []

    def region(kind, **items):
        r = ops.residency.region(kind, kind, {k: v.nbytes for k, v in items.items()})
        for k, v in items.items():
            r.tensors[k].write(v)
        r.restore()
        regions.append(r)
        return r.tensors

    wt = region("weights", w=np.ascontiguousarray(raw).reshape(-1).view(np.uint8))["w"]
    t = region("state", x=x, y=np.zeros(nt * rows, np.float32))
    ops.cpu, ops.coopmat = True, False
    select, times = linear.select, {n: [] for n in names}
    for rd in range(rounds):
        for n in (names if rd % 2 == 0 else names[::-1]):
            per = (linear.MATVEC_ROWS_C[qname.lower()], 1) if nt < linear.MATMUL_FROM else \
                (linear.MATMUL_C_ROWS, linear.MATMUL_C_TOKENS)
            linear.select = lambda *a, _n=n, _p=per, **k: linear.LinearKernel(_n, *_p)
            for timed in (False, True):
                t0 = time.perf_counter()
                ops.matvec(Weight(wt, qt, rows, cols), t["x"], t["y"], nt)
                ops.sync()
                if timed:
                    times[n].append(time.perf_counter() - t0)
            y = t["y"].read(np.float32).reshape(nt, rows)
            assert np.max(np.abs(y - ref)) <= 1e-3 * np.max(np.abs(ref)), f"{n}: wrong result"
    linear.select = select
    for n in names:
        v = times[n]
        print(f"{n:24s} median {1e3 * np.median(v):8.1f} ms  min {1e3 * min(v):8.1f}  rounds {[round(1e3 * s) for s in v]}")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main(*sys.argv[1:7])

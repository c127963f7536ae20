"""Kernel-level A/B of the recurrent delta-rule forms (gated_delta, gated_delta_split), same data,
rounds alternating: scripts/cpu_kernel_ab.py's method for vramd/engine/deltanet.py's kernels.

    python scripts/delta_kernel_ab.py 16 48 128 1 200 [n_seq]

Arguments: key heads, value heads, head size, tokens, rounds, and optionally sequences (a
parallel-slots decode step: one token of each of n_seq sequences, the seq-id dispatch; tokens
is then ignored).  Defaults to a CPU device (lavapipe) as cpu_kernel_ab.py does; set
VK_DRIVER_FILES to another ICD to run it elsewhere.  Each round runs each form once to warm it
and `REPS` (20) times in one command buffer, timed from submit to sync (wall time: a
dispatch's cost plus one submit shared by the 20), the order reversed every other round; each
form's output and state are checked against the other's (the tests' 1e-5 of scale).  Prints the
median and min per form and the load average.  A development tool, not a test.
"""
import os
import sys
import time

os.environ.setdefault("VK_DRIVER_FILES", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from vramd.engine import deltanet  # noqa: E402
from vramd.engine.ops import Ops, view  # noqa: E402
from vramd.gpu.device import Device  # noqa: E402
from vramd.gpu.residency import Residency  # noqa: E402
from tests.engine.test_deltanet_kernels import delta_inputs  # noqa: E402

REPS = 20
FORMS = {"gated_delta": "0", "gated_delta_split": "1"}


def main(hk, hv, s, n, rounds, n_seq=0):
    hk, hv, s, n, rounds, n_seq = int(hk), int(hv), int(s), int(n), int(rounds), int(n_seq)
    n = n_seq or n
    rng = np.random.default_rng(1)
    conv, alpha, beta, dt, a, state = delta_inputs(rng, n, s, hk, hv)
    states = np.concatenate([state[None]] * max(1, n_seq)).reshape(-1)
    ops = Ops(Residency(Device()))
    seqs = np.arange(max(1, n_seq), dtype=np.int32)[::-1].copy()   # token t continues sequence n_seq - 1 - t
    items = dict(conv=conv, alpha=alpha, beta=beta, dt=dt, a=a, seqs=seqs)
    r = ops.residency.region("state", "ab", {**{k: v.nbytes for k, v in items.items()}, "st0": states.nbytes,
                                             **{f"st_{f}": states.nbytes for f in FORMS},
                                             **{f"out_{f}": 4 * n * hv * s for f in FORMS}})
    for k, v in items.items():
        r.tensors[k].write(v)
    r.restore()
    t = r.tensors
    times = {f: [] for f in FORMS}
    seq = dict(seq=t["seqs"], n_seq=n_seq) if n_seq else {}
    for rd in range(rounds):
        for f in (list(FORMS) if rd % 2 == 0 else list(FORMS)[::-1]):
            os.environ["VRAMD_DELTA_SPLIT"] = FORMS[f]
            for reps in (1, REPS):
                t[f"st_{f}"].write(states)
                with ops.batch():
                    t0 = time.perf_counter()
                    for _ in range(reps):   # each continues the state the one before left
                        deltanet.gated_delta(ops, t["conv"], t["alpha"], t["beta"], t["dt"], t["a"], t[f"st_{f}"],
                                             t[f"out_{f}"], n, s, hk, hv, 1e-6, chunked=False, **seq)
                ops.sync()
                if reps == REPS:
                    times[f].append((time.perf_counter() - t0) / REPS)
    got = {f: (t[f"out_{f}"].read(np.float32), t[f"st_{f}"].read(np.float32)) for f in FORMS}
    (o0, s0), (o1, s1) = got.values()
    assert np.abs(o0 - o1).max() < 1e-5 * np.abs(o0).max(), "the forms' outputs differ"
    assert np.abs(s0 - s1).max() < 1e-5 * max(1.0, np.abs(s0).max()), "the forms' states differ"
    for f, v in times.items():
        print(f"{f:20s} median {1e3 * np.median(v):8.3f} ms  min {1e3 * min(v):8.3f}")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main(*sys.argv[1:7])

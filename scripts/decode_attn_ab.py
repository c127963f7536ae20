"""Kernel-level A/B of the decode attention forms (Ops.attention with tmp: VRAMD_DECODE_ATTN's
new and old), same data, rounds alternating, on the first Vulkan device (lavapipe by default).

    python scripts/decode_attn_ab.py 32 8 128 2000 8 [window] [sinks]
    VK_DRIVER_FILES=<the GPU's ICD> VRAMD_DEC_GROUPS=256 python scripts/decode_attn_ab.py 32 8 128 8000 20

Arguments: q heads, KV heads, head_dim, position (the keys 0 .. position), rounds, and
optionally a sliding window and 1 for attention sinks.  One random f16 cache of position + 1
rows is uploaded once; each form (Ops.decode_attn set) is recorded once as LAYERS dispatch
pairs in one graph, as a decode step's layers would be, and replayed; each round submits
each form's graph once to warm it and REPS times timed (wall time to the sync, per
submit), the order reversed every other round; both results are checked against each
other.  Prints the median and min per form and the load average.
VK_DRIVER_FILES picks the driver (unset: lavapipe); VRAMD_DEC_GROUPS the new form's work
groups a token, VRAMD_DEC_Q=shared its q-in-shared-memory variants; DECODE_AB_LAYERS the
dispatch pairs a graph (default 8; 32 on a GPU, where one layer's is tens of us).
A development tool, not a test.
"""
import os
import sys
import time

os.environ.setdefault("VK_DRIVER_FILES", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from vramd.engine.ops import Ops  # noqa: E402
from vramd.gpu.device import Device  # noqa: E402
from vramd.gpu.residency import Residency  # noqa: E402

LAYERS = int(os.environ.get("DECODE_AB_LAYERS", "8"))
REPS = 5   # submits timed together a round (each waits for the one before)


def main(n_heads, n_kv, hd, pos, rounds, window=0, sinks=0):
    n_heads, n_kv, hd, pos, rounds, window = map(int, (n_heads, n_kv, hd, pos, rounds, window))
    rng = np.random.default_rng(1)
    ctx, width = pos + 1, n_kv * hd
    items = {"kc": rng.standard_normal((ctx, width)).astype(np.float16),
             "vc": rng.standard_normal((ctx, width)).astype(np.float16),
             "q": rng.standard_normal((n_heads, hd)).astype(np.float32),
             "pos": np.array([pos], np.int32), "sinks": rng.standard_normal(n_heads).astype(np.float32),
             "out": np.zeros(n_heads * hd, np.float32), "tmp": np.zeros(n_heads * (hd + 2) * 1024, np.float32)}
    ops = Ops(Residency(Device()))
    r = ops.residency.region("state", "ab", {k: v.nbytes for k, v in items.items()})
    for k, v in items.items():
        r.tensors[k].write(v)
    r.restore()
    t = r.tensors
    forms, times, outs, graphs = ["new", "old"], {"new": [], "old": []}, {}, {}
    for form in forms:   # each form's LAYERS pairs recorded once, replayed (as a decode step is)
        ops.decode_attn = form
        graphs[form] = ops.graph()
        with ops.record(graphs[form]):
            for _ in range(LAYERS):
                ops.attention(t["q"], t["kc"], t["vc"], t["pos"], t["out"], 1, n_heads, n_kv, hd, ctx, hd ** -0.5,
                              window=window, tmp=t["tmp"], sinks=t["sinks"] if int(sinks) else None)
    for rd in range(int(rounds)):
        for form in (forms if rd % 2 == 0 else forms[::-1]):
            graphs[form].submit()   # warm
            ops.sync()
            t0 = time.perf_counter()
            for _ in range(REPS):
                graphs[form].submit()
            ops.sync()
            times[form].append((time.perf_counter() - t0) / REPS)
            outs[form] = t["out"].read(np.float32)
    err = np.max(np.abs(outs["new"] - outs["old"]))
    assert err <= 1e-4 * max(1.0, np.max(np.abs(outs["old"]))), f"the forms differ by {err}"
    for form in forms:
        v = times[form]
        print(f"{form}: median {1e3 * np.median(v):8.2f} ms  min {1e3 * min(v):8.2f}  ({LAYERS} layers; rounds "
              f"{[round(1e3 * s, 1) for s in v]})")
    print(f"max |new - old| {err:.2e}; load average {os.getloadavg()}")
    r.destroy()
    ops.close()


if __name__ == "__main__":
    main(*sys.argv[1:8])

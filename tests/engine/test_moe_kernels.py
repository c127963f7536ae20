"""The mixture-of-experts kernels of vramd/engine/ops.py against numpy, on real
Vulkan (lavapipe in CI): moe_route (native/shaders/moe_route.comp) against
vramd.engine.moe.route, matvec_id_<type> / matvec_id_w_<type> (matvec.glsl's
MV_ID) against each slot's expert matrix times its x row, and moe_combine.

Routing is compared exactly for the ids (ties included: route() breaks them
by the lower id, a stable argsort) and to f32 rounding for the weights.
matvec_id's tolerance is tests/engine/test_kernels.py's (f32 accumulation
against a float64 dot product); a wrong expert, row or slot gives errors of
the order of the values themselves.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.engine.test_kernels import close_to_dot, f32, weights
from tests.engine.test_kernels_kquants import blocks
from vramd.engine.moe import route
from vramd.engine.ops import Ops, Weight, view
from vramd.errors import UsageError


def gpu_route(ops, bufs, logits, k, renormalize):
    n, n_expert = logits.shape
    t = bufs(logits=logits.astype(np.float32), ids=4 * n * k, w=4 * n * k)
    ops.moe_route(t["logits"], t["ids"], t["w"], n, n_expert, k, renormalize)
    ops.sync()
    return t["ids"].read(np.int32).reshape(n, k), f32(t["w"]).reshape(n, k)


@pytest.mark.parametrize("n_expert,k", [(8, 2), (60, 4), (128, 8), (200, 8), (8, 8), (5, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_route(ops, bufs, rng, n_expert, k, renormalize):
    logits = (4 * rng.standard_normal((7, n_expert))).astype(np.float32)
    ids, w = gpu_route(ops, bufs, logits, k, renormalize)
    want_ids, want_w = route(logits.astype(np.float64), k, renormalize)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_breaks_ties_like_route(ops, bufs, rng, renormalize):
    """Logits drawn from 3 values: most choices end in a tie, which route()
    breaks by the lower id.  Rows of all-equal logits pick 0 .. k-1."""
    n_expert, k = 40, 8
    logits = rng.choice(np.array([-1.0, 0.5, 2.0], np.float32), (9, n_expert))
    logits[0] = 0.0
    logits[1, :] = -3.0
    logits[1, [7, 30, 31, 39]] = 1.0    # 4 clear winners, then a 36-way tie for the other 4 slots
    ids, w = gpu_route(ops, bufs, logits, k, renormalize)
    want_ids, want_w = route(logits.astype(np.float64), k, renormalize)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(ids[0], np.arange(k))
    np.testing.assert_array_equal(ids[1], [7, 30, 31, 39, 0, 1, 2, 3])
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-7)


def test_route_logits_a_rounding_apart(ops, bufs):
    """Logits one f32 step apart, whose exp() on the GPU (f32, approximate) may
    round equal or even out of order: the kernel ranks the logits (softmax is
    monotone), so the order is route()'s, computed in float64."""
    base = np.float32(3.0)
    up = np.nextafter(base, np.float32(np.inf))
    logits = np.full((1, 6), -5.0, np.float32)
    logits[0, [1, 4]] = base
    logits[0, 5] = up
    ids, _w = gpu_route(ops, bufs, logits, 2, True)
    np.testing.assert_array_equal(ids, route(logits.astype(np.float64), 2, True)[0])
    assert ids.tolist() == [[5, 1]]


def test_route_nan_logits_still_give_valid_ids(ops, bufs):
    """A NaN logit counts as -inf: the ids stay distinct experts of the model
    (they index weight memory), whatever the router produced."""
    logits = np.array([[np.nan, 1.0, np.nan, 2.0, 0.5, np.nan]], np.float32)
    ids, w = gpu_route(ops, bufs, logits, 4, True)
    assert ids.tolist() == [[3, 1, 4, 0]]
    assert w[0, 3] == 0.0 and w[0, :3].sum() == pytest.approx(1.0)


def test_route_refuses_what_the_kernel_cannot_hold(ops, bufs):
    t = bufs(logits=4 * 2048, ids=64, w=64)
    with pytest.raises(UsageError):
        ops.moe_route(t["logits"], t["ids"], t["w"], 1, 2048, 8, True)
    with pytest.raises(UsageError):
        ops.moe_route(t["logits"], t["ids"], t["w"], 1, 8, 9, True)


def expert_stack(rng, qtype, n_expert, rows, cols):
    """(bytes of the stacked tensor [n_expert, rows, row bytes], float32 [n_expert, rows, cols])."""
    if qtype in (Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        raw, w = blocks(rng, qtype, n_expert * rows, cols)
    else:
        raw, w = weights(rng, qtype, n_expert * rows, cols)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8), w.reshape(n_expert, rows, cols)


def run_matvec_id(ops, bufs, rng, qtype, n_expert, rows, cols, slot_ids, x_div, *, w_skip=0, x_off=0):
    raw, w = expert_stack(rng, qtype, n_expert, rows, cols)
    blob = np.concatenate([np.zeros(w_skip, np.uint8), raw])
    n_slots = len(slot_ids)
    n_x = -(-n_slots // x_div)
    x = rng.standard_normal((n_x, cols)).astype(np.float32)
    wt = bufs("weights", w=blob)["w"]
    t = bufs(x=np.concatenate([np.zeros(x_off, np.float32), x.reshape(-1)]),
             ids=np.asarray(slot_ids, np.int32), y=4 * n_slots * rows)
    ops.matvec_id(Weight(view(wt, w_skip, raw.nbytes), qtype, rows, cols), n_expert, t["ids"],
                  view(t["x"], 4 * x_off), t["y"], n_slots, x_div=x_div)
    ops.sync()
    y = f32(t["y"]).reshape(n_slots, rows)
    for s, e in enumerate(slot_ids):
        xs, we = x[s // x_div].astype(np.float64), w[e].astype(np.float64)
        close_to_dot(y[s], we @ xs, np.abs(we) @ np.abs(xs))


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("x_div", [1, 3], ids=["x-per-slot", "x-per-token"])
def test_matvec_id(ops, bufs, rng, qtype, x_div):
    """6 slots (2 tokens of 3 experts for x-per-token), repeated and
    out-of-order experts, rows not a multiple of a work group's; rows of 512
    columns are 16-byte multiples for Q8_0, Q4_K and Q6_K: the quant-word form."""
    run_matvec_id(ops, bufs, rng, qtype, 7, 13, 512, [6, 0, 3, 3, 1, 6], x_div)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F16, Q.Q4_K], ids=lambda t: t.name)
def test_matvec_id_unaligned(ops, bufs, rng, qtype):
    """The stack 2 bytes into its buffer and x one float off 16 bytes: the
    word-at-a-time forms (matvec_id_<type>)."""
    run_matvec_id(ops, bufs, rng, qtype, 4, 9, 256, [2, 3, 0], 1, w_skip=2, x_off=1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F32], ids=lambda t: t.name)
def test_matvec_id_stack_larger_than_a_binding(res, bufs, rng, qtype):
    """With a storage range of 3 experts' matrices, a stack of 8 is bound in
    runs of experts, a dispatch each; every slot is computed once, by the run
    that holds its expert."""
    small = Ops(res)
    try:
        rows, cols = 16, 256
        slab = rows * cols * (4 if qtype == Q.F32 else 34 / 32)
        small.max_range = int(3 * slab) + small.align + 4
        assert len(list(small.expert_runs(Weight(bufs("weights", w=int(8 * slab))["w"], qtype, rows, cols), 8))) == 3
        run_matvec_id(small, bufs, rng, qtype, 8, rows, cols, [7, 0, 4, 2, 5, 3, 6, 1], 2)
    finally:
        small.close()


def test_matvec_id_refuses_an_expert_larger_than_a_binding(res, bufs):
    small = Ops(res)
    try:
        small.max_range = 4096
        t = bufs("weights", w=2 * 64 * 64 * 4)
        s = bufs(x=4 * 64, ids=np.zeros(1, np.int32), y=4 * 64)
        with pytest.raises(UsageError, match="maxStorageBufferRange"):
            small.matvec_id(Weight(t["w"], Q.F32, 64, 64), 2, s["ids"], s["x"], s["y"], 1)
    finally:
        small.close()


@pytest.mark.parametrize("shared", [False, True])
def test_moe_combine(ops, bufs, rng, shared):
    n, k, width = 3, 4, 200
    x = rng.standard_normal((n, width)).astype(np.float32)
    down = rng.standard_normal((n * k, width)).astype(np.float32)
    w = rng.uniform(0, 1, (n, k)).astype(np.float32)
    sh = rng.standard_normal((n, width)).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    t = bufs(x=x, down=down, w=w, sh=sh, g=g)
    ops.moe_combine(t["x"], t["down"], t["w"], n, k, width, shared=t["sh"] if shared else None,
                    shared_gate=t["g"] if shared else None)
    ops.sync()
    want = x + np.einsum("tk,tkc->tc", w, down.reshape(n, k, width))
    if shared:
        want += sh / (1 + np.exp(-g[:, None]))
    np.testing.assert_allclose(f32(t["x"]).reshape(n, width), want, rtol=1e-5, atol=1e-5)

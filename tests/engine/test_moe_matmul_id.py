"""The grouped expert matmul of mixture-of-experts prefill, on real Vulkan
(lavapipe in CI): moe_group (native/shaders/moe_group.comp, the slots sorted
by expert and their tile list) against numpy's stable argsort, and
matmul_id_<type> (matmul.glsl with matmul_rows.glsl's MM_ID) against numpy
(each slot's expert matrix times its x row, in float64) and against
matvec_id on the same buffers.

Shapes: rows at every row-tile edge (1, 63, 64, 65, 129), experts with 0, 1,
31, 32, 33 and many slots (token tiles full, ragged, single), gate/up's
shared x rows (x_div = k) and down's own, a stack bound in several runs,
weights and x off their alignment.  The tolerance is test_kernels.py's (f32
accumulation against a float64 dot product); a wrong expert, row, slot or
tile gives errors of the order of the values themselves.

On a GPU (marked native_gpu: `VRAMD_TEST_DEVICE=native pytest -m native_gpu`):
the same checks at a real model's sizes (128 experts, 512 tokens x top-8).
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.engine.test_kernels import close_to_dot, f32
from tests.engine.test_kernels_mxfp4 import mx_blocks
from tests.engine.test_moe_kernels import expert_stack
from vramd.engine import linear
from vramd.engine.ops import Ops, Weight, view
from vramd.errors import UsageError

BT = linear.MATMUL_TOKENS
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]


def want_groups(ids, n_expert, bt):
    """moe_group's output computed by numpy: the stable order, the tile count, the tiles."""
    order = np.argsort(ids, kind="stable")
    counts = np.bincount(ids, minlength=n_expert)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    tiles = [(e, starts[e] + j, min(bt, counts[e] - j)) for e in range(n_expert) for j in range(0, counts[e], bt)]
    return order, tiles


def gpu_groups(ops, bufs, ids, n_expert, bt, g_skip=0):
    n = len(ids)
    words = linear.group_words(n, n_expert, bt)
    t = bufs(ids=np.asarray(ids, np.int32), g=np.full(g_skip + words, 0xDEADBEEF, np.uint32))
    ops.moe_group(t["ids"], view(t["g"], 4 * g_skip), n, n_expert, bt)
    ops.sync()
    g = t["g"].read(np.uint32)
    assert np.all(g[:g_skip] == 0xDEADBEEF)
    g = g[g_skip:]
    n_tiles = int(g[n])
    assert n_tiles <= linear.id_tiles(n, n_expert, bt)
    return g[:n], [tuple(int(v) for v in g[n + 1 + 3 * i:n + 4 + 3 * i]) for i in range(n_tiles)]


@pytest.mark.parametrize("n,n_expert,bt", [(1, 8, 32), (7, 8, 32), (255, 60, 32), (256, 128, 32), (257, 128, 32),
                                           (1000, 256, 32), (4096, 128, 32), (700, 1024, 32), (300, 5, 1),
                                           (777, 32, 128), (513, 3, 7)])
def test_group_matches_numpy(ops, bufs, rng, n, n_expert, bt):
    ids = rng.integers(0, n_expert, n)
    order, tiles = gpu_groups(ops, bufs, ids, n_expert, bt, g_skip=3)
    want_order, want_tiles = want_groups(ids, n_expert, bt)
    np.testing.assert_array_equal(order, want_order)
    assert tiles == want_tiles


def test_group_skewed(ops, bufs, rng):
    """Every slot on one expert (the most tiles of one), then most on one and a
    few elsewhere: experts with 0 slots make no tile; the tile count reaches
    linear.id_tiles's bound where every expert has one slot over a multiple of bt."""
    n_expert = 16
    ids = np.full(1000, 11)
    assert gpu_groups(ops, bufs, ids, n_expert, BT)[1] == want_groups(ids, n_expert, BT)[1]
    ids[rng.choice(1000, 40, replace=False)] = rng.integers(0, 4, 40)
    order, tiles = gpu_groups(ops, bufs, ids, n_expert, BT)
    want_order, want_tiles = want_groups(ids, n_expert, BT)
    np.testing.assert_array_equal(order, want_order)
    assert tiles == want_tiles
    ids = np.repeat(np.arange(n_expert), BT + 1)   # 2 tiles an expert: n // BT + n_expert
    _, tiles = gpu_groups(ops, bufs, ids, n_expert, BT)
    assert len(tiles) == 2 * n_expert == linear.id_tiles(len(ids), n_expert, BT)


def test_group_refuses_too_many_experts(ops, bufs):
    t = bufs(ids=np.zeros(4, np.int32), g=4 * 10000)
    with pytest.raises(UsageError, match="moe_group"):
        ops.moe_group(t["ids"], t["g"], 4, 2048)


def stack(rng, qtype, n_expert, rows, cols):
    """(bytes of the stacked tensor, float32 [n_expert, rows, cols])."""
    if qtype == Q.MXFP4:
        raw, w = mx_blocks(rng, n_expert * rows, cols)
        return raw.reshape(-1), w.reshape(n_expert, rows, cols)
    return expert_stack(rng, qtype, n_expert, rows, cols)


def run_matmul_id(ops, bufs, rng, qtype, n_expert, rows, cols, slot_ids, x_div, *, w_skip=0, x_off=0,
                  against_matvec_id=True):
    """matmul_id over slot_ids (moe_group's tiles built on the GPU) against numpy and matvec_id."""
    raw, w = stack(rng, qtype, n_expert, rows, cols)
    blob = np.concatenate([np.zeros(w_skip, np.uint8), raw])
    slot_ids = np.asarray(slot_ids, np.int32)
    n_slots = len(slot_ids)
    n_x = -(-n_slots // x_div)
    x = rng.standard_normal((n_x, cols)).astype(np.float32)
    wt = bufs("weights", w=blob)["w"]
    t = bufs(x=np.concatenate([np.zeros(x_off, np.float32), x.reshape(-1)]), ids=slot_ids,
             g=4 * linear.group_words(n_slots, n_expert, BT), y=np.full(n_slots * rows, np.nan, np.float32),
             y_mv=4 * n_slots * rows)
    weight = Weight(view(wt, w_skip, raw.nbytes), qtype, rows, cols)
    xv = view(t["x"], 4 * x_off)
    ops.moe_group(t["ids"], t["g"], n_slots, n_expert)
    ops.matmul_id(weight, n_expert, t["g"], xv, t["y"], n_slots, x_div=x_div)
    if against_matvec_id:
        ops.matvec_id(weight, n_expert, t["ids"], xv, t["y_mv"], n_slots, x_div=x_div)
    ops.sync()
    y = f32(t["y"]).reshape(n_slots, rows)
    xs = x[np.arange(n_slots) // x_div].astype(np.float64)
    ref, mag = np.empty((n_slots, rows)), np.empty((n_slots, rows))
    for e in np.unique(slot_ids):   # an expert at a time: its slots' rows in float64
        at, we = slot_ids == e, w[e].astype(np.float64)
        ref[at], mag[at] = xs[at] @ we.T, np.abs(xs[at]) @ np.abs(we).T
    close_to_dot(y, ref, mag)
    if against_matvec_id:
        close_to_dot(y, f32(t["y_mv"]).reshape(n_slots, rows), mag, rel=4e-6)
    return y


def slots_of(counts, rng):
    """Slot ids with expert e chosen counts[e] times, shuffled (a token's slots need not be sorted)."""
    ids = np.repeat(np.arange(len(counts)), counts)
    return rng.permutation(ids)


# expert 0: no slot, 1: one, 2: a full tile, 3: one past, 4: one short, 5: many (3 tiles and a ragged one)
COUNTS = [0, 1, BT, BT + 1, BT - 1, 3 * BT + 5]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("x_div", [1, 3], ids=["x-per-slot", "x-per-token"])
def test_matmul_id_every_type(ops, bufs, rng, qtype, x_div):
    """Rows 65 (a full row tile and one row of the next), 256 columns (8 column steps)."""
    run_matmul_id(ops, bufs, rng, qtype, len(COUNTS), 65, 256, slots_of(COUNTS, rng), x_div)


@pytest.mark.parametrize("rows", [1, 63, 64, 129])
def test_matmul_id_row_edges(ops, bufs, rng, rows):
    run_matmul_id(ops, bufs, rng, Q.Q4_K, len(COUNTS), rows, 256, slots_of(COUNTS, rng), 2)


@pytest.mark.parametrize("qtype,cols", [(Q.F32, 33), (Q.F16, 47), (Q.Q8_0, 96), (Q.MXFP4, 13 * 32)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_matmul_id_odd_columns(ops, bufs, rng, qtype, cols):
    """Columns no multiple of the 32-column step (float types), 3 blocks
    (Q8_0), 221-byte rows (MXFP4: each expert's matrix at another byte alignment)."""
    run_matmul_id(ops, bufs, rng, qtype, 5, 37, cols, slots_of([3, 0, 40, 1, 9], rng), 1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F16, Q.Q4_K], ids=lambda t: t.name)
def test_matmul_id_unaligned(ops, bufs, rng, qtype):
    """The stack 2 bytes into its buffer and x one float off 16 bytes."""
    run_matmul_id(ops, bufs, rng, qtype, 4, 9, 256, slots_of([5, 40, 0, 2], rng), 1, w_skip=2, x_off=1)


def test_matmul_id_token_slots_like_moe_route(ops, bufs, rng):
    """Slots as moe_route writes them: 70 tokens x top-4 of 16 distinct experts a token, gate/up's x_div = k."""
    n, k, n_expert = 70, 4, 16
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)]).reshape(-1)
    run_matmul_id(ops, bufs, rng, Q.Q6_K, n_expert, 70, 512, ids, k)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F32, Q.MXFP4], ids=lambda t: t.name)
def test_matmul_id_stack_larger_than_a_binding(res, bufs, rng, qtype):
    """With a storage range of 3 experts' matrices, a stack of 8 is bound in
    runs of experts, a dispatch each: every tile is computed once, by the run
    that holds its expert (and the NaN the output starts as is gone)."""
    small = Ops(res)
    try:
        rows, cols = 64, 256   # (x and y must fit the small range too: 48 slots)
        per_elem = {Q.F32: 4, Q.Q8_0: 34 / 32, Q.MXFP4: 17 / 32}[qtype]
        slab = rows * cols * per_elem
        small.max_range = int(3 * slab) + small.align + 4
        w = Weight(bufs("weights", w=int(8 * slab))["w"], qtype, rows, cols)
        assert len(list(small.expert_runs(w, 8))) == 3
        run_matmul_id(small, bufs, rng, qtype, 8, rows, cols, slots_of([7, 0, 33, 2, 1, 3, 0, 2], rng), 2)
    finally:
        small.close()


def test_matmul_id_leaves_other_slots_alone(ops, bufs, rng):
    """A slot whose id is no expert of the stack is in no tile and its row stays
    as it was (as matvec_id leaves it); the others are computed."""
    n_expert, rows, cols = 4, 8, 64
    raw, w = stack(rng, Q.F32, n_expert, rows, cols)
    ids = np.array([1, 9, 3, 1], np.int32)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    wt = bufs("weights", w=raw)["w"]
    t = bufs(x=x, ids=ids, g=4 * linear.group_words(4, n_expert, BT), y=np.full(4 * rows, 7.0, np.float32))
    ops.moe_group(t["ids"], t["g"], 4, n_expert)
    ops.matmul_id(Weight(wt, Q.F32, rows, cols), n_expert, t["g"], t["x"], t["y"], 4)
    ops.sync()
    y = f32(t["y"]).reshape(4, rows)
    assert np.all(y[1] == 7.0)
    for s in (0, 2, 3):
        np.testing.assert_allclose(y[s], w[ids[s]] @ x[s], rtol=1e-5, atol=1e-5)


def test_selection(monkeypatch):
    """Decode and tiny batches keep matvec_id (its replayed decode step unchanged); prefill
    groups where the experts get several slots each, on a GPU; VRAMD_MOE_GROUPED overrides."""
    monkeypatch.delenv("VRAMD_MOE_GROUPED", raising=False)
    assert not linear.grouped(1, 8, 128) and not linear.grouped(linear.MATMUL_ID_FROM - 1, 8, 1)
    assert linear.grouped(512, 8, 128) and linear.grouped(64, 8, 128) and not linear.grouped(63, 8, 128)
    assert linear.grouped(32, 4, 32) and not linear.grouped(512, 8, 128, cpu=True)
    monkeypatch.setenv("VRAMD_MOE_GROUPED", "1")
    assert linear.grouped(4, 8, 256, cpu=True) and not linear.grouped(1, 8, 8)
    monkeypatch.setenv("VRAMD_MOE_GROUPED", "0")
    assert not linear.grouped(512, 8, 8)
    monkeypatch.setenv("VRAMD_MOE_GROUPED", "yes")
    with pytest.raises(UsageError, match="VRAMD_MOE_GROUPED"):
        linear.grouped(512, 8, 8)


@pytest.mark.native_gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_id_model_sized_on_gpu(ops, bufs, rng, qtype):
    """A Qwen3-30B-A3B-like chunk on a GPU: 512 tokens x top-8 of 128 experts
    (routing-like: distinct experts a token, skewed popularity: some experts
    with many tiles, some with none); gate/up's shape (x_div = 8) and down's,
    smaller than the model's matrices so that the references stay quick."""
    n, k, n_expert = 512, 8, 128
    pop = rng.dirichlet(np.full(n_expert, 0.3))
    ids = np.stack([rng.choice(n_expert, k, replace=False, p=pop) for _ in range(n)]).reshape(-1)
    run_matmul_id(ops, bufs, rng, qtype, n_expert, 160, 1024, ids, k)
    run_matmul_id(ops, bufs, rng, qtype, n_expert, 1024, 256, ids, 1)


@pytest.mark.native_gpu
def test_group_on_gpu(ops, bufs, rng):
    """moe_group at a 2,048-token chunk's slots (16,384) on a GPU."""
    ids = rng.integers(0, 128, 2048 * 8)
    order, tiles = gpu_groups(ops, bufs, ids, 128, BT)
    want_order, want_tiles = want_groups(ids, 128, BT)
    np.testing.assert_array_equal(order, want_order)
    assert tiles == want_tiles


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_model_prefill_grouped_matches_the_reference(device, tmp_path, monkeypatch, arch):
    """A whole model's prefill through moe_group + matmul_id (VRAMD_MOE_GROUPED=1: lavapipe
    would otherwise keep matvec_id) against the numpy reference, the next token's decode
    (matvec_id) after it too: tests/engine/test_moe.py's tolerance."""
    from tests.engine.reference.moe import ReferenceMoE
    from tests.engine.test_moe import CTX, TOL, rel_err
    from tests.ggufgen.moe import write_moe
    from vramd.engine.arch import spec_for
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf

    monkeypatch.setenv("VRAMD_MOE_GROUPED", "1")
    path = write_moe(tmp_path / f"{arch}.gguf", arch=arch, n_layer=2, seed=4)
    mf = validate_gguf(path)
    res = Residency(device)
    model = None
    try:
        lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(spec_for(mf), 16))
        res.restore(["weights", "state"])
        model = TransformerModel(lm, res, CTX, lm.scratch, batch=16)
        ref = ReferenceMoE(path)
        prompt = [1, 20, 40, 60, 9, 33, 70, 5]
        assert ref.min_route_margin(prompt) > 0.01
        kv = ref.new_kv(np.float16)
        assert rel_err(model.forward(prompt, 0, all_logits=True), ref.forward(prompt, kv, 0)) < TOL
        assert rel_err(model.forward([3], len(prompt)), ref.forward([3], kv)[-1]) < TOL
    finally:
        if model is not None:
            model.close()
        res.close()


def test_matmul_id_fused_stack_stride(ops, bufs, rng):
    """A stack whose experts are further apart than one matrix (gemma4's fused
    ffn_gate_up_exps: each expert's gate rows, then its up rows): the up half,
    Weight.stride = both halves, against numpy and matvec_id."""
    n_expert, rows, cols = 5, 24, 256
    raw, w = stack(rng, Q.Q8_0, n_expert, 2 * rows, cols)
    rb = cols // 32 * 34
    ids = slots_of([3, 0, 35, 1, 9], rng)
    n = len(ids)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    wt = bufs("weights", w=raw)["w"]
    t = bufs(x=x, ids=ids.astype(np.int32), g=4 * linear.group_words(n, n_expert, BT), y=4 * n * rows,
             y_mv=4 * n * rows)
    up = Weight(view(wt, rows * rb), Q.Q8_0, rows, cols, 2 * rows * rb)
    ops.moe_group(t["ids"], t["g"], n, n_expert)
    ops.matmul_id(up, n_expert, t["g"], t["x"], t["y"], n)
    ops.matvec_id(up, n_expert, t["ids"], t["x"], t["y_mv"], n)
    ops.sync()
    y = f32(t["y"]).reshape(n, rows)
    for s, e in enumerate(ids):
        we = w[e, rows:].astype(np.float64)
        close_to_dot(y[s], we @ x[s], np.abs(we) @ np.abs(x[s]))
    np.testing.assert_allclose(y, f32(t["y_mv"]).reshape(n, rows), rtol=1e-5, atol=1e-4)

"""The decode-rows matvec kernels (matvec_t<NT>_<type>, matvec_w_t<NT>_<type>: native/shaders/
matvec.glsl "Several tokens", vramd/engine/linear.py per_token_kernel): a step's decode rows,
NT a work group, each weight read once for the NT, against numpy and, bit for bit, against
each row's lone-token kernel (matvec_<type> / matvec_w_<type>), so that a request's numbers do
not depend on what shares its step.

These kernels are for GPU devices: on a CPU device (lavapipe here) the lone kernels are the
matvec_c forms, so these tests set `ops.cpu` False (the linear_form fixture's "gpu-form"), which
runs the GPU forms on lavapipe.  Every type (those without a several-token form, and rows
that would not match, keep the lone kernel: per_token_kernel says which), 1 .. 17 rows (NT 4, 8 and 16 and a second group of
16; caps 4 and 8: ragged last groups), weight rows aligned (the word-per-thread kernels of Q8_0,
Q4_K, Q6_K), 8 bytes off (their generic form) or 2 off (words straddled), x aligned, one float
off (binding offset) or with a stride off alignment (the rows then differ in alignment: F32,
F16, BF16 keep the lone kernel, the others do not care).  On a GPU (marked native_gpu:
`VRAMD_TEST_DEVICE=native pytest -m native_gpu`) the same equality for the benchmark types:
there the driver's compiler makes each kernel's code, and the test checks that it does the same
arithmetic for a token whatever NT is.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tests.engine.test_kernels import close_to_dot, f32, weights
from tests.engine.test_kernels_kquants import blocks
from tests.engine.test_kernels_mxfp4 import mx_blocks
from tests.ggufgen.llama import write_llama
from vramd.engine import linear
from vramd.engine.arch import spec_for
from vramd.engine.batch import TokenBatch
from vramd.engine.model import TransformerModel
from vramd.engine.ops import Weight, view
from vramd.engine.scratch import scratch_layout
from vramd.errors import UsageError
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
ROWS, MOST = 37, 17


def cols_of(qtype):
    """512 columns; Q6_K 2048, the fewest whose 210-byte blocks make rows of whole 16 bytes
    (matvec_w_q6_k's rows: the 8B's 4096 and 14336 are such)."""
    return 2048 if qtype == Q.Q6_K else 512


def make(rng, qtype, rows, cols):
    """(bytes to upload, the float32 matrix they mean): random, valid scales."""
    if qtype in (Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return blocks(rng, qtype, rows, cols)
    if qtype == Q.MXFP4:
        return mx_blocks(rng, rows, cols)
    return weights(rng, qtype, rows, cols)


def decode_rows(ops, w, xt, yt, n, x_off, x_stride):
    """Ops.matvec of n rows as a step's decode rows (one token of each of n sequences)."""
    ops.token_rows = (n, [(0, n, True)])
    try:
        ops.matvec(w, view(xt, 4 * x_off), yt, n, x_stride=x_stride)
    finally:
        ops.token_rows = None
    ops.sync()
    return f32(yt, n * w.rows).reshape(n, w.rows)


@pytest.fixture
def gpu_form(ops):
    """The GPU kernels on whatever device (lavapipe: not its matvec_c forms), NT up to 16."""
    was = ops.cpu, ops.mv_tokens
    ops.cpu, ops.mv_tokens = False, 16
    yield ops
    ops.cpu, ops.mv_tokens = was


def case(ops, bufs, rng, qtype, w_skip, x_off, x_pad, counts, caps):
    cols = cols_of(qtype)
    raw, wf = make(rng, qtype, ROWS, cols)
    blob = np.concatenate([np.zeros(w_skip, np.uint8), np.ascontiguousarray(raw).reshape(-1).view(np.uint8)])
    x_stride = cols + x_pad
    x = rng.standard_normal(x_off + MOST * x_stride).astype(np.float32)
    wt = bufs("weights", w=blob)["w"]
    t = bufs(x=x, y=4 * MOST * ROWS, y1=4 * ROWS)
    w = Weight(view(wt, w_skip, blob.nbytes - w_skip), qtype, ROWS, cols)
    lone = []
    for r in range(MOST):   # each row alone: the kernel a lone token takes
        ops.matvec(w, view(t["x"], 4 * (x_off + r * x_stride)), t["y1"], 1)
        ops.sync()
        lone.append(f32(t["y1"]).copy())
    lone = np.array(lone)
    xs = x[x_off:].reshape(MOST, x_stride)[:, :cols].astype(np.float64)
    close_to_dot(lone, xs @ wf.astype(np.float64).T, np.abs(xs) @ np.abs(wf).astype(np.float64).T)
    taken = set()
    for cap in caps:
        ops.mv_tokens = cap
        for n in counts:
            k = linear.per_token_kernel(w, n, w_skip, x_stride, cap, ops.fixed_subgroup, coopmat=ops.coopmat,
                                        cpu=ops.cpu, q8_dp=ops.q8_dp)
            taken.add(k.name)
            got = decode_rows(ops, w, t["x"], t["y"], n, x_off, x_stride)
            assert np.array_equal(got, lone[:n]), (k.name, n, np.flatnonzero((got != lone[:n]).any(axis=1)))
    return taken, linear.select(w, 1, w_skip).name


def shape_only(qtype, rows, cols):
    """A Weight for selection alone (a view of no buffer: nothing is dispatched)."""
    from vramd.engine.ops import row_bytes
    return Weight((None, 0, rows * row_bytes(qtype, cols)), qtype, rows, cols)


# (F32 rows are read as whole words: not 2 bytes off)
W_SKIPS = [pytest.param(q, k, id=f"{q.name}-w-plus-{k}") for q in TYPES for k in (0, 8, 2) if q != Q.F32 or k != 2]


@pytest.mark.parametrize("qtype,w_skip", W_SKIPS)
@pytest.mark.parametrize("x_off,x_pad", [(0, 0), (1, 0), (0, 1)], ids=["x-aligned", "x-off-1", "x-stride-odd"])
def test_decode_rows_are_each_rows_lone_result(gpu_form, bufs, rng, qtype, w_skip, x_off, x_pad):
    taken, lone = case(gpu_form, bufs, rng, qtype, w_skip, x_off, x_pad, range(1, MOST + 1), [16])
    s = qtype.name.lower()
    if (s in linear.MV_FLOAT and x_pad % 4) or not (s in linear.MV_FLOAT or lone.startswith("matvec_w_")):
        # rows of different alignment, or the mv_unit types' matvec_<type>: the lone kernel, row by row
        assert taken == {lone}
    else:
        form = "matvec_w_t" if lone.startswith("matvec_w_") else "matvec_t"
        assert taken == {lone} | {f"{form}{nt}_{s}" for nt in linear.MV_TOKENS}, taken


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_smaller_caps_split_the_rows_into_ragged_groups(gpu_form, bufs, rng, qtype):
    """VRAMD_MV_TOKENS 4 and 8 (ops.mv_tokens): 17 rows in groups of 4 or 8, the last of one row."""
    taken, _ = case(gpu_form, bufs, rng, qtype, 0, 0, 0, [3, 5, 9, 17], [4, 8, 1])
    assert any("_t4_" in k for k in taken) and any("_t8_" in k for k in taken)


def test_the_cap_is_an_environment_switch(monkeypatch):
    w = shape_only(Q.Q4_K, 4096, 4096)
    for mode, want in (("", "matvec_w_t16_q4_k"), ("8", "matvec_w_t8_q4_k"), ("4", "matvec_w_t4_q4_k"),
                       ("1", "matvec_w_q4_k")):
        monkeypatch.setenv("VRAMD_MV_TOKENS", mode)
        assert linear.per_token_kernel(w, 12, 0, 4096, linear.mv_tokens(), 32).name == want
    monkeypatch.setenv("VRAMD_MV_TOKENS", "3")
    with pytest.raises(UsageError, match="VRAMD_MV_TOKENS"):
        linear.mv_tokens()
    # the CPU forms and the integer-dot Q8_0 kernel have no several-token form: their lone kernel
    assert linear.per_token_kernel(w, 12, 0, 4096, 16, 32, cpu=True).name == "matvec_c_q4_k"
    q8 = shape_only(Q.Q8_0, 4096, 4096)
    assert linear.per_token_kernel(q8, 12, 0, 4096, 16, 32, q8_dp=True).name == "matvec_q8_0_dp"
    assert linear.per_token_kernel(w, 1, 0, 4096, 16, 32).name == "matvec_w_q4_k"
    f16 = shape_only(Q.F16, 64, 4096)   # rows of differing alignment keep the lone kernel
    assert linear.per_token_kernel(f16, 12, 0, 4097, 16, 32).name == "matvec_f16"
    assert linear.per_token_kernel(f16, 12, 0, 4096, 16, 32).name == "matvec_t16_f16"
    assert linear.per_token_kernel(f16, 3, 0, 4096, 16, 32).name == "matvec_t4_f16"
    # a device whose pipelines may get other subgroup sizes (0), or of 2 lanes: the lone kernel
    assert linear.per_token_kernel(w, 12, 0, 4096, 16, 0).name == "matvec_w_q4_k"
    assert linear.per_token_kernel(f16, 12, 0, 4096, 16, 2).name == "matvec_f16"


@pytest.fixture(scope="module", params=["Q4_K", "F16"])
def model(request, tmp_path_factory, device):
    from vramd.gpu.residency import Residency

    path = write_llama(tmp_path_factory.mktemp("mvt") / "m.gguf", weight_type=request.param, n_embd=256,
                       n_ff=512, n_head=4, n_head_kv=2, seed=7)
    mf = validate_gguf(path)
    res = Residency(device)
    lm = loader.load(path, res, 64, mf=mf, scratch=scratch_layout(spec_for(mf), 16), n_seq=6)
    res.restore(["weights", "state"])
    m = TransformerModel(lm, res, 64, lm.scratch, batch=16)
    was = m.ops.cpu, m.ops.mv_tokens
    m.ops.cpu, m.ops.mv_tokens = False, 4   # the GPU kernels on lavapipe; 6 rows: groups of 4 and 2
    yield m
    m.ops.cpu, m.ops.mv_tokens = was
    m.close()
    res.close()


def test_a_sequences_decode_logits_do_not_depend_on_its_step(model):
    """Six sequences' decode steps together (their rows through the several-token kernels) give
    each sequence, bit for bit, the logits and greedy token of the same steps run alone."""
    m = model
    V = m.spec.n_vocab
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, V, 3 + s)] for s in range(6)]

    def prefill():
        for s, p in enumerate(prompts):
            m.clear_seq(s)
            m.forward_batch(TokenBatch.of(p, 0, seq=s))

    prefill()
    alone = {s: [] for s in range(6)}
    for s, p in enumerate(prompts):
        tok = 1 + s
        for k in range(3):
            row = m.forward_batch(TokenBatch.of([tok], len(p) + k, seq=s))[0]
            alone[s].append(row)
            tok = int(np.argmax(row))
    prefill()
    toks = {s: 1 + s for s in range(6)}
    for k in range(3):
        logits = m.forward_batch(TokenBatch.mix([(s, [toks[s]], len(prompts[s]) + k) for s in range(6)]))
        for s in range(6):
            assert np.array_equal(logits[s], alone[s][k]), (s, k)
            toks[s] = int(np.argmax(logits[s]))
    assert any("_t4_" in name for name in m.ops._kernels), sorted(m.ops._kernels)   # they did run


@pytest.mark.native_gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.F16, Q.Q8_0, Q.BF16, Q.F32], ids=lambda t: t.name)
def test_on_the_gpu_decode_rows_are_each_rows_lone_result(ops, bufs, rng, qtype):
    """On a real GPU (no forcing: its own forms) 1 .. 17 rows, NT 4, 8, 16, bit for bit."""
    if ops.cpu:
        pytest.fail("native_gpu: run with VRAMD_TEST_DEVICE=native on a GPU")
    ops.mv_tokens = 16
    taken, _ = case(ops, bufs, rng, qtype, 0, 0, 0, range(1, MOST + 1), [16, 8])
    assert any("_t16_" in k for k in taken), taken

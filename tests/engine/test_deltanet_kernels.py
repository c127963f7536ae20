"""The Gated DeltaNet kernels (vramd/engine/deltanet.py) against the numpy reference's pieces
(tests/engine/reference/qwen35.py: l2_norm, softplus, sigmoid, delta_rule_recurrent), on real
Vulkan (lavapipe in CI).  A prefill longer than llama.cpp's chunk of 64 and a decode continuing
its state must both agree: the state the kernels leave is the state the next call reads.
Tolerances cover f32 accumulation and the GPU's exp/log; a wrong index, a wrong head mapping or
a lost state misses by the values' own size."""

import numpy as np
import pytest

from tests.engine.reference.qwen35 import delta_rule_chunked, delta_rule_recurrent, l2_norm, sigmoid, softplus
from tests.engine.reference.common import silu
from vramd.engine import deltanet
from vramd.errors import UsageError


def conv_ref(x, state, w):
    window = np.concatenate([state, x])
    n, d = len(x), w.shape[1]
    out = silu(sum(window[j:j + n] * w[:, j] for j in range(d)))
    return out, window[n:]


@pytest.mark.parametrize("n", [1, 3, 70])
def test_ssm_conv_silu_with_its_state(ops, bufs, rng, n):
    c, d = 96, 4
    x = rng.standard_normal((n, c)).astype(np.float32)
    state = rng.standard_normal((d - 1, c)).astype(np.float32)
    w = (0.5 * rng.standard_normal((c, d))).astype(np.float32)
    b = bufs(x=x, state=state, w=w, out=4 * n * c)
    deltanet.ssm_conv_silu(ops, b["x"], b["state"], b["w"], b["out"], n, c, d)
    ops.sync()
    want, want_state = conv_ref(x.astype(np.float64), state.astype(np.float64), w.astype(np.float64))
    assert np.abs(b["out"].read(np.float32).reshape(n, c) - want).max() < 1e-5
    assert np.abs(b["state"].read(np.float32).reshape(d - 1, c) - want_state).max() == 0.0


def delta_ref(conv, alpha, beta, dt, a, state, s, hk, hv, eps=1e-6, rule=delta_rule_recurrent):
    n = len(conv)
    q = l2_norm(conv[:, :hk * s].reshape(n, hk, s), eps) / np.sqrt(s)
    k = l2_norm(conv[:, hk * s:2 * hk * s].reshape(n, hk, s), eps)
    v = conv[:, 2 * hk * s:].reshape(n, hv, s)
    g = softplus(alpha + dt) * a
    bt = sigmoid(beta)
    out, new = np.empty((n, hv, s)), np.empty_like(state)
    for h in range(hv):
        out[:, h], new[h] = rule(q[:, h % hk], k[:, h % hk], v[:, h], g[:, h], bt[:, h], state[h])
    return out, new


def delta_inputs(rng, n, s, hk, hv):
    c = 2 * hk * s + hv * s
    conv = rng.standard_normal((n, c)).astype(np.float32)
    alpha = rng.standard_normal((n, hv)).astype(np.float32)
    beta = rng.standard_normal((n, hv)).astype(np.float32)
    dt = rng.standard_normal(hv).astype(np.float32)
    a = -np.exp(rng.uniform(np.log(0.02), np.log(0.2), hv)).astype(np.float32)
    state = (0.1 * rng.standard_normal((hv, s, s))).astype(np.float32)
    return conv, alpha, beta, dt, a, state


def run_delta(ops, bufs, inputs, n, s, hk, hv, *, chunked, reset=False):
    conv, alpha, beta, dt, a, state = inputs
    b = bufs(conv=conv, alpha=alpha, beta=beta, dt=dt, a=a, state=state, out=4 * n * hv * s)
    deltanet.gated_delta(ops, b["conv"], b["alpha"], b["beta"], b["dt"], b["a"], b["state"], b["out"], n, s, hk, hv,
                         1e-6, reset=reset, chunked=chunked)
    ops.sync()
    return b["out"].read(np.float32).reshape(n, hv, s), b["state"].read(np.float32).reshape(hv, s, s)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 130])
@pytest.mark.parametrize("s,hk,hv", [(128, 1, 2), (32, 2, 4)])
def test_gated_delta_chunked_matches_recurrent_and_reference(ops, bufs, rng, n, s, hk, hv):
    """Token counts off and on the kernel's chunk (16 tokens at S = 128, 32 at S = 32) and the
    reference's 64, continuing a state (position > 0): the chunked kernel's outputs and state agree
    with the recurrent kernel's and with the numpy reference's chunked form."""
    inputs = delta_inputs(rng, n, s, hk, hv)
    got, got_state = run_delta(ops, bufs, inputs, n, s, hk, hv, chunked=True)
    rec, rec_state = run_delta(ops, bufs, inputs, n, s, hk, hv, chunked=False)
    want, want_state = delta_ref(*(z.astype(np.float64) for z in inputs), s, hk, hv, rule=delta_rule_chunked)
    scale = np.abs(want).max()
    assert scale > 0.01
    assert np.abs(got - want).max() < 1e-4 * scale + 1e-5
    assert np.abs(got - rec).max() < 1e-4 * scale + 1e-5
    assert np.abs(got_state - want_state).max() < 1e-4
    assert np.abs(got_state - rec_state).max() < 1e-5 * max(1.0, np.abs(want_state).max())


@pytest.mark.parametrize("gate", ["forget", "keep", "mixed"])
def test_gated_delta_chunked_gating_extremes(ops, bufs, rng, gate):
    """g near -inf (the state forgotten at each token: e^G underflows, and must give 0, never
    0/0), g = 0 (softplus(x) -> 0: nothing decays) and the two alternating, with beta saturated
    both ways, from a fresh state (reset) and softplus's linear branch (x > 20)."""
    n, s, hk, hv = 40, 64, 1, 2
    conv, alpha, beta, dt, a, state = delta_inputs(rng, n, s, hk, hv)
    if gate == "forget":
        alpha[:] = 30.0
        a[:] = -50.0            # g = -1500 per token
    elif gate == "keep":
        alpha[:] = -40.0        # softplus ~ 4e-18: g ~ 0
    else:
        alpha[::2] = 30.0
        alpha[1::2] = -40.0
        a[:] = -5.0
    beta[::3] = 30.0            # sigmoid -> 1
    beta[1::3] = -30.0          # sigmoid -> ~0
    dt[:] = 0.0
    inputs = conv, alpha, beta, dt, a, state
    got, got_state = run_delta(ops, bufs, inputs, n, s, hk, hv, chunked=True, reset=True)
    rec, rec_state = run_delta(ops, bufs, inputs, n, s, hk, hv, chunked=False, reset=True)
    f = [z.astype(np.float64) for z in inputs]
    f[-1] = np.zeros_like(f[-1])
    want, want_state = delta_ref(*f, s, hk, hv)
    assert np.isfinite(got).all() and np.isfinite(got_state).all()
    scale = np.abs(want).max()
    assert scale > 0.01
    assert np.abs(got - want).max() < 1e-4 * scale + 1e-5
    assert np.abs(got - rec).max() < 1e-4 * scale + 1e-5
    assert np.abs(got_state - want_state).max() < 1e-4 * max(1.0, np.abs(want_state).max())
    assert np.abs(got_state - rec_state).max() < 1e-4 * max(1.0, np.abs(want_state).max())


@pytest.mark.parametrize("s,hk,hv", [(64, 2, 4), (128, 1, 2), (16, 3, 3)])
def test_gated_delta_prefill_then_decode(ops, bufs, rng, s, hk, hv):
    """The default forms: a 70-token prefill (the chunked kernel), then a one-token decode (the
    recurrent kernel) reading the state the prefill left."""
    n = 70
    c = 2 * hk * s + hv * s
    conv = rng.standard_normal((n + 1, c)).astype(np.float32)
    alpha = rng.standard_normal((n + 1, hv)).astype(np.float32)
    alpha[0, 0] = 25.0                    # softplus's linear branch
    beta = rng.standard_normal((n + 1, hv)).astype(np.float32)
    dt = rng.standard_normal(hv).astype(np.float32)
    a = -np.exp(rng.uniform(np.log(0.02), np.log(0.2), hv)).astype(np.float32)
    state = (0.1 * rng.standard_normal((hv, s, s))).astype(np.float32)
    b = bufs(conv=conv, alpha=alpha, beta=beta, dt=dt, a=a, state=state, out=4 * (n + 1) * hv * s)
    deltanet.gated_delta(ops, b["conv"], b["alpha"], b["beta"], b["dt"], b["a"], b["state"], b["out"], n, s, hk, hv,
                         1e-6)
    # the decode step: token n, continuing from the state the prefill left
    one = lambda t: deltanet.view(b[t], 4 * n * {"conv": c, "alpha": hv, "beta": hv, "out": hv * s}[t])
    deltanet.gated_delta(ops, one("conv"), one("alpha"), one("beta"), b["dt"], b["a"], b["state"], one("out"),
                         1, s, hk, hv, 1e-6)
    ops.sync()
    f = lambda z: z.astype(np.float64)
    want, want_state = delta_ref(f(conv), f(alpha), f(beta), f(dt), f(a), f(state), s, hk, hv)
    got = b["out"].read(np.float32).reshape(n + 1, hv, s)
    scale = np.abs(want).max()
    assert scale > 0.01   # not vacuous
    assert np.abs(got - want).max() < 1e-4 * scale + 1e-5
    assert np.abs(b["state"].read(np.float32).reshape(hv, s, s) - want_state).max() < 1e-4


def test_qgate_split_and_sigmoid_mul(ops, bufs, rng):
    n_tok, heads, hd = 5, 3, 8
    qg = rng.standard_normal((n_tok, heads, 2 * hd)).astype(np.float32)
    x = rng.standard_normal(n_tok * heads * hd).astype(np.float32)
    n = n_tok * heads * hd
    b = bufs(qg=qg, q=4 * n, g=4 * n, x=x)
    deltanet.qgate_split(ops, b["qg"], b["q"], b["g"], n, hd)
    deltanet.sigmoid_mul(ops, b["g"], b["x"], b["x"], n)
    ops.sync()
    assert np.array_equal(b["q"].read(np.float32), qg[..., :hd].ravel())
    gate = qg[..., hd:].ravel().astype(np.float64)
    assert np.abs(b["x"].read(np.float32) - x * sigmoid(gate)).max() < 1e-6


def test_sigmoid_mul_reads_the_gate_rows_in_place(ops, bufs, rng):
    """The attention's output gate read from the [query | gate] projection itself (runs of hd
    gate floats 2 hd apart, from hd on: what blocks.attention binds with QK-norm): the bits of
    qgate_split's copy then the contiguous sigmoid_mul; a run longer than its stride refused."""
    n_tok, heads, hd = 3, 4, 12
    qg = rng.standard_normal((n_tok, heads, 2 * hd)).astype(np.float32)
    x = rng.standard_normal(n_tok * heads * hd).astype(np.float32)
    n = n_tok * heads * hd
    b = bufs(qg=qg, q=4 * n, g=4 * n, x=x, x2=x)
    deltanet.qgate_split(ops, b["qg"], b["q"], b["g"], n, hd)
    deltanet.sigmoid_mul(ops, b["g"], b["x"], b["x"], n)
    deltanet.sigmoid_mul(ops, deltanet.view(b["qg"], 4 * hd), b["x2"], b["x2"], n, run=hd, stride=2 * hd)
    ops.sync()
    assert np.array_equal(b["x2"].read(np.float32), b["x"].read(np.float32))
    assert np.abs(b["x2"].read(np.float32) - x * sigmoid(qg[..., hd:].ravel().astype(np.float64))).max() < 1e-6
    with pytest.raises(UsageError, match="sigmoid_mul"):
        deltanet.sigmoid_mul(ops, b["qg"], b["x2"], b["x2"], n, run=2 * hd, stride=hd)


@pytest.mark.parametrize("chunked", [False, True])
def test_gated_delta_long_prefill(ops, bufs, rng, chunked):
    """A prefill long enough (600 tokens at S = 128) that one dispatch's loops over the state row
    would pass lavapipe's 65535 iterations a loop (the recurrent kernel went wrong from token 244
    so): gated_delta splits it into dispatches that continue the state."""
    n, s, hk, hv = 600, 128, 1, 1
    inputs = delta_inputs(rng, n, s, hk, hv)
    got, got_state = run_delta(ops, bufs, inputs, n, s, hk, hv, chunked=chunked)
    want, want_state = delta_ref(*(z.astype(np.float64) for z in inputs), s, hk, hv)
    scale = np.abs(want).max()
    assert scale > 0.01
    assert np.abs(got - want).max() < 1e-4 * scale + 1e-5
    assert np.abs(got_state - want_state).max() < 1e-4


@pytest.mark.parametrize("split", ["0", "1"], ids=["per-head", "split"])
def test_one_token_of_each_of_several_sequences(ops, bufs, rng, monkeypatch, split):
    """Parallel slots' decode: one dispatch of each kernel for one token of each of three
    sequences of a four-sequence state (the ids read from a buffer), each token continuing its
    own sequence's conv and delta-rule state: each against numpy on that state, the fourth
    sequence's state untouched.  Both recurrent forms (VRAMD_DELTA_SPLIT)."""
    monkeypatch.setenv("VRAMD_DELTA_SPLIT", split)
    s, hk, hv, d, n_seq = 32, 2, 4, 4, 4
    c = 2 * hk * s + hv * s
    seqs = np.array([3, 0, 2], np.int32)
    x = rng.standard_normal((3, c)).astype(np.float32)
    cstate = rng.standard_normal((n_seq, d - 1, c)).astype(np.float32)
    w = (0.5 * rng.standard_normal((c, d))).astype(np.float32)
    _conv, alpha, beta, dt, a, _s = delta_inputs(rng, 3, s, hk, hv)
    sstate = (0.1 * rng.standard_normal((n_seq, hv, s, s))).astype(np.float32)
    b = bufs(x=x, cstate=cstate, w=w, conv=4 * 3 * c, alpha=alpha, beta=beta, dt=dt, a=a, sstate=sstate,
             out=4 * 3 * hv * s, seqs=np.concatenate([np.zeros(1, np.int32), seqs]))
    from vramd.engine.ops import view
    ids = view(b["seqs"], 4, 12)
    with ops.batch() as batch:
        deltanet.ssm_conv_silu(ops, b["x"], b["cstate"], b["w"], b["conv"], 3, c, d, seq=ids, n_seq=n_seq)
        deltanet.gated_delta(ops, b["conv"], b["alpha"], b["beta"], b["dt"], b["a"], b["sstate"], b["out"], 3, s,
                             hk, hv, 1e-6, seq=ids, n_seq=n_seq)
        assert batch.dispatches == 2
    ops.sync()
    conv = b["conv"].read(np.float32).reshape(3, c)
    out = b["out"].read(np.float32).reshape(3, hv, s)
    cs, ss = b["cstate"].read(np.float32).reshape(cstate.shape), b["sstate"].read(np.float32).reshape(sstate.shape)
    for t, q in enumerate(seqs):
        want, want_state = conv_ref(x[t:t + 1].astype(np.float64), cstate[q].astype(np.float64), w.astype(np.float64))
        assert np.abs(conv[t] - want[0]).max() < 1e-5 and np.abs(cs[q] - want_state).max() == 0.0
        o, new = delta_ref(conv[t:t + 1].astype(np.float64), alpha[t:t + 1], beta[t:t + 1], dt, a,
                           sstate[q].astype(np.float64), s, hk, hv)
        assert np.abs(out[t] - o[0]).max() < 1e-4 and np.abs(ss[q] - new).max() < 1e-5
    assert np.array_equal(cs[1], cstate[1]) and np.array_equal(ss[1], sstate[1])   # no token of sequence 1


@pytest.mark.parametrize("n,reset", [(1, False), (5, False), (5, True), (16, False)])
@pytest.mark.parametrize("s,hk,hv", [(128, 1, 2), (64, 2, 4), (20, 3, 6), (8, 1, 1)])
def test_gated_delta_split_matches_per_head(ops, bufs, rng, monkeypatch, n, reset, s, hk, hv):
    """The split recurrent form (gated_delta_split.comp: a head's state rows over work groups of
    16 rows, 8 invocations a row) against the per-head one it replaces on GPUs (gated_delta.comp,
    the reference) and numpy: decode (1 token) and the short batches (up to CHUNKED_MIN tokens)
    the recurrent form takes, from a state and from reset, at S = 128 (the models'), 64, and
    sizes that leave rows (20: a second group of 4 rows) and lanes (8) partly empty.  The two
    forms differ only in the order of each row's S-term dot products (8 partial sums of S / 8
    terms, then their sum, against one running sum): f32 rounding of sums of ~S terms of O(1),
    a few 1e-6 of the outputs' scale; 1e-5 of it (and of the state's) passes that with room
    and fails a wrong row, lane or head by the values' own size."""
    inputs = delta_inputs(rng, n, s, hk, hv)
    monkeypatch.setenv("VRAMD_DELTA_SPLIT", "1")
    got, got_state = run_delta(ops, bufs, inputs, n, s, hk, hv, chunked=False, reset=reset)
    monkeypatch.setenv("VRAMD_DELTA_SPLIT", "0")
    ref, ref_state = run_delta(ops, bufs, inputs, n, s, hk, hv, chunked=False, reset=reset)
    f = [z.astype(np.float64) for z in inputs]
    if reset:
        f[-1] = np.zeros_like(f[-1])
    want, want_state = delta_ref(*f, s, hk, hv)
    scale, sscale = np.abs(want).max(), max(1.0, np.abs(want_state).max())
    assert scale > 0.01
    assert np.abs(got - ref).max() < 1e-5 * scale
    assert np.abs(got_state - ref_state).max() < 1e-5 * sscale
    assert np.abs(got - want).max() < 1e-4 * scale + 1e-5
    assert np.abs(got_state - want_state).max() < 1e-4 * sscale


def test_split_form_selection(ops, monkeypatch):
    """VRAMD_DELTA_SPLIT forces either recurrent form; unset, every device but a CPU one takes the
    split form; another value is refused, not ignored."""
    monkeypatch.delenv("VRAMD_DELTA_SPLIT", raising=False)
    assert deltanet.split_form(ops) is (not ops.cpu)
    monkeypatch.setenv("VRAMD_DELTA_SPLIT", "1")
    assert deltanet.split_form(ops) is True
    monkeypatch.setenv("VRAMD_DELTA_SPLIT", "0")
    assert deltanet.split_form(ops) is False
    monkeypatch.setenv("VRAMD_DELTA_SPLIT", "yes")
    with pytest.raises(UsageError, match="VRAMD_DELTA_SPLIT"):
        deltanet.split_form(ops)


@pytest.mark.parametrize("rows,width,lead", [(48, 128, 0), (6, 20, 0), (5, 18, 0), (4, 128, 1)],
                         ids=["heads-128", "vec4-20", "scalar-18", "unaligned"])
def test_rms_norm_gated_is_norm_then_silu_mul(ops, bufs, rng, rows, width, lead):
    """The DeltaNet layer's gated norm in one dispatch (rms_norm_gated.comp, through rms_row.glsl's
    vec4 and scalar paths: rows of a multiple of 4 floats at aligned offsets, or not) gives the bits
    of the two dispatches it replaces (Ops.rms_norm, then Ops.silu_mul), in place over x as the
    layer runs it, and numpy's numbers."""
    x = rng.standard_normal((rows, width)).astype(np.float32)
    z = (2 * rng.standard_normal((rows, width))).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
    pad = np.full(lead, 7, np.float32)
    b = bufs(x=np.concatenate([pad, x.ravel()]), x2=x, z=z, w=w)
    xs = deltanet.view(b["x"], 4 * lead)
    deltanet.rms_norm_gated(ops, xs, b["w"], b["z"], xs, 1e-6, rows, width)
    ops.rms_norm(b["x2"], b["w"], b["x2"], 1e-6, rows, width)
    ops.silu_mul(b["z"], b["x2"], b["x2"], rows * width)
    ops.sync()
    got = b["x"].read(np.float32)[lead:].reshape(rows, width)
    two = b["x2"].read(np.float32).reshape(rows, width)
    if lead:   # x unaligned takes rms_row's scalar path, the aligned two-dispatch copy its vec4 one:
        # another summation order (the NVIDIA driver's sums differ in the last bit; lavapipe's not)
        np.testing.assert_allclose(got, two, rtol=2e-6, atol=1e-7)
    else:
        assert np.array_equal(got, two)
    xd, zd = x.astype(np.float64), z.astype(np.float64)
    want = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + 1e-6) * w * silu(zd)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()

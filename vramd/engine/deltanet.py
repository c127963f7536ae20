"""Qwen3.5's layers (qwen35): the Gated DeltaNet linear-attention layer, and the kernels of its gated attention.

Owns the kernels only qwen35 uses (native/shaders/ssm_conv_silu, gated_delta{,_split,_chunked},
rms_norm_gated, qgate_split, sigmoid_mul: `ssm_conv_silu`, `gated_delta`, `rms_norm_gated`,
`qgate_split`, `sigmoid_mul` here, on an engine Ops) and the layer recorder `deltanet`, which
reads its model `m` as blocks.py's recorders do (spec, ops, scratch `act`, tensors `t`, cache
`kv`: the layer's recurrent state is `m.kv.conv(i, seq)` / `m.kv.ssm(i, seq)` in the `state`
region, vramd/engine/kvcache.py; `m.segs`: the batch's runs of one sequence's rows, and whether
each starts its state afresh).  The gated attention is blocks.attention with spec.attn_gate.

What they compute is tests/engine/reference/qwen35.py's header (from llama.cpp's
src/models/qwen35.cpp).  The delta rule has two GPU forms, one work group per value head and
each invocation's state row in registers in both: the recurrent one (gated_delta.comp, token by
token) for decode and short chunks, and the chunked one (gated_delta_chunked.comp, llama.cpp's
WY form as the reference's delta_rule_chunked: the same numbers) for prefill, chosen by
gated_delta above CHUNKED_MIN tokens.  The recurrent kernel stays the chunked one's reference.
The recurrent form has a second kernel, gated_delta_split.comp (a head's state rows over several
work groups, 16 rows each: decode on a GPU, split_form), held to the first.  The layer's gated
output norm is one dispatch (rms_norm_gated: rms_norm then silu_mul, the same bits).
docs/architecture.md ("Recurrent state") has the why and the measurements.
"""

from __future__ import annotations

import os
import struct

from vramd.engine.deltanet_limits import MAX_CONV, MAX_STATE
from vramd.engine.ops import view
from vramd.errors import UsageError
from vramd.gpu.kernels import Kernel, grid

# kernel -> (storage buffers, push-constant bytes): the shaders' layouts
_KERNELS = {"ssm_conv_silu": (5, 44), "gated_delta": (8, 60), "gated_delta_split": (8, 60),
            "gated_delta_chunked": (7, 52), "qgate_split": (3, 20), "sigmoid_mul": (3, 24), "rms_norm_gated": (4, 28)}
_WG = 256
# More tokens than this take the chunked kernel: its per-chunk set-up (the q/k tiles, A, QK) costs
# about what a few recurrent tokens do; on lavapipe the two cross near one chunk (16 tokens at
# S = 128) and run level at 256 tokens.  Decode (1 token) keeps the recurrent kernel.
CHUNKED_MIN = 16
_LOOP_BUDGET = 16384   # state-row loop iterations a gated_delta dispatch (see gated_delta)
SPLIT_ROWS = 16        # gated_delta_split.comp's ROWS: state rows (value indices) of one work group


def split_form(ops) -> bool:
    """Whether the recurrent delta rule takes gated_delta_split (a head's state rows over
    ceil(S / SPLIT_ROWS) work groups) rather than gated_delta (a work group a head), the same
    numbers to f32 rounding.  Every device but a CPU one: on lavapipe (2 shared cores, load ~2.5,
    scripts/delta_kernel_ab.py at Qwen3.5-27B's layer, 16 key / 48 value heads of 128) the split
    form took 19.4 ms a token against 10.0, and 78 against 38 for one token of each of 4
    sequences: its groups' barriers and repeated q/k norms are CPU work there.  On a GPU it is
    384 groups where the per-head one is 48 (native/dnet_h200.sh measures the H200).
    VRAMD_DELTA_SPLIT (benchmarks, tests): 1 takes the split form on any device, 0 the per-head
    one."""
    mode = os.environ.get("VRAMD_DELTA_SPLIT", "")
    if mode not in ("", "0", "1"):
        raise UsageError(f"VRAMD_DELTA_SPLIT={mode!r}: expected 0 or 1")
    return mode == "1" if mode else not ops.cpu


def _kernel(ops, name: str) -> Kernel:
    k = ops._kernels.get(name)
    if k is None:
        n, push = _KERNELS[name]
        k = ops._kernels[name] = Kernel(ops.residency, name, n_buffers=n, push_bytes=push)
    return k


def _groups(ops, n: int, wg: int = _WG):
    gx, gy = grid(-(-n // wg), ops.max_groups)
    return gx, gy, 1


def _seqs(ops, seq, n: int, n_seq: int, fallback):
    """The sequence ids' binding (view, int offset) and the sequences' count, or (fallback, 0), 1."""
    if seq is None:
        return fallback, 0, 1
    v, o = ops._bind(seq, 4 * n, "sequence ids")
    return v, o, n_seq


def ssm_conv_silu(ops, x, state, w, out, n: int, c: int, d: int, *, x_stride: int | None = None,
                  reset: bool = False, seq=None, n_seq: int = 1) -> None:
    """out[t, ch] = silu(sum_j w[ch, j] win_t[j]) over the d - 1 inputs before t (the state's rows
    first; zeros with reset) and x[t, ch]; state [d - 1, c] then holds the last d - 1 inputs.
    f32 throughout; x rows x_stride floats apart (default c), out [n, c] contiguous.  seq: the
    tokens' sequence ids (int32 [n]; parallel slots' decode, one token of each): state is then
    n_seq states, token t continuing its sequence's."""
    if not 1 <= d <= MAX_CONV:
        raise UsageError(f"ssm_conv_silu: {d} taps (at most {MAX_CONV})")
    x_stride = c if x_stride is None else int(x_stride)
    one = 4 * max(1, (d - 1) * c)
    xv, xo = ops._bind(x, 4 * ((n - 1) * x_stride + c), "ssm_conv x")
    qv, qo, states = _seqs(ops, seq, n, n_seq, xv)
    sv, so = ops._bind(state, states * one, "ssm_conv state")
    wv, wo = ops._bind(w, 4 * c * d, "ssm_conv weight")
    ov, oo = ops._bind(out, 4 * n * c, "ssm_conv out")
    push = struct.pack("<11I", n, c, d, xo, so, wo, oo, x_stride, int(reset), qo, one // 4 if seq is not None else 0)
    gx, gy, _ = _groups(ops, c, 64)
    ops._dispatch(_kernel(ops, "ssm_conv_silu"), [xv, sv, wv, ov, qv], push, (gx, gy, n if seq is not None else 1))


def gated_delta(ops, conv, alpha, beta, dt, a, state, out, n: int, s: int, hk: int, hv: int, eps: float, *,
                reset: bool = False, chunked: bool | None = None, seq=None, n_seq: int = 1) -> None:
    """The gated delta rule over n tokens (gated_delta.comp's header): conv [n, 2 hk s + hv s],
    alpha / beta [n, hv] (the raw projections), dt / a [hv] (ssm_dt.bias, ssm_a), state
    [hv, s, s] (read, or zeros with reset; then the new state), out [n, hv, s].  chunked picks
    the form (default: chunked above CHUNKED_MIN tokens); both leave the same state.  seq: the
    tokens' sequence ids (int32 [n]; one token of each of several sequences, the recurrent form):
    state is then n_seq states, token t continuing its sequence's."""
    if not 1 <= s <= MAX_STATE or hv % hk:
        raise UsageError(f"gated_delta: head size {s} (at most {MAX_STATE}), {hv} value heads on {hk} key heads")
    c = 2 * hk * s + hv * s
    cv, co = ops._bind(conv, 4 * n * c, "gated_delta conv")
    av, ao = ops._bind(alpha, 4 * n * hv, "gated_delta alpha")
    bv, bo = ops._bind(beta, 4 * n * hv, "gated_delta beta")
    dv, do = ops._bind(dt, 4 * hv, "gated_delta dt")
    gv, go = ops._bind(a, 4 * hv, "gated_delta a")
    ov, oo = ops._bind(out, 4 * n * hv * s, "gated_delta out")
    qv, qo, states = _seqs(ops, seq, n, n_seq, ov)
    sv, so = ops._bind(state, 4 * states * hv * s * s, "gated_delta state")
    # the recurrent form: a work group per value head, or per SPLIT_ROWS rows of one (split_form)
    rec, gx = ("gated_delta_split", hv * -(-s // SPLIT_ROWS)) if split_form(ops) else ("gated_delta", hv)
    if seq is not None:   # a work group per (value head or its rows, token), each its sequence's state
        push = struct.pack("<4If10I", n, s, hk, hv, eps, co, ao, bo, do, go, so, oo, int(reset), qo, hv * s * s)
        ops._dispatch(_kernel(ops, rec), [cv, av, bv, dv, gv, sv, ov, qv], push, (gx, n, 1))
        return
    if chunked is None:
        chunked = n > CHUNKED_MIN
    name = "gated_delta_chunked" if chunked else rec
    # At most `piece` tokens a dispatch, each continuing the state the one before left: lavapipe
    # (gallivm) cuts a shader's loops short after 65535 iterations, which it counts over the whole
    # invocation: the recurrent kernel's loops over the state row run 2 S times a token, and it
    # went wrong from token 244 at S = 128 (the chunked one's, about half as often).  Pieces of
    # _LOOP_BUDGET / S tokens (recurrent) or twice that (chunked) stay near half the limit; other
    # devices pay one dispatch a piece.
    piece = max(1, _LOOP_BUDGET // s) * (2 if chunked else 1)
    for t0 in range(0, n, piece):
        k = min(piece, n - t0)
        push = struct.pack("<4If8I", k, s, hk, hv, eps, co + t0 * c, ao + t0 * hv, bo + t0 * hv, do, go, so,
                           oo + t0 * hv * s, int(reset and t0 == 0))
        views = [cv, av, bv, dv, gv, sv, ov]
        if not chunked:   # the recurrent form's sequence ids: none (bound, never read)
            push += struct.pack("<2I", 0, 0)
            views.append(ov)
        ops._dispatch(_kernel(ops, name), views, push, (hv if chunked else gx, 1, 1))


def rms_norm_gated(ops, x, w, z, y, eps: float, n_rows: int, width: int) -> None:
    """y[r] = silu(z[r]) * rms_norm(x[r]) * w per row of `width` floats (rms_norm_gated.comp:
    Ops.rms_norm then Ops.silu_mul, the same bits, in one dispatch).  x, z, y: f32 [n_rows,
    width] contiguous (y may be x, not z); w: f32 [width]."""
    xv, xo = ops._bind(x, 4 * n_rows * width, "rms_norm_gated x")
    wv, wo = ops._bind(w, 4 * width, "rms_norm_gated weight")
    zv, zo = ops._bind(z, 4 * n_rows * width, "rms_norm_gated z")
    yv, yo = ops._bind(y, 4 * n_rows * width, "rms_norm_gated y")
    gx, gy = grid(n_rows, ops.max_groups)
    ops._dispatch(_kernel(ops, "rms_norm_gated"), [xv, wv, zv, yv],
                  struct.pack("<2If4I", width, n_rows, eps, xo, wo, zo, yo), (gx, gy, 1))


def qgate_split(ops, qg, q, gate, n: int, hd: int) -> None:
    """qg [n / hd heads x rows, 2 hd] (per head query then gate) -> q and gate [n] each."""
    qv, qo = ops._bind(qg, 8 * n, "qgate_split qg")
    v1, o1 = ops._bind(q, 4 * n, "qgate_split q")
    v2, o2 = ops._bind(gate, 4 * n, "qgate_split gate")
    ops._dispatch(_kernel(ops, "qgate_split"), [qv, v1, v2], struct.pack("<5I", n, hd, qo, o1, o2),
                  _groups(ops, n))


def sigmoid_mul(ops, gate, x, out, n: int, *, run: int = 1, stride: int = 1) -> None:
    """out[i] = x[i] * sigmoid(g_i), i < n (f32; out may be x), g_i = gate[(i // run) * stride +
    i % run]: runs of `run` floats `stride` apart (default contiguous; the attention's gate rows
    in its [query | gate] projection: run hd, stride 2 hd)."""
    if not 1 <= run <= stride:
        raise UsageError(f"sigmoid_mul: gate runs of {run} floats {stride} apart")
    gv, go = ops._bind(gate, 4 * ((n - 1) // run * stride + (n - 1) % run + 1), "sigmoid_mul gate")
    xv, xo = ops._bind(x, 4 * n, "sigmoid_mul x")
    ov, oo = ops._bind(out, 4 * n, "sigmoid_mul out")
    ops._dispatch(_kernel(ops, "sigmoid_mul"), [gv, xv, ov], struct.pack("<6I", n, go, xo, oo, run, stride),
                  _groups(ops, n))


def deltanet(m, i: int, n: int) -> None:
    """Layer i's Gated DeltaNet, from h = attn_norm(x): x += ssm_out(rms_norm(o, ssm_norm) *
    silu(z)), then h = the FFN's input norm of x.  The conv and delta-rule states of the layer
    (m.kv.conv(i, seq), m.kv.ssm(i, seq)) of each sequence of m.segs are continued, or started
    afresh where its reset says."""
    from vramd.engine.blocks import linears, rows, seq_ids, seq_runs   # blocks imports this module (the gate)
    s, ops, a, t = m.spec, m.ops, m.act, m.t
    d, p, E = s.deltanet, f"blk.{i}.", s.n_embd
    C, V = d.conv_dim, d.value_dim
    linears(m, [(p + "attn_qkv", a["h"], a["mixed"], C), (p + "attn_gate", a["h"], a["z"], V),
                (p + "ssm_alpha", a["h"], a["alpha"], d.hv), (p + "ssm_beta", a["h"], a["beta"], d.hv)], n)
    for r0, r1, seq, reset in seq_runs(m, m.seq_kernels):   # each sequence's rows continue its own state
        k = r1 - r0
        if seq is None:   # decode rows of several sequences: every state bound, each row's id read
            conv, ssm, more = m.kv.conv_all(i), m.kv.ssm_all(i), {"seq": seq_ids(m, r0, r1), "n_seq": m.kv.n_seq}
        else:
            conv, ssm, more = m.kv.conv(i, seq), m.kv.ssm(i, seq), {}
        ssm_conv_silu(ops, rows(a["mixed"], r0, r1, C), conv, t.vector(p + "ssm_conv1d.weight", C * d.d_conv),
                      rows(a["conv"], r0, r1, C), k, C, d.d_conv, reset=reset, **more)
        gated_delta(ops, rows(a["conv"], r0, r1, C), rows(a["alpha"], r0, r1, d.hv), rows(a["beta"], r0, r1, d.hv),
                    t.vector(p + "ssm_dt.bias"), t.vector(p + "ssm_a"), ssm, rows(a["dno"], r0, r1, V),
                    k, d.s, d.hk, d.hv, s.eps, reset=reset, **more)
    rms_norm_gated(ops, a["dno"], t.vector(p + "ssm_norm.weight"), a["z"], a["dno"], s.eps, n * d.hv, d.s)
    linears(m, [(p + "ssm_out", a["dno"], a["h"], E)], n)
    ops.add_rms_norm(a["x"], a["h"], t.vector(p + s.ffn_norm + ".weight"), a["h"], s.eps, n, E)


__all__ = ["CHUNKED_MIN", "deltanet", "gated_delta", "qgate_split", "rms_norm_gated", "sigmoid_mul", "split_form",
           "ssm_conv_silu", "view"]

"""The dense FFN beside a layer's experts, and the norms around both (gemma4's 26B-A4B).

Owns the two ends of such a layer's FFN (MoESpec.dense_beside; what it
computes: vramd/engine/arch/gemma4_moe.py), which vramd/engine/moe.py calls
on either path (GPU- or host-routed) around its routed experts:

  inputs(m, i, n)   from h = ffn_norm(x): the dense FFN, post_ffw_norm_1-normed,
                    into `shexp` (llama.cpp computes it as the layer's "shared
                    expert"); h = pre_ffw_norm_2(x), the experts' input; `hr` =
                    rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale, the router's
                    input, which it returns
  finish(m, i, n)   from `mo` = the weighted experts (moe_combine assigns it):
                    h = post_ffw_norm(post_ffw_norm_2(mo) + shexp); then the
                    layer's end (x += h, layer_output_scale, h = the next norm)
"""

from __future__ import annotations

import math

from vramd.engine import blocks


def inputs(m, i: int, n: int):
    s, ops, a, t = m.spec, m.ops, m.act, m.t
    p, E, F = f"blk.{i}.", s.n_embd, s.n_ff_of(i)
    with ops.parallel():   # everything that reads h = ffn_norm(x) or x
        ops.matvec(t.matrix(p + "ffn_gate.weight"), a["h"], a["gate"], n)
        ops.matvec(t.matrix(p + "ffn_up.weight"), a["h"], a["up"], n)
        ops.rms_norm(a["x"], t.vector(p + "ffn_gate_inp.scale"), a["hr"], s.eps, n, E)
    with ops.parallel():
        ops.gelu_mul(a["gate"], a["up"], a["gate"], n * F)
        ops.rms_norm(a["x"], t.vector(p + "pre_ffw_norm_2.weight"), a["h"], s.eps, n, E)
        ops.scale(a["hr"], a["hr"], n * E, 1.0 / math.sqrt(E))
    ops.matvec(t.matrix(p + "ffn_down.weight"), a["gate"], a["shexp"], n)
    ops.rms_norm(a["shexp"], t.vector(p + "post_ffw_norm_1.weight"), a["shexp"], s.eps, n, E)
    return a["hr"]


def finish(m, i: int, n: int) -> None:
    s, ops, a, t = m.spec, m.ops, m.act, m.t
    p, E = f"blk.{i}.", s.n_embd
    ops.rms_norm(a["mo"], t.vector(p + "post_ffw_norm_2.weight"), a["mo"], s.eps, n, E)
    ops.add_rms_norm(a["mo"], a["shexp"], t.vector(p + "post_ffw_norm.weight"), a["h"], s.eps, n, E)
    blocks.end_layer(m, i, n)

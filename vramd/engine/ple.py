"""Per-layer embeddings (PLE, Gemma 4 E2B / E4B): each layer's extra input per token, and how a layer mixes it in.

What llama.cpp 0c1e570 computes (src/models/gemma4.cpp: build_inp_per_layer,
project_per_layer_inputs and the graph's "per-layer embedding" step), for
P = embedding_length_per_layer_input, L layers, E = n_embd, x0 = the scaled
token embedding (token_embd[t] * sqrt(E)):

  inputs, once per token:
    proj = rms_norm_per_layer(per_layer_model_proj x0 / sqrt(E)) * per_layer_proj_norm   [L, P]
    tok  = per_layer_token_embd[t] * sqrt(P)                                            [L, P]
    ple  = (proj + tok) / sqrt(2)
  layer l, after the FFN's residual add (x), before layer_output_scale:
    x = x + rms_norm(blk.l.proj (gelu(blk.l.inp_gate x) * ple[l])) * blk.l.post_norm

Owns: `inputs` (ple for a chunk, token-major [n, L * P] in the scratch's
"ple_all"), `layer_term` (h = the layer's term; blocks.end_layer adds it),
`write_index`; scratch.py sizes the buffers).  A layer reads its
[n, P] slab of the token-major rows through get_rows over "ple_all" as an F32
table of n * L rows of P, with the constant row numbers t * L + l in
"ple_idx" (l * B + t: B the scratch's tokens): one gather per layer instead of
a transposing kernel.

Where the table lives.  llama.cpp keeps per_layer_token_embd on the host (an
input-layer tensor: the CPU buffer, read lazily from the mapping above 4 GiB)
and gathers its rows there.  vramd keeps it in the weights region on the
device and gathers on the GPU with the same get_rows as token_embd: the
decode step stays one replayed recording, at the cost of the table's bytes
of device memory, which `vramd plan` counts as weights.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType

from vramd.engine.ops import Weight, view


def _rows(m) -> int:
    return m.act["ple_idx"].nbytes // (4 * m.spec.n_layer)


def write_index(m) -> None:
    """ple_idx[l * B + t] = t * L + l: layer l's rows of the token-major ple_all."""
    L, B = m.spec.n_layer, _rows(m)
    m.act["ple_idx"].write((np.arange(B, dtype=np.int32)[None, :] * L + np.arange(L, dtype=np.int32)[:, None]))


def inputs(m, n: int) -> None:
    """ple_all = the n tokens' per-layer inputs, from x = the scaled token embeddings and ids."""
    s, ops, a, t = m.spec, m.ops, m.act, m.t
    P, E, nlp = s.ple, s.n_embd, n * s.n_layer * s.ple
    ops.matvec(t.matrix("per_layer_model_proj.weight"), a["x"], a["ple_all"], n)
    ops.get_rows(t.matrix("per_layer_token_embd.weight"), a["ids"], a["ple_tok"], n)
    ops.scale(a["ple_all"], a["ple_all"], nlp, 1.0 / math.sqrt(E))
    ops.rms_norm(a["ple_all"], t.vector("per_layer_proj_norm.weight"), a["ple_all"], s.eps, n * s.n_layer, P)
    ops.scale(a["ple_tok"], a["ple_tok"], nlp, math.sqrt(P))
    ops.add(a["ple_all"], a["ple_tok"], a["ple_all"], nlp)
    ops.scale(a["ple_all"], a["ple_all"], nlp, 1.0 / math.sqrt(2.0))


def layer_term(m, i: int, n: int) -> None:
    """h = rms_norm(proj(gelu(inp_gate x) * ple[i])) * post_norm for layer i's n tokens."""
    s, ops, a, t = m.spec, m.ops, m.act, m.t
    p, P, B = f"blk.{i}.", s.ple, _rows(m)
    table = Weight(view(a["ple_all"], 0, 4 * B * s.n_layer * P), GGMLQuantizationType.F32, B * s.n_layer, P)
    ops.matvec(t.matrix(p + "inp_gate.weight"), a["x"], a["ple_g"], n)
    ops.get_rows(table, view(a["ple_idx"], 4 * i * B, 4 * n), a["ple_in"], n)
    ops.gelu_mul(a["ple_g"], a["ple_in"], a["ple_g"], n * P)
    ops.matvec(t.matrix(p + "proj.weight"), a["ple_g"], a["h"], n)
    ops.rms_norm(a["h"], t.vector(p + "post_norm.weight"), a["h"], s.eps, n, s.n_embd)

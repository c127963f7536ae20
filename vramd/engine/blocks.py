"""The layer math, recorded once for every architecture: embedding, attention, dense FFN, logits.

Each function records ops for n tokens of a model (`m`, a
vramd/engine/model.py TransformerModel: its spec, ops, scratch `act`,
tensor table `t` and KV cache `kv`) into the batch being recorded.  What an
architecture changes is read from `m.spec` (vramd/engine/arch/spec.py), so
an optimisation made here lands in every architecture at once.  The routed
FFN of mixture-of-experts layers is vramd/engine/moe.py, Qwen3.5's DeltaNet layers and its
attention gate's kernels vramd/engine/deltanet.py.

Sequences: `m.segs` lists the recorded batch's runs of one sequence's rows
((first row, end row, sequence, reset)); the projections and FFNs run over
every row at once, the KV writes and the attention (here) and the recurrent
layers (deltanet.py) per run, on that sequence's region of the cache.

The residual stream is `x`; between layers `h` already holds the next
layer's normed input: every layer starts from h = attn_norm(x) and ends with
x updated and h = next_norm(x) (the following layer's attn_norm, after the
last the output_norm), the residual add fused with that norm.
"""

from __future__ import annotations

from vramd.engine import deltanet, ple
from vramd.engine.ops import view


def rows(buf, r0: int, r1: int, width: int):
    """Rows r0..r1 of a scratch buffer of `width`-float (or int32) rows, as a view."""
    return view(buf, 4 * r0 * width, 4 * (r1 - r0) * width)


def linears(m, items, n: int) -> None:
    """y = W x (+ bias) for independent (name, x, y, width) items: the matvecs
    run side by side (one barrier after them all), then the bias adds, likewise."""
    ops = m.ops
    with ops.parallel():
        for name, x, y, _width in items:
            ops.matvec(m.t.matrix(name + ".weight"), x, y, n)
    biases = [(y, b, width) for name, _x, y, width in items if (b := m.t.vector(name + ".bias", width)) is not None]
    if biases:
        with ops.parallel():
            for y, b, width in biases:
                ops.add(y, b, y, n * width, width)


def embed(m, n: int) -> None:
    """x = token_embd[ids] (* embed_scale); h = blk.0.attn_norm(x)."""
    s, ops, a = m.spec, m.ops, m.act
    ops.get_rows(m.t.matrix("token_embd.weight"), a["ids"], a["x"], n)
    if s.embed_scale != 1.0:
        ops.scale(a["x"], a["x"], n * s.n_embd, s.embed_scale)
    if s.ple:
        ple.inputs(m, n)
    ops.rms_norm(a["x"], m.t.vector("blk.0.attn_norm.weight"), a["h"], s.eps, n, s.n_embd)


def next_norm(m, i: int):
    """The norm that follows layer i: the next layer's attn_norm, after the last the output_norm."""
    return m.t.vector(f"blk.{i + 1}.attn_norm.weight" if i + 1 < m.spec.n_layer else "output_norm.weight")


def mixer(m, i: int, n: int) -> None:
    """Layer i's token mixer: attention, or Qwen3.5's Gated DeltaNet where the layer is recurrent."""
    (deltanet.deltanet if m.spec.layers[i].recurrent else attention)(m, i, n)


def attention(m, i: int, n: int) -> None:
    """Layer i's attention, from h = attn_norm(x): x += Wo attention(...) (post-normed
    where the spec says), then h = ffn_norm(x)."""
    s, ops, a, t, kv = m.spec, m.ops, m.act, m.t, m.kv
    p, layer, E = f"blk.{i}.", s.layers[i], s.n_embd
    hd, n_kv, Q, KV = s.head_dim_of(i), s.n_head_kv_of(i), s.q_width_of(i), s.kv_width_of(i)
    q_out, q_rows = (a["qg"], 2 * Q) if s.attn_gate else (a["q"], Q)
    own_kv = layer.kv_source < 0   # else the layer reads an earlier layer's K/V (gemma4 E2B/E4B)
    items = [(p + "attn_q", a["h"], q_out, q_rows)] + ([(p + "attn_k", a["h"], a["k"], KV)] if own_kv else [])
    linears(m, items if layer.v_from_k or not own_kv else items + [(p + "attn_v", a["h"], a["v"], KV)], n)
    # qwen35: each head's [query | gate] rows apart.  With QK-norm (every qwen35) the norm reads the
    # query rows where they are and the output gate its rows likewise (sigmoid_mul's runs): no
    # qgate_split copy, one dispatch and barrier fewer a layer, the same numbers.
    split_gate = s.attn_gate and not s.qk_norm
    if split_gate:
        deltanet.qgate_split(ops, a["qg"], a["q"], a["agate"], n * Q, hd)
    if own_kv and layer.v_from_k and not s.v_norm:   # V is K's projection, taken before k's norm (gemma4's k_eq_v)
        ops.copy(a["k"], a["v"], 4 * n * KV)
    elif own_kv and s.v_norm:   # per head, no weight; from k before its norm where V is K
        ops.rms_norm(a["k"] if layer.v_from_k else a["v"], None, a["v"], s.eps, n * n_kv, hd)
    if s.qk_norm:   # every head's row of head_dim floats is a row of its own
        with ops.parallel():
            ops.rms_norm(a["qg"] if s.attn_gate else a["q"], t.vector(p + "attn_q_norm.weight"), a["q"], s.eps,
                         n * s.n_head, hd, x_stride=2 * hd if s.attn_gate else hd)
            if own_kv:
                ops.rms_norm(a["k"], t.vector(p + "attn_k_norm.weight"), a["k"], s.eps, n * n_kv, hd)
    factors = s.rope_factors_name(kv.ctx) if layer.rope_factors else None
    rope = dict(s.rope_params(i), freq_factors=t.vector(factors) if factors else None)
    temperature = (s.attn_temp_scale, s.attn_temp_floor, s.attn_temp_offset) if s.attn_temp_scale else None
    sinks = t.vector(p + "attn_sinks.weight", s.n_head) if s.attn_sinks else None
    runs = attention_runs(m, KV)
    with ops.parallel():   # q rotates in place, k rotated into the cache, v to the cache as it is
        ops.rope(a["q"], a["pos"], n, s.n_head, hd, temperature=temperature, **rope)
        if own_kv:   # a KV-sharing layer writes none (gemma4 E2B/E4B)
            for r0, r1, seq in runs:   # each sequence's rows into its own region
                k, kc, vc, more = r1 - r0, *_caches(m, i, r0, r1, seq)
                pos = rows(a["pos"], r0, r1, 1)
                ops.rope_kv_write(rows(a["k"], r0, r1, KV), kc, pos, k, n_kv, hd, kv.ctx, **rope, **more)
                ops.kv_write(rows(a["v"], r0, r1, KV), vc, pos, k, KV, kv.ctx, **more)
    # tmp: a buffer free until the FFN, where decode attention keeps its per-range partials
    # (the dispatches one after another).
    for r0, r1, seq in runs:
        k, kc, vc, more = r1 - r0, *_caches(m, i, r0, r1, seq)
        ops.attention(rows(a["q"], r0, r1, Q), kc, vc, rows(a["pos"], r0, r1, 1), rows(a["att"], r0, r1, Q), k,
                      s.n_head, n_kv, hd, kv.ctx, s.scale, window=layer.window, tmp=a[m.att_tmp],
                      softcap=s.attn_softcap, sinks=sinks, **more)
    if split_gate:
        deltanet.sigmoid_mul(ops, a["agate"], a["att"], a["att"], n * Q)
    elif s.attn_gate:
        deltanet.sigmoid_mul(ops, view(a["qg"], 4 * hd), a["att"], a["att"], n * Q, run=hd, stride=2 * hd)
    linears(m, [(p + "attn_output", a["att"], a["h"], E)], n)
    if s.post_norms:
        ops.rms_norm(a["h"], t.vector(p + "post_attention_norm.weight"), a["h"], s.eps, n, E)
    ops.add_rms_norm(a["x"], a["h"], t.vector(p + s.ffn_norm + ".weight"), a["h"], s.eps, n, E)


def seq_runs(m, merge: bool) -> list[tuple[int, int, int | None, bool]]:
    """The dispatches of a layer's per-sequence ops for m.segs: (first row, end row, sequence,
    reset) of a run of one sequence's rows (a prefill chunk; a decode row without `merge`),
    or with `merge` (sequence None) consecutive decode rows, of different sequences, that do
    not start their state: one dispatch for them all, reading each row's sequence id
    (seq_ids), so that a recorded step serves any sequences."""
    out = []
    for r0, r1, seq, reset in m.segs:
        one = merge and r1 - r0 == 1 and not reset
        if one and out and out[-1][4]:
            out[-1] = (out[-1][0], r1, None, False, True)
        else:
            out.append((r0, r1, seq, reset, one))
    return [(r0, r1, None if one else seq, reset) for r0, r1, seq, reset, one in out]


def seq_ids(m, r0: int, r1: int):
    """Rows r0..r1's sequence ids: in the scratch's pos, after the positions (model.seq_at)."""
    return view(m.act["pos"], m.seq_at + 4 * r0, 4 * (r1 - r0))


def attention_runs(m, width: int) -> list[tuple[int, int, int | None]]:
    """seq_runs for a layer of K/V rows `width` wide: decode rows merged where the kernels can
    bind the whole cache (model.seq_kernels) and the rows are the layout's width."""
    merge = m.seq_kernels and width == m.kv.layout.k_width == m.kv.layout.v_width
    return [(r0, r1, seq) for r0, r1, seq, _reset in seq_runs(m, merge)]


def _caches(m, i: int, r0: int, r1: int, seq):
    """The K and V caches a run binds (its sequence's region, or every sequence's with the
    run's sequence ids) and the kernels' keywords for it."""
    if seq is not None:
        return m.kv.k_seq(i, seq), m.kv.v_seq(i, seq), {}
    return m.kv.k(i), m.kv.v(i), {"seq": seq_ids(m, r0, r1), "n_seq": m.kv.n_seq}


def dense_ffn(m, i: int, n: int) -> None:
    """Layer i's gated FFN, from h = ffn_norm(x): x += Wdown(act(Wgate h) * Wup h); h = next norm."""
    s, ops, a = m.spec, m.ops, m.act
    p, E, F = f"blk.{i}.", s.n_embd, s.n_ff_of(i)
    linears(m, [(p + "ffn_gate", a["h"], a["gate"], F), (p + "ffn_up", a["h"], a["up"], F)], n)
    (ops.gelu_mul if s.activation == "gelu" else ops.silu_mul)(a["gate"], a["up"], a["gate"], n * F)
    linears(m, [(p + "ffn_down", a["gate"], a["h"], E)], n)
    if s.post_norms:
        ops.rms_norm(a["h"], m.t.vector(p + "post_ffw_norm.weight"), a["h"], s.eps, n, E)
    end_layer(m, i, n)


def end_layer(m, i: int, n: int) -> None:
    """x += h (the layer's last output; with per-layer embeddings, then x += their term);
    x *= the layer's out_scale (gemma4); h = next norm(x)."""
    s, ops, a, E = m.spec, m.ops, m.act, m.spec.n_embd
    scale = s.layers[i].out_scale
    if s.ple:   # x += h, then h = the layer's per-layer-embedding term, added below (gemma4 E2B/E4B)
        ops.add(a["x"], a["h"], a["x"], n * E, n * E)
        ple.layer_term(m, i, n)
    if scale == 1.0:
        ops.add_rms_norm(a["x"], a["h"], next_norm(m, i), a["h"], s.eps, n, E)
        return
    ops.add(a["x"], a["h"], a["x"], n * E, n * E)
    ops.scale(a["x"], a["x"], n * E, scale)
    ops.rms_norm(a["x"], next_norm(m, i), a["h"], s.eps, n, E)


def logits(m, n: int, rows: tuple) -> None:
    """The logits of `rows` (of the n tokens, ascending) into logits[0..len(rows)), from h = output_norm(x)."""
    s, ops, a, E, V = m.spec, m.ops, m.act, m.spec.n_embd, m.spec.n_vocab
    out = m.t.matrix("token_embd.weight" if s.tied_output else "output.weight")
    if rows == tuple(range(rows[0], rows[0] + len(rows))):   # contiguous: one matvec
        ops.matvec(out, view(a["h"], 4 * rows[0] * E, 4 * len(rows) * E), a["logits"], len(rows))
    else:
        for j, r in enumerate(rows):
            ops.matvec(out, view(a["h"], 4 * r * E, 4 * E), view(a["logits"], 4 * j * V, 4 * V), 1)
    if s.final_softcap > 0:
        ops.softcap(a["logits"], a["logits"], len(rows) * V, s.final_softcap)

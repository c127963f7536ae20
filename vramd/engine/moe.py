"""The routed FFN of mixture-of-experts layers (qwen3moe, qwen2moe, mixtral: vramd/engine/arch/moe.py;
gpt-oss; gemma4's 26B-A4B, whose dense FFN beside the experts is vramd/engine/moe_beside.py).

Owns: `route` (the host's routing rule, the reference the GPU's moe_route
follows), `gpu_routable`, and the two ways a layer's experts are computed,
chosen per layer by the model (vramd/engine/model.py):

GPU-routed (`gpu_experts`; every expert tensor of the layer on the device,
the common case with `--n-cpu-moe 0`): moe_route picks the experts on the
GPU into a small ids/weights buffer, matvec_id runs all k experts' gate, up
and down in one dispatch each (the expert ids read on the GPU, offsets into
the stacked tensors), moe_combine adds the weighted outputs (and qwen2moe's
gated shared expert) to the residual stream.  No readback, so such layers
record into the same batch as the attention, and a model whose layers all
route on the GPU replays its decode step.

Host-routed (`host_routed_layer`; a layer with an expert tensor
`--n-cpu-moe` placed on the host, or one the GPU path cannot bind): the
router's logits are read back after the layer's attention, the experts
chosen on the CPU, and computed on the GPU from views into the stacked
tensors and on the CPU for the host-placed tensors (the native host matvec,
vramd/engine/hostmv.py: all the selected experts of a chunk in one call of
a thread pool, gate and up, then down); the two meet in the residual stream
on the GPU.  Such a layer costs a device round trip.

Both start from h = ffn_norm(x) and end with x += the experts and h = the
next norm of x, as every layer of vramd/engine/blocks.py.
"""

from __future__ import annotations

import math

import numpy as np

from vramd.engine import blocks, hostmv, linear, moe_beside
from vramd.engine.ops import ROUTE_MAX_EXPERTS, ROUTE_MAX_USED, row_bytes, view
from vramd.model.placement import EXPERT_KINDS


def route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts per row of router logits: (ids [n, k], weights [n, k]).

    softmax over all experts, the k most probable (ties: lower id first, a
    stable sort), renormalised to sum 1 when the architecture says so."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return ids, w


def gpu_routable(m, i: int) -> bool:
    """Whether layer i can route on the GPU: its expert tensors are all on
    the device, the routing kernel takes n_expert and k, and one expert's
    matrix fits a storage binding (matvec_id binds a stack in runs of whole
    experts).  Otherwise the layer is host-routed."""
    moe = m.spec.moe
    if moe.n_expert > ROUTE_MAX_EXPERTS or moe.n_used > ROUTE_MAX_USED:
        return False
    names = [f"blk.{i}.{kind}.weight" for kind in EXPERT_KINDS]
    return all(not m.t.on_host(name) and m.ops.fits_matvec_id(m.t.stack(name)) for name in names)


def activate(m, gate, up, out, n: int) -> None:
    """The experts' gated activation: silu(gate) * up, gelu(gate) * up (gemma4), or gpt-oss's clamped SwiGLU."""
    moe = m.spec.moe
    if moe.activation == "swiglu_oai":
        m.ops.swiglu_oai(gate, up, out, n, moe.swiglu_alpha, moe.swiglu_limit)
    elif moe.activation == "gelu":
        m.ops.gelu_mul(gate, up, out, n)
    else:
        m.ops.silu_mul(gate, up, out, n)


def gpu_experts(m, i: int, n: int) -> None:
    """Layer i's routed FFN on the GPU: x += sum_j w_j expert_j(h) (+ sigmoid(g . h)
    shared(h), qwen2moe); h = next norm.  A dispatch each for the routing (and
    the grouping by expert, prefill), all slots' gate, up and down, and the
    weighted sum; nothing read back."""
    s, ops, a, t = m.spec, m.ops, m.act, m.t
    moe = s.moe
    p, E, k, F = f"blk.{i}.", s.n_embd, moe.n_used, moe.n_ff_exp
    slots = n * k
    shared = moe.n_ff_shexp > 0
    router_in = moe_beside.inputs(m, i, n) if moe.dense_beside else a["h"]
    with ops.parallel():   # everything that reads only h
        ops.matvec(t.matrix(p + "ffn_gate_inp.weight"), router_in, a["router"], n)
        if shared:
            ops.matvec(t.matrix(p + "ffn_gate_inp_shexp.weight"), a["h"], a["shgate"], n)
            ops.matvec(t.matrix(p + "ffn_gate_shexp.weight"), a["h"], a["sg"], n)
            ops.matvec(t.matrix(p + "ffn_up_shexp.weight"), a["h"], a["su"], n)
    if moe.biases:
        ops.add(a["router"], t.vector(p + "ffn_gate_inp.bias"), a["router"], n * moe.n_expert, moe.n_expert)
    with ops.parallel():
        ops.moe_route(a["router"], a["route_ids"], a["route_w"], n, moe.n_expert, k, moe.renormalize,
                      scale=t.vector(p + "ffn_down_exps.scale") if moe.expert_scale else None)
        if shared:
            ops.silu_mul(a["sg"], a["su"], a["sg"], n * moe.n_ff_shexp)
    gate, up, down = (t.stack(p + kind + ".weight") for kind in EXPERT_KINDS)
    grouped = linear.grouped(n, k, moe.n_expert, ops.cpu)
    if grouped:
        ops.moe_group(a["route_ids"], a["route_groups"], slots, moe.n_expert)

    def experts(w, x, y, x_div=1):
        if grouped:
            ops.matmul_id(w, moe.n_expert, a["route_groups"], x, y, slots, x_div=x_div)
        else:
            ops.matvec_id(w, moe.n_expert, a["route_ids"], x, y, slots, x_div=x_div)

    with ops.parallel():   # a token's k slots all read its h row (x_div = k)
        experts(gate, a["h"], a["eg"], k)
        experts(up, a["h"], a["eu"], k)
        if shared:
            ops.matvec(t.matrix(p + "ffn_down_shexp.weight"), a["sg"], a["shexp"], n)
    if moe.biases:
        with ops.parallel():
            ops.add_id(a["eg"], t.vector(p + "ffn_gate_exps.bias"), a["route_ids"], slots, F, moe.n_expert)
            ops.add_id(a["eu"], t.vector(p + "ffn_up_exps.bias"), a["route_ids"], slots, F, moe.n_expert)
    activate(m, a["eg"], a["eu"], a["eg"], slots * F)
    experts(down, a["eg"], a["ed"])
    if moe.biases:
        ops.add_id(a["ed"], t.vector(p + "ffn_down_exps.bias"), a["route_ids"], slots, E, moe.n_expert)
    if moe.dense_beside:
        ops.moe_combine(a["mo"], a["ed"], a["route_w"], n, k, E, assign=True)
        moe_beside.finish(m, i, n)
        return
    ops.moe_combine(a["x"], a["ed"], a["route_w"], n, k, E, shared=a["shexp"] if shared else None,
                    shared_gate=a["shgate"] if shared else None)
    ops.rms_norm(a["x"], blocks.next_norm(m, i), a["h"], s.eps, n, E)


def host_routed_layer(m, i: int, n: int) -> None:
    """Layer i (attention and experts) with the routing read back and chosen
    on the CPU, in its own batches and syncs: experts on the host computed by
    the native host matvec, those on the device by one matvec per expert."""
    s, ops, a, t = m.spec, m.ops, m.act, m.t
    moe = s.moe
    p, E, F = f"blk.{i}.", s.n_embd, moe.n_ff_exp
    shared = moe.n_ff_shexp > 0
    with ops.batch():
        blocks.mixer(m, i, n)
        router_in = moe_beside.inputs(m, i, n) if moe.dense_beside else a["h"]
        ops.matvec(t.matrix(p + "ffn_gate_inp.weight"), router_in, a["router"], n)
        if moe.biases:
            ops.add(a["router"], t.vector(p + "ffn_gate_inp.bias"), a["router"], n * moe.n_expert, moe.n_expert)
        if shared:   # qwen2moe's shared expert, and its scalar gate
            ops.matvec(t.matrix(p + "ffn_gate_inp_shexp.weight"), a["h"], a["shgate"], n)
            _dense_per_token(m, p + "ffn_gate_shexp", p + "ffn_up_shexp", p + "ffn_down_shexp", a["h"], a["shexp"],
                             n, moe.n_ff_shexp)
    ops.sync()
    router = a["router"].read(np.float32, 0, 4 * n * moe.n_expert).reshape(n, moe.n_expert)
    ids, weights = route(router.astype(np.float64), moe.n_used, moe.renormalize)
    if moe.expert_scale:
        weights = weights * _expert_scales(m, i)[ids]
    names = [p + kind + ".weight" for kind in EXPERT_KINDS]
    # How many of this layer's expert tensors are on the host: 0..3, a prefix of gate, up, down.
    n_host = sum(t.on_host(name) for name in names)
    # Where the experts' sum goes: the residual stream, or gemma4's own buffer (normed, then added).
    out = "mo" if moe.dense_beside else "x"
    if n_host:
        # The host's share: the gate (1), gate and up (2), or the whole
        # expert (3); the device takes up from `part`, or adds `cpu`.
        h = a["h"].read(np.float32, 0, 4 * n * E).reshape(n, E)
        a["part" if n_host < 3 else "cpu"].write(_host_experts(m, names[:n_host], ids, weights, h,
                                                                _expert_biases(m, i, n_host)))
    if out == "mo" and n_host < 3:
        a["mo"].write(np.zeros(n * E, np.float32))
    with ops.batch():
        if n_host == 3:
            if out == "mo":
                ops.copy(a["cpu"], a["mo"], 4 * n * E)
            else:
                ops.add(a["x"], a["cpu"], a["x"], n * E)
        else:
            for tok in range(n):
                h_t = view(a["h"], 4 * tok * E, 4 * E)
                x_t = view(a[out], 4 * tok * E, 4 * E)
                for j, e in enumerate(ids[tok]):
                    e = int(e)
                    slot = view(a["part"], 4 * (tok * moe.n_used + j) * F, 4 * F)
                    if n_host == 0:
                        ops.matvec(t.expert(names[0], e), h_t, a["g1"], 1)
                        ops.matvec(t.expert(names[1], e), h_t, a["u1"], 1)
                        _expert_bias(m, p + "ffn_gate_exps.bias", e, a["g1"], F)
                        _expert_bias(m, p + "ffn_up_exps.bias", e, a["u1"], F)
                        activate(m, a["g1"], a["u1"], a["g1"], F)
                        ops.matvec(t.expert(names[2], e), a["g1"], a["tmp"], 1)
                    elif n_host == 1:
                        ops.matvec(t.expert(names[1], e), h_t, a["u1"], 1)
                        _expert_bias(m, p + "ffn_up_exps.bias", e, a["u1"], F)
                        activate(m, slot, a["u1"], a["g1"], F)
                        ops.matvec(t.expert(names[2], e), a["g1"], a["tmp"], 1)
                    else:
                        ops.matvec(t.expert(names[2], e), slot, a["tmp"], 1)
                    _expert_bias(m, p + "ffn_down_exps.bias", e, a["tmp"], E)
                    ops.scale(a["tmp"], a["tmp"], E, float(weights[tok, j]))
                    ops.add(x_t, a["tmp"], x_t, E)
    if shared:
        ops.sync()
        g = a["shgate"].read(np.float32, 0, 4 * n).astype(np.float64)
        with ops.batch():
            for tok in range(n):
                s_t = view(a["shexp"], 4 * tok * E, 4 * E)
                x_t = view(a["x"], 4 * tok * E, 4 * E)
                ops.scale(s_t, s_t, E, float(1.0 / (1.0 + math.exp(-g[tok]))))
                ops.add(x_t, s_t, x_t, E)
    with ops.batch():
        if moe.dense_beside:
            moe_beside.finish(m, i, n)
        else:
            ops.rms_norm(a["x"], blocks.next_norm(m, i), a["h"], s.eps, n, E)


def _expert_scales(m, i: int) -> np.ndarray:
    """Layer i's per-expert output scales (gemma4's ffn_down_exps.scale, [n_expert], float64),
    read from the device once per model and layer, for the weights of the host's routing."""
    cache = m.__dict__.setdefault("_host_expert_scales", {})
    if i not in cache:
        cache[i] = m.t.vector(f"blk.{i}.ffn_down_exps.scale").read(np.float32).astype(np.float64)
    return cache[i]


def _expert_bias(m, name: str, e: int, y, width: int) -> None:
    """y += expert e's row of a stacked bias (gpt-oss), on the device; nothing without biases."""
    if m.spec.moe.biases:
        m.ops.add(y, view(m.t.vector(name), 4 * e * width, 4 * width), y, width)


def _expert_biases(m, i: int, n_host: int) -> list[np.ndarray] | None:
    """The stacked biases [n_expert, rows] of layer i's first n_host expert kinds, for
    the host's share (read from the device once per model and layer: they are small)."""
    if not m.spec.moe.biases:
        return None
    cache = m.__dict__.setdefault("_host_expert_biases", {})
    if (i, n_host) not in cache:
        cache[(i, n_host)] = [m.t.vector(f"blk.{i}.{kind}.bias").read(np.float32).reshape(m.spec.moe.n_expert, -1)
                              for kind in EXPERT_KINDS[:n_host]]
    return cache[(i, n_host)]


def _activate_host(moe, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """activate()'s numpy twin for the host's experts."""
    if moe.activation == "swiglu_oai":
        g = np.minimum(g, moe.swiglu_limit)
        u = np.clip(u, -moe.swiglu_limit, moe.swiglu_limit)
        return g * (0.5 * (1.0 + np.tanh(0.5 * moe.swiglu_alpha * g))) * (u + 1.0)
    if moe.activation == "gelu":   # ggml's tanh approximation, as gelu_mul.comp
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
    return g * (0.5 * (1.0 + np.tanh(0.5 * g))) * u   # silu(gate) * up


def _dense_per_token(m, gate: str, up: str, down: str, x, out, n: int, n_ff: int) -> None:
    """A dense SiLU-gated FFN for n tokens (the shared expert), through g1/u1 one token at a time."""
    ops, a, t, E = m.ops, m.act, m.t, m.spec.n_embd
    for tok in range(n):
        x_t, o_t = view(x, 4 * tok * E, 4 * E), view(out, 4 * tok * E, 4 * E)
        ops.matvec(t.matrix(gate + ".weight"), x_t, a["g1"], 1)
        ops.matvec(t.matrix(up + ".weight"), x_t, a["u1"], 1)
        ops.silu_mul(a["g1"], a["u1"], a["g1"], n_ff)
        ops.matvec(t.matrix(down + ".weight"), a["g1"], o_t, 1)


def _host_experts(m, names: list[str], ids: np.ndarray, weights: np.ndarray, h: np.ndarray,
                  biases: list[np.ndarray] | None = None) -> np.ndarray:
    """The routed experts' host-placed tensors (names: gate; gate and up;
    or all three) for the slots of ids [n, k], from h [n, E].  Without
    down: [n*k, F] per slot, the gate's output or silu(gate) * up, for the
    device to finish.  With down: the weighted sum of the experts [n, E].

    The slots are sorted by expert, so an expert several tokens chose is
    one job over all their rows (its weights read once), and a token's
    experts are one call of the pool: gate and up together, then down.
    biases (gpt-oss): the stacked biases of the kinds in names, added to
    each slot's output here (the device adds those of its own share)."""
    s = m.spec
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    x = np.ascontiguousarray(h[order // k], dtype=np.float32)   # each slot's token's h, in that order
    g = np.empty((n * k, s.moe.n_ff_exp), dtype=np.float32)
    by_expert = flat[order]
    if len(names) == 1:
        _host_matmul(m, [(names[0], x, g)], experts, starts, counts)
        if biases:
            g += biases[0][by_expert]
        act = g
    else:
        u = np.empty_like(g)
        _host_matmul(m, [(names[0], x, g), (names[1], x, u)], experts, starts, counts)
        if biases:
            g += biases[0][by_expert]
            u += biases[1][by_expert]
        act = _activate_host(s.moe, g, u).astype(np.float32)
    if len(names) < 3:
        part = np.empty_like(act)
        part[order] = act
        return part
    d = np.empty((n * k, s.n_embd), dtype=np.float32)
    _host_matmul(m, [(names[2], act, d)], experts, starts, counts)
    if biases:
        d += biases[2][by_expert]
    by_slot = np.empty_like(d)
    by_slot[order] = d
    return (by_slot.reshape(n, k, s.n_embd) * weights[:, :, None]).sum(axis=1).astype(np.float32)


def _host_matmul(m, items, experts: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
    """out[s] = W_e x[s] for each (name, x, out) in items (host-placed
    stacked tensors; x and out float32 arrays, one row per slot), the slots
    grouped by expert: rows starts[i] .. starts[i] + counts[i] - 1 go with
    expert experts[i].  Every item the native host matvec reads is one job
    per expert, all of them in one call (vramd/engine/hostmv.py); other
    types (K-quants) are dequantized an expert at a time."""
    info, host = m.t.info, m.t.host
    native = []
    for name, x, out in items:
        source, off, stride, rows, cols = m.t.stack_layout(name)
        if hostmv.supports(int(info[source].type), cols):
            native.append((name, x, out))
            continue
        for e, s, c in zip(experts.tolist(), starts.tolist(), counts.tolist()):
            out[s:s + c] = _host_dequantized(m, name, e, x[s:s + c])
    count = len(experts)
    jobs = np.empty(len(native) * count, hostmv.JOB)
    for i, (name, x, out) in enumerate(native):
        source, off, stride, rows, cols = m.t.stack_layout(name)
        t = info[source]
        job = jobs[i * count:(i + 1) * count]
        job["w"] = hostmv.address(host[source]) + off + experts * stride
        job["x"] = hostmv.address(x) + starts * (4 * cols)
        job["y"] = hostmv.address(out) + starts * (4 * rows)
        job["type"], job["rows"], job["cols"], job["n"] = int(t.type), rows, cols, counts
    hostmv.run(jobs)


def _host_dequantized(m, name: str, e: int, x: np.ndarray) -> np.ndarray:
    """x W_e^T for rows x of expert e of a host-placed stacked tensor the
    native host matvec does not read: the expert dequantized by gguf.quants
    (nothing is cached, so host memory stays at the file's size)."""
    import gguf

    source, off, stride, rows, cols = m.t.stack_layout(name)
    t = m.t.info[source]
    rb = row_bytes(t.type, cols)
    raw = m.t.host[source][off + e * stride:off + e * stride + rows * rb]
    w = gguf.quants.dequantize(raw.reshape(rows, rb), t.type).reshape(rows, cols).astype(np.float32, copy=False)
    return x @ w.T

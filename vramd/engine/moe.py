"""Mixture-of-experts forward pass: qwen3moe, qwen2moe and mixtral (llama with experts).

Owns: `MoEConfig` (the hyper-parameters and gating rule per architecture),
`moe_scratch_layout`, and `MoEModel.forward`.  Attention is the llama/qwen2
one (plus QK-norm for qwen3moe).  The feed-forward is routed: softmax of the
router's logits, the top-k experts, their weights renormalised per
architecture (`route()`, tests/engine/reference_moe.py), and only the chosen
experts computed.  Two ways, chosen per layer (`MoEModel.gpu_routed`):

GPU-routed (every expert tensor of the layer on the device, the common case
with `--n-cpu-moe 0`): moe_route picks the experts on the GPU into a small
ids/weights buffer, matvec_id runs all k experts' gate, up and down in one
dispatch each (the expert ids read on the GPU, offsets into the stacked
tensors), moe_combine adds the weighted outputs (and qwen2moe's gated shared
expert) to the residual stream.  No readback, so when every layer is
GPU-routed the one-token decode step is recorded once into an `ops.graph()`
and replayed per token, as llama.py's (token id and position in, logits out
through a mapped host buffer; re-recorded when the residency generation
changes); prefill chunks record the same ops for n tokens into one batch.

Host-routed (a layer with an expert tensor `--n-cpu-moe` placed on the host,
or one the GPU path cannot bind): the router's logits are read back after the
layer's attention, the experts chosen on the CPU, and computed on the GPU
from views into the stacked tensors and on the CPU for the host-placed
tensors (the native host matvec, vramd/engine/hostmv.py: all the selected
experts of a chunk in one call of a thread pool, gate and up, then down);
the two meet in the residual stream on the GPU.
Such a layer costs a device round trip, and decode goes through the chunk
path (runs of GPU-routed layers between host-routed ones still need none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vramd.engine import hostmv
from vramd.engine.llama import metadata_getter, rope_scale_factor, vocab_size
from vramd.engine.ops import ROUTE_MAX_EXPERTS, ROUTE_MAX_USED, Ops, Weight, row_bytes, view
from vramd.errors import ModelError
from vramd.engine.decode_step import DecodeStep

MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama")
MAX_BATCH = 64


@dataclass(frozen=True)
class MoEConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    eps: float
    n_rot: int
    rope_base: float
    rope_scale: float
    neox: bool
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int
    renormalize: bool      # the chosen experts' weights are scaled to sum 1
    tied_output: bool

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    @staticmethod
    def is_moe(mf) -> bool:
        n = mf.metadata.get(f"{mf.architecture}.expert_count", 0)
        return isinstance(n, int) and not isinstance(n, bool) and n > 0

    @classmethod
    def from_model(cls, mf) -> "MoEConfig":
        arch, md = mf.architecture, mf.metadata
        if arch not in MOE_ARCHITECTURES or not cls.is_moe(mf):
            raise ModelError(f"{mf.path}: not a supported mixture-of-experts model ({arch})")

        get = metadata_getter(mf)     # integers in 1..MAX_HPARAM (no float sizes), finite floats

        n_embd, n_head = get("embedding_length"), get("attention.head_count")
        head = get("attention.key_length", n_embd // n_head)
        if get("attention.value_length", head) != head:
            raise ModelError(f"{mf.path}: key and value lengths differ")
        n_expert, n_used = get("expert_count"), get("expert_used_count")
        if n_used > n_expert:
            raise ModelError(f"{mf.path}: {n_used} experts used of {n_expert}")
        factor = rope_scale_factor(mf, keys=("rope.scaling.factor",))
        names = {t.name for t in mf.tensors}
        shexp = "expert_shared_feed_forward_length"
        return cls(arch=arch, n_layer=get("block_count"), n_embd=n_embd, n_head=n_head,
                   n_head_kv=get("attention.head_count_kv", n_head), head_dim=head, n_vocab=vocab_size(mf),
                   eps=float(get("attention.layer_norm_rms_epsilon", kind=float)),
                   n_rot=get("rope.dimension_count", head),
                   rope_base=float(get("rope.freq_base", 10000.0, kind=float)),
                   rope_scale=1.0 / factor if factor else 1.0, neox=arch != "llama",
                   n_expert=n_expert, n_used=n_used,
                   n_ff_exp=get("expert_feed_forward_length", md.get(f"{arch}.feed_forward_length")),
                   n_ff_shexp=get(shexp) if md.get(f"{arch}.{shexp}") else 0,
                   renormalize=arch != "qwen2moe", tied_output="output.weight" not in names)


def moe_scratch_layout(cfg: MoEConfig, batch: int = MAX_BATCH) -> list[tuple[str, int]]:
    b, e = batch, cfg.n_embd
    f = max(cfg.n_ff_exp, cfg.n_ff_shexp or 0)
    slots = b * cfg.n_used    # (token, chosen expert) pairs of a chunk
    return [("x", 4 * b * e), ("h", 4 * b * e), ("q", 4 * b * cfg.q_width), ("k", 4 * b * cfg.kv_width),
            ("v", 4 * b * cfg.kv_width), ("att", 4 * b * cfg.q_width), ("router", 4 * b * cfg.n_expert),
            ("g1", 4 * f), ("u1", 4 * f), ("tmp", 4 * e), ("cpu", 4 * b * e), ("shexp", 4 * b * e),
            ("part", 4 * slots * cfg.n_ff_exp),
            ("shgate", 4 * b), ("logits", 4 * b * cfg.n_vocab), ("ids", 4 * b), ("pos", 4 * b),
            # GPU-routed layers: the routing (expert ids, weights), each slot's gate, up and down
            # outputs, the shared expert's gate and up (qwen2moe)
            ("route_ids", 4 * slots), ("route_w", 4 * slots), ("eg", 4 * slots * cfg.n_ff_exp),
            ("eu", 4 * slots * cfg.n_ff_exp), ("ed", 4 * slots * e), ("sg", 4 * b * max(cfg.n_ff_shexp, 1)),
            ("su", 4 * b * max(cfg.n_ff_shexp, 1))]


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


EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")   # the order they leave the device


class MoEModel:
    """Forward passes of one loaded MoE model.  gpu_routing=False routes every
    layer on the host (the reference the GPU-routed path is tested against)."""

    def __init__(self, loaded, residency, ctx: int, scratch_region, batch: int = MAX_BATCH, *,
                 gpu_routing: bool = True):
        self.file = mf = loaded.file
        self.cfg = MoEConfig.from_model(mf)
        self.ctx, self.batch = ctx, batch
        self.ops = Ops(residency)
        self.residency = residency
        self.weights = loaded.weights.tensors
        self.host = loaded.host
        self.kv = loaded.kv.tensors
        self.act = scratch_region.tensors
        self._info = {t.name: t for t in mf.tensors}
        for name in ("token_embd.weight", "output_norm.weight"):
            if name not in self._info:
                raise ModelError(f"{mf.path}: missing tensor {name!r}")
        self._check_expert_shapes()
        # Per layer: routed on the GPU (no readback) or on the host.
        self.gpu_routed = [gpu_routing and self._gpu_routable(i) for i in range(self.cfg.n_layer)]
        self._decode_step = DecodeStep(self.ops, residency, self.act, self.cfg.n_vocab)  # replayed per token

    @property
    def replays_decode(self) -> bool:
        """Decode is one recorded step replayed per token: every layer routes on the GPU."""
        return all(self.gpu_routed)

    # -- weights ---------------------------------------------------------------

    def _weight(self, name: str) -> Weight:
        t = self._info.get(name)
        if t is None:
            raise ModelError(f"{self.file.path}: missing tensor {name!r}")
        return Weight(self.weights[name], t.type, int(np.prod(t.shape[1:])), t.shape[0])

    def _check_expert_shapes(self) -> None:
        """The stacked expert tensors are [n_expert, rows, cols] as the metadata
        says (both paths index them by expert and row)."""
        cfg = self.cfg
        want = {"ffn_gate_exps": (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert),
                "ffn_up_exps": (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert),
                "ffn_down_exps": (cfg.n_ff_exp, cfg.n_embd, cfg.n_expert)}
        for i in range(cfg.n_layer):
            for kind, shape in want.items():
                name = f"blk.{i}.{kind}.weight"
                t = self._info.get(name)
                if t is None:
                    raise ModelError(f"{self.file.path}: missing tensor {name!r}")
                if tuple(t.shape) != shape:
                    raise ModelError(f"{self.file.path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                     f"expected {shape}")

    def _stack(self, name: str) -> Weight:
        """A stacked expert tensor on the device, as expert 0's matrix (matvec_id's form)."""
        t = self._info[name]
        return Weight(self.weights[name], t.type, t.shape[1], t.shape[0])

    def _gpu_routable(self, i: int) -> bool:
        """Whether layer i can route on the GPU: its expert tensors are all on
        the device, the routing kernel takes n_expert and k, and one expert's
        matrix fits a storage binding (matvec_id binds a stack in runs of
        whole experts).  Otherwise the layer is host-routed."""
        cfg = self.cfg
        if cfg.n_expert > ROUTE_MAX_EXPERTS or cfg.n_used > ROUTE_MAX_USED:
            return False
        names = [f"blk.{i}.{kind}.weight" for kind in EXPERT_KINDS]
        return all(name not in self.host and self.ops.fits_matvec_id(self._stack(name)) for name in names)

    def _expert(self, name: str, e: int) -> Weight | None:
        """Expert e's slab of a stacked tensor, on the device; None if the tensor is on the host."""
        if name in self.host:
            return None
        t = self._info[name]
        rows, cols = t.shape[1], t.shape[0]
        slab = rows * row_bytes(t.type, cols)
        return Weight(view(self.weights[name], e * slab, slab), t.type, rows, cols)

    def _host_matmul(self, items, experts: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> None:
        """out[s] = W_e x[s] for each (name, x, out) in items (host-placed
        stacked tensors; x and out float32 arrays, one row per slot), the
        slots grouped by expert: rows starts[i] .. starts[i] + counts[i] - 1
        go with expert experts[i].  Every item the native host matvec reads
        is one job per expert, all of them in one call (vramd/engine/hostmv.py);
        other types (K-quants) are dequantized an expert at a time."""
        native = []
        for name, x, out in items:
            t = self._info[name]
            if hostmv.supports(int(t.type), t.shape[0]):
                native.append((name, x, out))
                continue
            for e, s, c in zip(experts.tolist(), starts.tolist(), counts.tolist()):
                out[s:s + c] = self._host_dequantized(name, e, x[s:s + c])
        m = len(experts)
        jobs = np.empty(len(native) * m, hostmv.JOB)
        for i, (name, x, out) in enumerate(native):
            t = self._info[name]
            rows, cols = t.shape[1], t.shape[0]
            job = jobs[i * m:(i + 1) * m]
            job["w"] = hostmv.address(self.host[name]) + experts * (rows * row_bytes(t.type, cols))
            job["x"] = hostmv.address(x) + starts * (4 * cols)
            job["y"] = hostmv.address(out) + starts * (4 * rows)
            job["type"], job["rows"], job["cols"], job["n"] = int(t.type), rows, cols, counts
        hostmv.run(jobs)

    def _host_dequantized(self, name: str, e: int, x: np.ndarray) -> np.ndarray:
        """x W_e^T for rows x of expert e of a host-placed stacked tensor the
        native host matvec does not read: the expert dequantized by
        gguf.quants (nothing is cached, so host memory stays at the file's size)."""
        import gguf

        t = self._info[name]
        rows, cols = t.shape[1], t.shape[0]
        rb = row_bytes(t.type, cols)
        raw = self.host[name][e * rows * rb:(e + 1) * rows * rb]
        w = gguf.quants.dequantize(raw.reshape(rows, rb), t.type).reshape(rows, cols).astype(np.float32, copy=False)
        return x @ w.T

    def _host_experts(self, names: list[str], ids: np.ndarray, weights: np.ndarray,
                      h: np.ndarray) -> np.ndarray:
        """The routed experts' host-placed tensors (names: gate; gate and up;
        or all three) for the slots of ids [n, k], from h [n, E].  Without
        down: [n*k, F] per slot, the gate's output or silu(gate) * up, for the
        device to finish.  With down: the weighted sum of the experts [n, E].

        The slots are sorted by expert, so an expert several tokens chose is
        one job over all their rows (its weights read once), and a token's
        experts are one call of the pool: gate and up together, then down."""
        cfg = self.cfg
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
        x = np.ascontiguousarray(h[order // k], dtype=np.float32)   # each slot's token's h, in that order
        g = np.empty((n * k, cfg.n_ff_exp), dtype=np.float32)
        if len(names) == 1:
            self._host_matmul([(names[0], x, g)], experts, starts, counts)
            act = g
        else:
            u = np.empty_like(g)
            self._host_matmul([(names[0], x, g), (names[1], x, u)], experts, starts, counts)
            act = g * (0.5 * (1.0 + np.tanh(0.5 * g))) * u   # silu(gate) * up
        if len(names) < 3:
            part = np.empty_like(act)
            part[order] = act
            return part
        d = np.empty((n * k, cfg.n_embd), dtype=np.float32)
        self._host_matmul([(names[2], act, d)], experts, starts, counts)
        by_slot = np.empty_like(d)
        by_slot[order] = d
        return (by_slot.reshape(n, k, cfg.n_embd) * weights[:, :, None]).sum(axis=1).astype(np.float32)

    def _bias(self, name: str):
        return self.weights.get(name) if name in self._info else None

    # -- forward ---------------------------------------------------------------------

    def forward(self, tokens: list[int], pos0: int, all_logits: bool = False) -> np.ndarray:
        if not tokens:
            raise ValueError("no tokens")
        if pos0 < 0 or pos0 + len(tokens) > self.ctx:
            raise ModelError(f"positions {pos0}..{pos0 + len(tokens) - 1} outside the context of {self.ctx}")
        if len(tokens) == 1 and not all_logits and self.replays_decode:
            return self._decode(int(tokens[0]), pos0)
        out = []
        for start in range(0, len(tokens), self.batch):
            chunk = tokens[start:start + self.batch]
            out.append(self._chunk(chunk, pos0 + start, all_logits))
        return np.concatenate(out, axis=0) if all_logits else out[-1]

    def _decode(self, token: int, pos: int) -> np.ndarray:
        """One token at `pos` through the recorded step: the logits ([n_vocab])."""
        return self._decode_step.run(token, pos, lambda: self._record_decode())

    def _record_decode(self) -> None:
        """The decode step's body: every layer routed on the GPU, no readback."""
        self._embed(1)
        for i in range(self.cfg.n_layer):
            self._attention(i, 1)
            self._gpu_experts(i, 1)
        self._output(1, all_logits=False)

    @property
    def step_records(self) -> int:
        return self._decode_step.records

    def profile(self, timer) -> None:
        """Times every dispatch of the decode step with `timer` (a
        vramd.gpu.timing.Timestamps; None: stop); read `timer.read()` after
        a forward of one token.  Re-records the step."""
        self._decode_step.profile(timer)

    def _chunk(self, tokens: list[int], pos0: int, all_logits: bool) -> np.ndarray:
        cfg, ops, a = self.cfg, self.ops, self.act
        n = len(tokens)
        ops.sync()
        a["ids"].write(np.asarray(tokens, dtype=np.int32))
        a["pos"].write(np.arange(pos0, pos0 + n, dtype=np.int32))
        with ops.batch():
            self._embed(n)
        for gpu, layers in self._layer_runs():
            if gpu:   # no readback: the whole run in one command buffer
                with ops.batch():
                    for i in layers:
                        self._attention(i, n)
                        self._gpu_experts(i, n)
            else:
                self._host_routed_layer(layers[0], n)
        with ops.batch():
            self._output(n, all_logits)
        ops.sync()
        rows = n if all_logits else 1
        logits = a["logits"].read(np.float32, 0, 4 * rows * cfg.n_vocab).reshape(rows, cfg.n_vocab).copy()
        return logits if all_logits else logits[0]

    def _layer_runs(self) -> list[tuple[bool, list[int]]]:
        """The layers in order, as (True, a run of consecutive GPU-routed
        layers) and (False, [one host-routed layer])."""
        runs: list[tuple[bool, list[int]]] = []
        for i, gpu in enumerate(self.gpu_routed):
            if gpu and runs and runs[-1][0]:
                runs[-1][1].append(i)
            else:
                runs.append((gpu, [i]))
        return runs

    def _embed(self, n: int) -> None:
        self.ops.get_rows(self._weight("token_embd.weight"), self.act["ids"], self.act["x"], n)

    def _output(self, n: int, all_logits: bool) -> None:
        """The logits of every token, or of the last at row 0, from x."""
        cfg, ops, a = self.cfg, self.ops, self.act
        E = cfg.n_embd
        out_w = self._weight("token_embd.weight" if cfg.tied_output else "output.weight")
        ops.rms_norm(a["x"], self.weights["output_norm.weight"], a["h"], cfg.eps, n, E)
        if all_logits:
            ops.matvec(out_w, a["h"], a["logits"], n)
        else:
            ops.matvec(out_w, view(a["h"], 4 * (n - 1) * E, 4 * E), a["logits"], 1)

    def _linear(self, name: str, x, y, n: int, width: int) -> None:
        self._linears([(name, x, y, width)], n)

    def _linears(self, items, n: int) -> None:
        """y = W x (+ bias) for independent (name, x, y, width) items: the
        matvecs side by side (one barrier after them all), then the bias adds."""
        ops = self.ops
        with ops.parallel():
            for name, x, y, _width in items:
                ops.matvec(self._weight(name + ".weight"), x, y, n)
        biases = [(y, b, width) for name, _x, y, width in items if (b := self._bias(name + ".bias")) is not None]
        if biases:
            with ops.parallel():
                for y, b, width in biases:
                    ops.add(y, b, y, n * width, width)

    def _attention(self, i: int, n: int) -> None:
        """Layer i's attention: from x (the residual), x += attention, then h = ffn_norm(x)."""
        cfg, ops, a = self.cfg, self.ops, self.act
        p, E, hd = f"blk.{i}.", cfg.n_embd, cfg.head_dim
        ops.rms_norm(a["x"], self.weights[p + "attn_norm.weight"], a["h"], cfg.eps, n, E)
        self._linears([(p + "attn_q", a["h"], a["q"], cfg.q_width), (p + "attn_k", a["h"], a["k"], cfg.kv_width),
                       (p + "attn_v", a["h"], a["v"], cfg.kv_width)], n)
        if p + "attn_q_norm.weight" in self._info:   # qwen3moe: RMSNorm over each head
            with ops.parallel():
                ops.rms_norm(a["q"], self.weights[p + "attn_q_norm.weight"], a["q"], cfg.eps, n * cfg.n_head, hd)
                ops.rms_norm(a["k"], self.weights[p + "attn_k_norm.weight"], a["k"], cfg.eps, n * cfg.n_head_kv, hd)
        rope = dict(n_rot=cfg.n_rot, neox=cfg.neox, freq_base=cfg.rope_base, freq_scale=cfg.rope_scale)
        with ops.parallel():   # q rotates in place, k rotated into the cache, v to the cache as it is
            ops.rope(a["q"], a["pos"], n, cfg.n_head, hd, **rope)
            ops.rope_kv_write(a["k"], self.kv[f"cache_k_l{i}"], a["pos"], n, cfg.n_head_kv, hd, self.ctx, **rope)
            ops.kv_write(a["v"], self.kv[f"cache_v_l{i}"], a["pos"], n, cfg.kv_width, self.ctx)
        ops.attention(a["q"], self.kv[f"cache_k_l{i}"], self.kv[f"cache_v_l{i}"], a["pos"], a["att"], n,
                      cfg.n_head, cfg.n_head_kv, hd, self.ctx, 1.0 / math.sqrt(hd),
                      tmp=a["part"])  # free until the experts: decode attention's per-range partials
        self._linear(p + "attn_output", a["att"], a["h"], n, E)
        ops.add_rms_norm(a["x"], a["h"], self.weights[p + "ffn_norm.weight"], a["h"], cfg.eps, n, E)

    def _gpu_experts(self, i: int, n: int) -> None:
        """Layer i's routed FFN, routed on the GPU: from h = ffn_norm(x),
        x += sum_j w_j expert_j(h) (+ sigmoid(g . h) shared(h), qwen2moe).
        A dispatch each for the routing, all slots' gate, up and down, and
        the weighted sum; nothing read back."""
        cfg, ops, a = self.cfg, self.ops, self.act
        p, E, k, F = f"blk.{i}.", cfg.n_embd, cfg.n_used, cfg.n_ff_exp
        slots = n * k
        shared = p + "ffn_gate_shexp.weight" in self._info
        with ops.parallel():   # everything that reads only h
            ops.matvec(self._weight(p + "ffn_gate_inp.weight"), a["h"], a["router"], n)
            if shared:
                ops.matvec(self._weight(p + "ffn_gate_inp_shexp.weight"), a["h"], a["shgate"], n)
                ops.matvec(self._weight(p + "ffn_gate_shexp.weight"), a["h"], a["sg"], n)
                ops.matvec(self._weight(p + "ffn_up_shexp.weight"), a["h"], a["su"], n)
        with ops.parallel():
            ops.moe_route(a["router"], a["route_ids"], a["route_w"], n, cfg.n_expert, k, cfg.renormalize)
            if shared:
                ops.silu_mul(a["sg"], a["su"], a["sg"], n * cfg.n_ff_shexp)
        gate, up, down = (self._stack(p + kind + ".weight") for kind in EXPERT_KINDS)
        with ops.parallel():   # a token's k slots all read its h row (x_div = k)
            ops.matvec_id(gate, cfg.n_expert, a["route_ids"], a["h"], a["eg"], slots, x_div=k)
            ops.matvec_id(up, cfg.n_expert, a["route_ids"], a["h"], a["eu"], slots, x_div=k)
            if shared:
                ops.matvec(self._weight(p + "ffn_down_shexp.weight"), a["sg"], a["shexp"], n)
        ops.silu_mul(a["eg"], a["eu"], a["eg"], slots * F)
        ops.matvec_id(down, cfg.n_expert, a["route_ids"], a["eg"], a["ed"], slots)
        ops.moe_combine(a["x"], a["ed"], a["route_w"], n, k, E, shared=a["shexp"] if shared else None,
                        shared_gate=a["shgate"] if shared else None)

    def _host_routed_layer(self, i: int, n: int) -> None:
        """Layer i with the routing read back and chosen on the CPU (its own
        batches and syncs): experts on the host computed by numpy, those on
        the device by one matvec per expert."""
        cfg, ops, a = self.cfg, self.ops, self.act
        p, E, F = f"blk.{i}.", cfg.n_embd, cfg.n_ff_exp
        shared = p + "ffn_gate_shexp.weight" in self._info
        with ops.batch():
            self._attention(i, n)
            ops.matvec(self._weight(p + "ffn_gate_inp.weight"), a["h"], a["router"], n)
            if shared:   # qwen2moe's shared expert, and its scalar gate
                ops.matvec(self._weight(p + "ffn_gate_inp_shexp.weight"), a["h"], a["shgate"], n)
                self._ffn(p + "ffn_gate_shexp", p + "ffn_up_shexp", p + "ffn_down_shexp", a["h"], a["shexp"], n,
                          cfg.n_ff_shexp)
        ops.sync()
        router = a["router"].read(np.float32, 0, 4 * n * cfg.n_expert).reshape(n, cfg.n_expert)
        ids, weights = route(router.astype(np.float64), cfg.n_used, cfg.renormalize)
        names = [p + kind + ".weight" for kind in EXPERT_KINDS]
        # How many of this layer's expert tensors are on the host: 0..3, a prefix of gate, up, down.
        n_host = sum(name in self.host for name in names)
        if n_host:
            # The host's share: the gate (1), gate and up (2), or the whole
            # expert (3); the device takes up from `part`, or adds `cpu`.
            h = a["h"].read(np.float32, 0, 4 * n * E).reshape(n, E)
            a["part" if n_host < 3 else "cpu"].write(self._host_experts(names[:n_host], ids, weights, h))
        with ops.batch():
            if n_host == 3:
                ops.add(a["x"], a["cpu"], a["x"], n * E)
            else:
                for t in range(n):
                    h_t = view(a["h"], 4 * t * E, 4 * E)
                    x_t = view(a["x"], 4 * t * E, 4 * E)
                    for j, e in enumerate(ids[t]):
                        e = int(e)
                        slot = view(a["part"], 4 * (t * cfg.n_used + j) * F, 4 * F)
                        if n_host == 0:
                            ops.matvec(self._expert(names[0], e), h_t, a["g1"], 1)
                            ops.matvec(self._expert(names[1], e), h_t, a["u1"], 1)
                            ops.silu_mul(a["g1"], a["u1"], a["g1"], F)
                            ops.matvec(self._expert(names[2], e), a["g1"], a["tmp"], 1)
                        elif n_host == 1:
                            ops.matvec(self._expert(names[1], e), h_t, a["u1"], 1)
                            ops.silu_mul(slot, a["u1"], a["g1"], F)
                            ops.matvec(self._expert(names[2], e), a["g1"], a["tmp"], 1)
                        else:
                            ops.matvec(self._expert(names[2], e), slot, a["tmp"], 1)
                        ops.scale(a["tmp"], a["tmp"], E, float(weights[t, j]))
                        ops.add(x_t, a["tmp"], x_t, E)
        if shared:
            ops.sync()
            g = a["shgate"].read(np.float32, 0, 4 * n).astype(np.float64)
            with ops.batch():
                for t in range(n):
                    s_t = view(a["shexp"], 4 * t * E, 4 * E)
                    x_t = view(a["x"], 4 * t * E, 4 * E)
                    ops.scale(s_t, s_t, E, float(1.0 / (1.0 + math.exp(-g[t]))))
                    ops.add(x_t, s_t, x_t, E)

    def _ffn(self, gate: str, up: str, down: str, x, out, n: int, n_ff: int) -> None:
        """A dense SiLU-gated FFN for n tokens (the shared expert), through g1/u1 one token at a time."""
        ops, a, E = self.ops, self.act, self.cfg.n_embd
        for t in range(n):
            x_t, o_t = view(x, 4 * t * E, 4 * E), view(out, 4 * t * E, 4 * E)
            ops.matvec(self._weight(gate + ".weight"), x_t, a["g1"], 1)
            ops.matvec(self._weight(up + ".weight"), x_t, a["u1"], 1)
            ops.silu_mul(a["g1"], a["u1"], a["g1"], n_ff)
            ops.matvec(self._weight(down + ".weight"), a["g1"], o_t, 1)

    def close(self) -> None:
        self.ops.close()
        self._decode_step.close()

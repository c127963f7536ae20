"""The tensor table of a model, derived from its spec: what must be in the file, with which shape and type.

Owns: `TensorTable` — checks at load that every tensor the forward pass
reads exists with the shape the metadata implies (norms F32, matrices in a
type the kernels run, optional biases and RoPE frequency factors F32 of the
right length), then hands out `Weight`s (matrices), vectors and expert stacks
by name.  A missing or misshapen tensor is one ModelError naming the file,
the tensor and the architecture, before anything runs.  A fused tensor
(phi3's attn_qkv, its ffn_up of gate and up rows) is checked as one and
handed out as row views under the unfused names (attn_q, ffn_gate, ...):
offsets into the one weight, no copy, so the layer math does not know.  Shapes are GGUF's
(ne[0] first): a matrix that maps n_in to n_out is (n_in, n_out).
"""

from __future__ import annotations

import numpy as np

from vramd.engine.ops import Weight, row_bytes, view
from vramd.errors import ModelError



def required(spec) -> tuple[dict, dict]:
    """({matrix name: shape}, {vector name: length}) the forward pass of `spec` reads."""
    E, V = spec.n_embd, spec.n_vocab
    mats = {"token_embd.weight": (E, V)}
    vecs = {"output_norm.weight": E}
    if spec.ple:   # per-layer embeddings (vramd/engine/ple.py)
        P = spec.ple * spec.n_layer
        mats.update({"per_layer_token_embd.weight": (P, V), "per_layer_model_proj.weight": (E, P)})
        vecs["per_layer_proj_norm.weight"] = spec.ple
    if not spec.tied_output:
        mats["output.weight"] = (E, V)
    for i, layer in enumerate(spec.layers):
        p, Q, KV, hd = f"blk.{i}.", spec.q_width_of(i), spec.kv_width_of(i), spec.head_dim_of(i)
        vecs.update({p + "attn_norm.weight": E, p + spec.ffn_norm + ".weight": E})
        if spec.attn_sinks:
            vecs[p + "attn_sinks.weight"] = spec.n_head
        if layer.recurrent:   # Gated DeltaNet (vramd/engine/deltanet.py)
            d = spec.deltanet
            mats.update({p + "attn_qkv.weight": (E, d.conv_dim), p + "attn_gate.weight": (E, d.value_dim),
                         p + "ssm_alpha.weight": (E, d.hv), p + "ssm_beta.weight": (E, d.hv),
                         p + "ssm_out.weight": (d.value_dim, E), p + "ssm_conv1d.weight": (d.d_conv, d.conv_dim)})
            vecs.update({p + "ssm_dt.bias": d.hv,
                         p + "ssm_a": d.hv, p + "ssm_norm.weight": d.s})
        elif spec.fused_qkv:
            mats[p + "attn_qkv.weight"] = (E, Q + 2 * KV)
        else:
            mats[p + "attn_q.weight"] = (E, 2 * Q if spec.attn_gate else Q)
            if layer.kv_source < 0:   # a KV-sharing layer (gemma4 E2B/E4B) projects its queries only
                mats[p + "attn_k.weight"] = (E, KV)
                if not layer.v_from_k:
                    mats[p + "attn_v.weight"] = (E, KV)
        if not layer.recurrent:
            mats[p + "attn_output.weight"] = (Q, E)
        if spec.qk_norm and not layer.recurrent:
            vecs[p + "attn_q_norm.weight"] = hd
            if layer.kv_source < 0:
                vecs[p + "attn_k_norm.weight"] = hd
        if spec.post_norms:
            vecs.update({p + "post_attention_norm.weight": E, p + "post_ffw_norm.weight": E})
        if spec.ple:   # vramd/engine/ple.py
            mats.update({p + "inp_gate.weight": (E, spec.ple), p + "proj.weight": (spec.ple, E)})
            vecs[p + "post_norm.weight"] = E
        if not layer.moe:
            F = spec.n_ff_of(i)
            if spec.fused_up:
                mats.update({p + "ffn_up.weight": (E, 2 * F), p + "ffn_down.weight": (F, E)})
            else:
                mats.update({p + "ffn_gate.weight": (E, F), p + "ffn_up.weight": (E, F), p + "ffn_down.weight": (F, E)})
            continue
        m = spec.moe
        mats.update({p + "ffn_gate_inp.weight": (E, m.n_expert), p + "ffn_down_exps.weight": (m.n_ff_exp, E, m.n_expert)})
        if m.fused_gate_up:
            mats[p + "ffn_gate_up_exps.weight"] = (E, 2 * m.n_ff_exp, m.n_expert)
        else:
            mats.update({p + "ffn_gate_exps.weight": (E, m.n_ff_exp, m.n_expert),
                         p + "ffn_up_exps.weight": (E, m.n_ff_exp, m.n_expert)})
        if m.dense_beside:   # gemma4: the dense FFN beside the experts and the norms around both
            F = spec.n_ff
            mats.update({p + "ffn_gate.weight": (E, F), p + "ffn_up.weight": (E, F), p + "ffn_down.weight": (F, E)})
            vecs.update({p + n + ".weight": E for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")})
        if m.router_scale:
            vecs[p + "ffn_gate_inp.scale"] = E
        if m.expert_scale:
            vecs[p + "ffn_down_exps.scale"] = m.n_expert
        if m.biases:   # gpt-oss: the router's bias, and F32 [n_expert, rows] stacks of the experts' biases
            vecs[p + "ffn_gate_inp.bias"] = m.n_expert
            mats.update({p + "ffn_gate_exps.bias": (m.n_ff_exp, m.n_expert),
                         p + "ffn_up_exps.bias": (m.n_ff_exp, m.n_expert), p + "ffn_down_exps.bias": (E, m.n_expert)})
        if m.n_ff_shexp:
            S = m.n_ff_shexp
            mats.update({p + "ffn_gate_inp_shexp.weight": (E,), p + "ffn_gate_shexp.weight": (E, S),
                         p + "ffn_up_shexp.weight": (E, S), p + "ffn_down_shexp.weight": (S, E)})
    return mats, vecs


def optional(spec) -> dict:
    """{vector name: length} the forward pass reads where the file has them: biases, RoPE factors."""
    vecs = {"rope_freqs.weight": spec.n_rot // 2} if spec.rope_factors else {}
    if spec.longrope_ctx:
        vecs.update({"rope_factors_long.weight": spec.n_rot // 2, "rope_factors_short.weight": spec.n_rot // 2})
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        vecs.update({p + "attn_q.bias": spec.q_width_of(i), p + "attn_k.bias": spec.kv_width_of(i),
                     p + "attn_v.bias": spec.kv_width_of(i), p + "attn_output.bias": spec.n_embd})
        if spec.n_ff and not spec.layers[i].moe and not spec.fused_up:
            F = spec.n_ff_of(i)
            vecs.update({p + "ffn_gate.bias": F, p + "ffn_up.bias": F, p + "ffn_down.bias": spec.n_embd})
    return vecs


def expert_views(spec) -> dict[str, tuple[str, int]]:
    """{gate or up stack name: (fused ffn_gate_up_exps, its first row in each expert)} (gemma4)."""
    if not (spec.moe and spec.moe.fused_gate_up):
        return {}
    F, views = spec.moe.n_ff_exp, {}
    for i, layer in enumerate(spec.layers):
        if layer.moe:
            p = f"blk.{i}."
            views.update({p + "ffn_gate_exps.weight": (p + "ffn_gate_up_exps.weight", 0),
                          p + "ffn_up_exps.weight": (p + "ffn_gate_up_exps.weight", F)})
    return views


def fused_views(spec) -> dict[str, tuple[str, int, int]]:
    """{unfused name: (fused tensor, first row, rows)} for the spec's fused tensors."""
    views = {}
    F = spec.n_ff
    for i, layer in enumerate(spec.layers):
        p, Q, KV = f"blk.{i}.", spec.q_width_of(i), spec.kv_width_of(i)
        if spec.fused_qkv:
            qkv = p + "attn_qkv.weight"
            views.update({p + "attn_q.weight": (qkv, 0, Q), p + "attn_k.weight": (qkv, Q, KV),
                          p + "attn_v.weight": (qkv, Q + KV, KV)})
        if spec.fused_up and not layer.moe:
            up = p + "ffn_up.weight"
            views.update({p + "ffn_gate.weight": (up, 0, F), p + "ffn_up.weight": (up, F, F)})
    return views


class TensorTable:
    """The model's tensors by name: `weights` (the residency region's
    tensors), `host` (tensors --n-cpu-moe left in host memory)."""

    def __init__(self, spec, mf, weights: dict, host: dict | None = None):
        self.spec, self.file, self.weights, self.host = spec, mf, weights, host or {}
        self.info = {t.name: t for t in mf.tensors}
        self.views: dict = {}      # filled after the check, which checks the fused tensors whole
        self._check()
        self.views = fused_views(spec)
        self.expert_views = expert_views(spec)

    def _fail(self, problem: str) -> ModelError:
        return ModelError(f"{self.file.path}: {problem}")

    def _check(self) -> None:
        mats, vecs = required(self.spec)
        for name, shape in {**mats, **{n: (k,) for n, k in vecs.items()}}.items():
            t = self.info.get(name)
            if t is None:
                raise self._fail(f"missing tensor {name!r} for architecture {self.spec.arch}")
            got = tuple(t.shape)
            if got != shape and not (len(shape) == 1 and name in mats and got == shape + (1,)):
                raise self._fail(f"tensor {name!r} has shape {got}, expected {shape}")
        for name, n in vecs.items():
            self.vector(name, n)
        for name in mats:
            if name not in self.host:
                try:
                    self.matrix(name)      # raises for a tensor type the kernels do not run
                except ModelError as e:
                    raise self._fail(f"{name}: {e}") from None
        for name, n in optional(self.spec).items():
            self.vector(name, n)

    # -- by name -----------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.info or name in self.views

    def matrix(self, name: str) -> Weight:
        """A matrix (or embedding table) on the device: rows = ne[1] * ne[2]..., cols = ne[0];
        a part of a fused tensor as a view of its rows."""
        if name in self.views:
            source, r0, rows = self.views[name]
            t = self.info[source]
            rb = row_bytes(t.type, t.shape[0])
            return Weight(view(self.weights[source], r0 * rb, rows * rb), t.type, rows, t.shape[0])
        t = self.info[name]
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        return Weight(self.weights[name], t.type, rows, t.shape[0])

    def vector(self, name: str, n: int | None = None):
        """An F32 vector's tensor, or None when the file has no such tensor."""
        t = self.info.get(name)
        if t is None:
            return None
        if int(t.type) != 0 or (n is not None and t.n_elements != n):
            raise self._fail(f"{name} must be F32 of {n} elements")
        return self.weights[name]

    def stack_layout(self, name: str) -> tuple[str, int, int, int, int]:
        """(the file's tensor, byte offset of expert 0's matrix in it, bytes from one
        expert's matrix to the next, rows, cols) of a stack of expert matrices by its
        unfused name: ffn_gate_exps / ffn_up_exps are parts of ffn_gate_up_exps where
        the file fuses them (every expert's gate rows, then its up rows)."""
        source, r0 = self.expert_views.get(name, (name, 0))
        t = self.info[source]
        cols, rb = t.shape[0], row_bytes(t.type, t.shape[0])
        rows = t.shape[1] if source == name else t.shape[1] // 2
        return source, r0 * rb, t.shape[1] * rb, rows, cols

    def on_host(self, name: str) -> bool:
        """Whether a stack of expert matrices (by its unfused name) is in host memory (--n-cpu-moe)."""
        return self.stack_layout(name)[0] in self.host

    def stack(self, name: str) -> Weight:
        """A stacked expert tensor on the device, as expert 0's matrix (matvec_id's form)."""
        source, off, stride, rows, cols = self.stack_layout(name)
        t, tensor = self.info[source], self.weights[source]
        return Weight(view(tensor, off) if off else tensor, t.type, rows, cols, stride)

    def expert(self, name: str, e: int) -> Weight | None:
        """Expert e's slab of a stacked tensor on the device; None if the tensor is on the host."""
        if self.on_host(name):
            return None
        source, off, stride, rows, cols = self.stack_layout(name)
        t = self.info[source]
        return Weight(view(self.weights[source], off + e * stride, rows * row_bytes(t.type, cols)), t.type, rows, cols)

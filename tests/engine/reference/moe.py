"""The numpy reference forward pass of the mixture-of-experts architectures: what the engine's MoE is checked against.

Owns: `ReferenceMoE` (a qwen3moe / qwen2moe / mixtral GGUF file -> dequantized
float32 weights -> logits; the API of reference.ReferenceModel: `.forward(tokens,
kv, pos0)`, `.new_kv(dtype)`, `.greedy()`, `.greedy_logits()`, plus `.route()`,
the expert choice of one layer, and `.last_routes`), `Route`, `sigmoid()`.
Plain numpy in the style of llama.py; it takes what the families share from
common.py (`dequantize_tensor`, `rms_norm`, `rope_angles`, `rope`, `silu`,
`ReferenceKV`, `top2_margin`, the metadata reader and the attention
hyper-parameters) and ReferenceModel's attention, greedy loop and cache
handling from llama.py, by subclassing.  Nothing here is imported by
vramd, and it imports nothing of vramd's engine.

What it computes is what llama.cpp computes, from the GGUF as stored, for
  general.architecture "qwen3moe"   src/models/qwen3moe.cpp (Qwen3-30B-A3B, 235B-A22B)
  general.architecture "qwen2moe"   src/models/qwen2moe.cpp (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B)
  general.architecture "llama" with llama.expert_count > 0
                                    src/models/llama.cpp's MoE branch (Mixtral 8x7B / 8x22B)
and the routed-expert block all three call, `llm_graph_context::build_moe_ffn`
(src/llama-graph.cpp), as read in the ggml-org/llama.cpp sources of 2025-2026
(the per-model files under src/models/; older versions had the same graphs in
src/llama-model.cpp).  A "llama" file without experts is refused: that is
reference.ReferenceModel's job.  Tensors it does not know, an RoPE scaling
other than none/linear and expert keys that would change the routing (below)
are refused with a ValueError rather than computed wrongly.

Metadata keys read (`A` = general.architecture)
-----------------------------------------------
  As llama.py: A.block_count, A.embedding_length, A.attention.head_count
  (required), A.attention.head_count_kv, A.attention.key_length / value_length,
  A.attention.layer_norm_rms_epsilon (required), A.rope.dimension_count,
  A.rope.freq_base, A.rope.scaling.type / .factor, A.context_length,
  tokenizer.ggml.bos_token_id / eos_token_id.  And:
  A.expert_count                     n_expert (required, > 0)
  A.expert_used_count                n_expert_used = k (required, 1 <= k <= n_expert)
  A.expert_feed_forward_length       qwen*: n_ff_exp, checked against ffn_*_exps;
                                     absent: taken from the tensors (llama.cpp: n_ff / k)
  A.feed_forward_length              llama (Mixtral): the experts' n_ff, checked
  A.expert_shared_feed_forward_length   qwen2moe: n_ff_shexp, checked; absent: the tensors'
  A.expert_weights_scale             refused unless absent, 0 or 1 (llama.cpp would
                                     multiply the weights by it)
  A.expert_gating_func               refused unless absent or 1 (softmax)
  A.expert_weights_norm              ignored, as llama.cpp ignores it for these three:
                                     each graph passes its normalization as a constant

Layouts
-------
ggml order as in llama.py: a tensor of ggml shape (ne0, ne1, ne2) is held
as numpy (ne2, ne1, ne0).  The stacked expert tensors
  ffn_gate_exps, ffn_up_exps   ggml (n_embd, n_ff_exp, n_expert) -> numpy [n_expert, n_ff_exp, n_embd]
  ffn_down_exps                ggml (n_ff_exp, n_embd, n_expert) -> numpy [n_expert, n_embd, n_ff_exp]
so expert e is the e-th contiguous slab (W[e], a matrix like a dense ffn_gate /
ffn_down, used as y = W[e] @ x: ggml_mul_mat_id picks slab e).  Quantized
types quantize each row of each slab; the slab of expert e starts at byte
e * (bytes of one slab).
  ffn_gate_inp       (the router) ggml (n_embd, n_expert) -> [n_expert, n_embd]
  ffn_gate_inp_shexp qwen2moe, ggml (n_embd) -> [n_embd]: one row, a dot product
  ffn_gate_shexp, ffn_up_shexp [n_ff_shexp, n_embd], ffn_down_shexp [n_embd, n_ff_shexp]
  attn_q_norm, attn_k_norm     qwen3moe, [head_dim_k]: one weight for all heads
Attention tensors and biases as llama.py; qwen3moe has no biases (a bias
tensor in a qwen3moe file is refused: llama.cpp's qwen3moe does not load one),
qwen2moe has q/k/v biases (optional here), llama accepts all of llama.py's.
output.weight is optional (tied) for qwen3moe and llama, required for qwen2moe.

The computation, per token at position p
-----------------------------------------
  x = token_embd[t]
  per layer l:
    h = rms_norm(x) * attn_norm
    q, k, v = Wq h + bq, Wk h + bk, Wv h + bv           split into heads
    qwen3moe: q_j = rms_norm(q_j) * attn_q_norm, k_g = rms_norm(k_g) * attn_k_norm
              per head, over head_dim, eps = the model's rms eps, BEFORE RoPE
    q, k = rope(q, p), rope(k, p)   NeoX (pairs i, i + n_rot/2) for qwen3moe/qwen2moe,
                                    normal (pairs 2i, 2i+1) for llama; rope_freqs
                                    (llama only) as in llama.py
    attention exactly as llama.py (scale 1/sqrt(head_dim_k), causal, GQA, f16 cache option)
    x = x + Wo concat(o) + bo
    h = rms_norm(x) * ffn_norm
    x = x + moe(l, h)                                    qwen2moe: + shared(h)
  logits = Woutput (rms_norm(x) * output_norm)

  moe(l, h) (build_moe_ffn with gating softmax, no selection bias, w_scale 0):
    logits_r = W_router h                                 [n_expert]
    probs    = softmax(logits_r)                          (max-subtracted)
    ids      = the k experts of highest probability       (ggml_argsort_top_k)
    w_i      = probs[ids_i]
    qwen3moe, llama:  w_i = w_i / max(sum_j w_j, 6.103515625e-5)    (norm_w = true;
                      the clamp is llama.cpp's guard against 0, never active for a
                      softmax's top-k).  Equivalently softmax over the selected logits.
    qwen2moe:         no renormalization (norm_w = false): the w_i sum to < 1
    moe = sum_i w_i * down_exps[ids_i] (silu(gate_exps[ids_i] h) * up_exps[ids_i] h)
  shared(h) (qwen2moe only):
    g = sigmoid(ffn_gate_inp_shexp . h)                   a scalar per token; llama.cpp
                                                          computes it as silu(z)/z
    shared = g * down_shexp (silu(gate_shexp h) * up_shexp h)

Ties in the top-k: ids are listed by decreasing probability, equal
probabilities by increasing expert id (a stable argsort of -probs).
ggml_argsort_top_k does not promise an order among equal values (each backend
implements its argsort its own way; not checked), so a test must not rely
on ties: `Route.margin` is the gap between the k-th and the (k+1)-th router
logit (the amount by which the choice is decided; +inf when k == n_expert),
tests/ggufgen/moe.py's routers make a small gap rare (its docstring gives the
rates) and `well_routed_prompt()` picks prompts without one.  The order of the ids within a token's top-k
does not change the result beyond float rounding (a sum).

Precision
---------
As llama.py: exact dequantized float32 weights, float64 arithmetic by
default, K/V stored in the cache's dtype.  The routing is computed in the same
dtype from the same h; an engine whose h differs by ~1e-3 relative (f16 cache)
picks the same experts whenever every route's margin is well above ~1e-2
(router logits have a std of a few units), which a test can check through
`last_routes` or `min_route_margin(tokens)` before comparing logits, or
ensure with `well_routed_prompt(model, length)`.  For greedy decoding, check
min_route_margin(prompt + generated tokens): the routes of a prefill and of
token-by-token decoding are the same.

Not checked against llama.cpp by running it (no llama.cpp in the test
environment, and llama-cpp-python is not a dependency): the behaviour above is
read from the sources named.  Uncertainties: (1) the expert_weights_scale key
(refused here rather than guessed); (2) llama.cpp's handling of n_expert == 1
for "llama" (this module computes it as a one-expert MoE, i.e. the dense FFN
with weight 1; whether some llama.cpp version rejects n_expert == 1 at load is
not verified); (3) tie order, above.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tests.engine.reference.common import (ReferenceKV, Tensors, dequantize_tensor, metadata_key, read_attention,
                                           rms_norm, rope, rope_angles, silu, start_forward, top2_margin)
from tests.engine.reference.llama import ReferenceModel
from vramd.model.gguf_check import validate_gguf

__all__ = ["ReferenceMoE", "Route", "sigmoid", "well_routed_prompt", "MOE_ARCHS", "ReferenceKV",
           "top2_margin"]

# general.architecture -> (RoPE ordering, renormalize the top-k weights, shared expert, QK-norm)
MOE_ARCHS = {
    "qwen3moe": ("neox", True, False, True),
    "qwen2moe": ("neox", False, True, False),
    "llama": ("normal", True, False, False),
}
# ggml_clamp(weights_sum, 6.103515625e-5, INFINITY) in build_moe_ffn: the smallest normal f16.
WEIGHTS_SUM_MIN = 6.103515625e-5
GATING_SOFTMAX = 1      # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX

_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")


@dataclass
class Route:
    """The expert choice of one layer for n tokens."""

    ids: np.ndarray         # [n, k] int64, by decreasing probability (ties: lower id first)
    weights: np.ndarray     # [n, k] the weight each chosen expert's output is multiplied by
    margin: np.ndarray      # [n] router logit of the k-th choice minus that of the (k+1)-th
    logits: np.ndarray      # [n, n_expert] the router logits W_router h


@dataclass
class MoELayer:
    attn_norm: np.ndarray
    attn_q: np.ndarray
    attn_k: np.ndarray
    attn_v: np.ndarray
    attn_output: np.ndarray
    ffn_norm: np.ndarray
    router: np.ndarray          # ffn_gate_inp [n_expert, n_embd]
    gate_exps: np.ndarray       # [n_expert, n_ff_exp, n_embd]
    up_exps: np.ndarray         # [n_expert, n_ff_exp, n_embd]
    down_exps: np.ndarray       # [n_expert, n_embd, n_ff_exp]
    bias: dict[str, np.ndarray]
    q_norm: np.ndarray | None = None        # qwen3moe [head_dim_k]
    k_norm: np.ndarray | None = None
    shexp: dict[str, np.ndarray] = field(default_factory=dict)   # qwen2moe: gate_inp, gate, up, down


def softmax_top_k(logits: np.ndarray, k: int, renormalize: bool) -> Route:
    """The Route of router logits [n, n_expert] (build_moe_ffn's softmax gating): softmax, the
    k most probable (ties: lower id first), their probabilities divided by their sum
    (clamped at WEIGHTS_SUM_MIN) when `renormalize`; the margin of the k-th over the (k+1)-th."""
    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z)
    probs = probs / probs.sum(axis=1, keepdims=True)
    order = np.argsort(-probs, axis=1, kind="stable")
    ids = order[:, :k]
    weights = np.take_along_axis(probs, ids, axis=1)
    if renormalize:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), WEIGHTS_SUM_MIN)
    if k < logits.shape[1]:
        chosen = np.take_along_axis(logits, order[:, k - 1:k + 1], axis=1)
        margin = chosen[:, 0] - chosen[:, 1]
    else:
        margin = np.full(len(logits), np.inf)
    return Route(ids=ids.astype(np.int64), weights=weights, margin=margin, logits=logits)


def sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)), written with tanh so that it never overflows (= silu(z) / z)."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


class ReferenceMoE(ReferenceModel):
    """A qwen3moe / qwen2moe / mixtral ("llama" with experts) GGUF model evaluated in numpy.

    `ReferenceMoE(path, dtype=np.float64)`; `.forward(tokens, kv, pos0)`,
    `.new_kv(dtype)`, `.greedy(prompt, n)`, `.greedy_logits(prompt, n)` as
    ReferenceModel; `.route(layer, h)` -> Route; after each forward,
    `.last_routes[layer]` is the Route of every token of that call;
    `.min_route_margin(tokens)`; the FFN pieces `.router_logits(layer, h)`,
    `.expert(layer, e, h)`, `.experts(layer, h, route)`, `.shared(layer, h)`.
    Attributes: those of ReferenceModel (n_ff is the experts' n_ff_exp) and
    n_expert, n_expert_used, n_ff_exp, n_ff_shexp (0 without a shared expert),
    norm_topk (renormalized weights), qk_norm, shared_expert."""

    def __init__(self, path: str | os.PathLike[str], dtype: type = np.float64):
        self.file = validate_gguf(path)
        self.dtype = np.dtype(dtype)
        md = self.file.metadata
        self.arch = a = self.file.architecture
        if a not in MOE_ARCHS:
            raise ValueError(f"{path}: architecture {a!r} is not one of the MoE layouts "
                             f"this reference knows ({', '.join(MOE_ARCHS)})")
        self.rope_ordering, self.norm_topk, self.shared_expert, self.qk_norm = MOE_ARCHS[a]

        key = metadata_key(md, a, path)

        self.n_expert = int(key("expert_count", 0))
        if self.n_expert <= 0:
            raise ValueError(f"{path}: {a}.expert_count is absent or 0: not a mixture of experts "
                             f"(a dense llama model is reference.ReferenceModel's)")
        self.n_expert_used = int(key("expert_used_count", required=True))
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise ValueError(f"{path}: expert_used_count {self.n_expert_used} outside "
                             f"1..{self.n_expert}")
        scale = key("expert_weights_scale", None)
        if scale is not None and float(scale) not in (0.0, 1.0):
            raise ValueError(f"{path}: expert_weights_scale {scale} is not implemented by the reference")
        gating = key("expert_gating_func", None)
        if gating is not None and int(gating) != GATING_SOFTMAX:
            raise ValueError(f"{path}: expert_gating_func {gating} (only softmax, 1, is implemented)")

        read_attention(self, key, md, path)

        ff_key = "feed_forward_length" if a == "llama" else "expert_feed_forward_length"
        self.tensors = {t.name: dequantize_tensor(self.file, t) for t in self.file.tensors}
        self._load_moe_weights(str(path), key(ff_key, None), ff_key,
                               key("expert_shared_feed_forward_length", None))
        self.last_routes: list[Route] = []

    def _load_moe_weights(self, path: str, n_ff_key, ff_key_name: str, n_ff_shexp_key) -> None:
        tensors = Tensors(self.tensors, path, self.dtype)
        t, known, take = tensors.tensors, tensors.known, tensors.take

        e, ne = self.n_embd, self.n_expert
        qd, kd, vd = (self.n_head * self.head_dim_k, self.n_head_kv * self.head_dim_k,
                      self.n_head_kv * self.head_dim_v)
        embd = t.get("token_embd.weight")
        if embd is None or embd.ndim != 2 or embd.shape[1] != e:
            raise ValueError(f"{path}: token_embd.weight missing or not [n_vocab, {e}]")
        self.n_vocab = embd.shape[0]
        self.token_embd = take("token_embd.weight", None)
        self.output_norm = take("output_norm.weight", (e,))
        output = take("output.weight", (self.n_vocab, e), optional=self.arch != "qwen2moe")
        self.tied_output = output is None
        self.output = self.token_embd if output is None else output
        freqs = None
        if self.arch == "llama":
            freqs = take("rope_freqs.weight", (self.n_rot // 2,), optional=True)
        self.freq_factors = None if freqs is None else freqs.astype(np.float64)

        gate0 = t.get("blk.0.ffn_gate_exps.weight")
        if gate0 is None or gate0.ndim != 3 or gate0.shape[0] != ne:
            raise ValueError(f"{path}: blk.0.ffn_gate_exps.weight missing or not "
                             f"[{ne}, n_ff_exp, {e}]")
        self.n_ff_exp = self.n_ff = gate0.shape[1]
        if n_ff_key is not None and int(n_ff_key) != self.n_ff_exp:
            raise ValueError(f"{path}: {ff_key_name} {n_ff_key} but ffn_gate_exps has "
                             f"{self.n_ff_exp} rows per expert")
        self.n_ff_shexp = 0
        if self.shared_expert:
            sh = t.get("blk.0.ffn_gate_shexp.weight")
            self.n_ff_shexp = sh.shape[0] if sh is not None and sh.ndim == 2 else 0
            if n_ff_shexp_key is not None and int(n_ff_shexp_key) != self.n_ff_shexp:
                raise ValueError(f"{path}: expert_shared_feed_forward_length {n_ff_shexp_key} but "
                                 f"ffn_gate_shexp has {self.n_ff_shexp} rows")

        f, fs = self.n_ff_exp, self.n_ff_shexp
        shapes = {"attn_q": (qd, e), "attn_k": (kd, e), "attn_v": (vd, e),
                  "attn_output": (e, self.n_head * self.head_dim_v)}
        # biases: none for qwen3moe; q/k/v for qwen2moe; all four attention ones for llama
        bias_names = {"qwen3moe": (), "qwen2moe": ("attn_q", "attn_k", "attn_v"),
                      "llama": _ATTN}[self.arch]
        self.layers: list[MoELayer] = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            mats = {m: take(f"{p}{m}.weight", s) for m, s in shapes.items()}
            bias = {}
            for m in bias_names:
                b = take(f"{p}{m}.bias", (shapes[m][0],), optional=True)
                if b is not None:
                    bias[m] = b
            layer = MoELayer(
                attn_norm=take(f"{p}attn_norm.weight", (e,)),
                ffn_norm=take(f"{p}ffn_norm.weight", (e,)),
                router=take(f"{p}ffn_gate_inp.weight", (ne, e)),
                gate_exps=take(f"{p}ffn_gate_exps.weight", (ne, f, e)),
                up_exps=take(f"{p}ffn_up_exps.weight", (ne, f, e)),
                down_exps=take(f"{p}ffn_down_exps.weight", (ne, e, f)),
                bias=bias, **mats)
            if self.qk_norm:
                layer.q_norm = take(f"{p}attn_q_norm.weight", (self.head_dim_k,))
                layer.k_norm = take(f"{p}attn_k_norm.weight", (self.head_dim_k,))
            if self.shared_expert:
                layer.shexp = {"gate_inp": take(f"{p}ffn_gate_inp_shexp.weight", (e,)),
                               "gate": take(f"{p}ffn_gate_shexp.weight", (fs, e)),
                               "up": take(f"{p}ffn_up_shexp.weight", (fs, e)),
                               "down": take(f"{p}ffn_down_shexp.weight", (e, fs))}
            self.layers.append(layer)
        unknown = sorted(set(t) - known)
        if unknown:
            raise ValueError(f"{path}: tensors the reference does not implement: "
                             f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")

    # --- evaluation -------------------------------------------------------------------

    def forward(self, tokens: Sequence[int], kv: ReferenceKV | None = None,
                pos0: int | None = None) -> np.ndarray:
        """Logits [len(tokens), n_vocab], as ReferenceModel.forward (same cache
        rules).  Sets self.last_routes to this call's Route of every layer."""
        kv, ids, positions = start_forward(self, tokens, kv, pos0)
        n = len(ids)
        theta = rope_angles(positions, self.n_rot, self.freq_base, self.freq_scale,
                            self.freq_factors)
        routes: list[Route] = []
        x = self.token_embd[ids]                              # [n, n_embd]
        for il, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, self.eps)
            q = self._linear(layer, "attn_q", h).reshape(n, self.n_head, self.head_dim_k)
            k = self._linear(layer, "attn_k", h).reshape(n, self.n_head_kv, self.head_dim_k)
            v = self._linear(layer, "attn_v", h).reshape(n, self.n_head_kv, self.head_dim_v)
            if self.qk_norm:
                q = rms_norm(q, layer.q_norm, self.eps)        # over each head's head_dim
                k = rms_norm(k, layer.k_norm, self.eps)
            q = rope(q, theta, self.rope_ordering)
            k = rope(k, theta, self.rope_ordering)
            kv.k[il] = np.concatenate([kv.k[il], k.astype(kv.dtype)])
            kv.v[il] = np.concatenate([kv.v[il], v.astype(kv.dtype)])
            attn = self._attention(q, kv.k[il].astype(self.dtype), kv.v[il].astype(self.dtype),
                                   positions)
            x = x + self._linear(layer, "attn_output", attn)
            h = rms_norm(x, layer.ffn_norm, self.eps)
            route = self.route(il, h)
            routes.append(route)
            out = self.experts(il, h, route)
            if self.shared_expert:
                out = out + self.shared(il, h)
            x = x + out
        self.last_routes = routes
        h = rms_norm(x, self.output_norm, self.eps)
        self.last_hidden = h   # the final-normed rows: what an embedding pools (embed.py)
        return h @ self.output.T

    def min_route_margin(self, tokens: Sequence[int]) -> float:
        """The smallest Route.margin over every layer and token of a fresh prefill
        of `tokens` (prefill and incremental decoding route alike): a test that
        compares an engine's logits can first check that this is well above the
        engine's error in router logits, so that both pick the same experts."""
        self.forward(tokens)
        return float(min(r.margin.min() for r in self.last_routes))

    def router_logits(self, il: int, h: np.ndarray) -> np.ndarray:
        """W_router h: [n, n_expert] for h [n, n_embd] (the ffn_norm output of layer il)."""
        return np.asarray(h, dtype=self.dtype) @ self.layers[il].router.T

    def route(self, il: int, h: np.ndarray) -> Route:
        """The experts layer `il` sends each row of h [n, n_embd] (its ffn_norm
        output) to, and their weights: softmax of the router logits, top-k by
        probability (ties: lower id first), renormalized for qwen3moe / llama."""
        return softmax_top_k(self.router_logits(il, np.atleast_2d(h)), self.n_expert_used, self.norm_topk)

    def expert(self, il: int, e: int, h: np.ndarray) -> np.ndarray:
        """Expert e of layer il on rows h [m, n_embd]: down_e (silu(gate_e h) * up_e h)."""
        layer = self.layers[il]
        gate = h @ layer.gate_exps[e].T
        up = h @ layer.up_exps[e].T
        return (silu(gate) * up) @ layer.down_exps[e].T

    def experts(self, il: int, h: np.ndarray, route: Route) -> np.ndarray:
        """sum_i weights[:, i] * expert(ids[:, i], h), computed once per chosen expert
        on the rows that chose it."""
        out = np.zeros((h.shape[0], self.n_embd), dtype=self.dtype)
        for e in np.unique(route.ids):
            rows, slot = np.nonzero(route.ids == e)
            out[rows] += route.weights[rows, slot][:, None] * self.expert(il, int(e), h[rows])
        return out

    def shared(self, il: int, h: np.ndarray) -> np.ndarray:
        """qwen2moe's shared expert: sigmoid(gate_inp_shexp . h) * down (silu(gate h) * up h)."""
        s = self.layers[il].shexp
        g = sigmoid(h @ s["gate_inp"])                        # [n]
        ffn = (silu(h @ s["gate"].T) * (h @ s["up"].T)) @ s["down"].T
        return g[:, None] * ffn


def well_routed_prompt(model: ReferenceMoE, length: int, *, min_margin: float = 0.05,
                       seed: int = 0, tries: int = 200) -> list[int]:
    """The first of a deterministic series of random prompts (numpy default_rng(seed),
    token ids uniform in 0..n_vocab-1) whose every route, in every layer, is decided
    by at least `min_margin` (see Route.margin).  With tests/ggufgen/moe.py's routers about
    3% of routes have a margin below 0.05, so a 12-token, 3-layer prompt qualifies
    about one time in three.  Raises ValueError after `tries` candidates."""
    rng = np.random.default_rng(seed)
    for _ in range(tries):
        prompt = [int(t) for t in rng.integers(0, model.n_vocab, length)]
        if model.min_route_margin(prompt) >= min_margin:
            return prompt
    raise ValueError(f"no prompt of {length} tokens with every route margin >= {min_margin} "
                     f"in {tries} tries")

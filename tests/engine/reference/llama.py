"""The numpy reference forward pass of the llama family: the specification the engine is checked against.

Owns: `ReferenceModel` (a GGUF file -> dequantized float32 weights -> logits)
and this specification; the pieces it is built from (`ReferenceKV`, `rope()`,
`rms_norm()`, the metadata reader) are common.py's and shared with the other
architectures' references.  Plain numpy,
one obvious operation per line, no batching tricks: when the Vulkan engine and
this module disagree, this module is meant to be the one that is easy to check
by reading.  Nothing here is imported by vramd itself; it lives in the tests.

What it computes is what llama.cpp computes for `general.architecture` "llama"
(Llama 2/3, and Mistral, whose GGUF conversions are written as "llama") and
"qwen2", and "qwen3" (src/models/qwen3.cpp: qwen2's graph without biases and
with QK-norm, below), "mistral3" (llama's graph; YaRN keys and attention
temperature, below) and "phi3" (NeoX; fused attn_qkv and gate/up, LongRoPE,
below), from the GGUF as stored.  Any other architecture, any tensor it does
not know and any RoPE scaling other than none/linear/yarn/longrope is refused
with a ValueError rather than computed wrongly.

RoPE scalings (common.read_rope_scaling, as llama.cpp's context reads them)
  "linear"   freq_scale = 1 / A.rope.scaling.factor
  "yarn"     the same freq_scale, and per pair i the mix of interpolated and
             extrapolated angles of common.rope_angles; cos/sin times
             A.rope.scaling.attn_factor * (1 + 0.1 ln factor); the original
             context A.rope.scaling.original_context_length (else context_length)
             and beta 32 / 1 set the mix's range (mistral3 reads
             A.rope.scaling.yarn_beta_fast / _slow / _log_multiplier too)
  phi3       LongRoPE: rope_factors_long.weight when the context the model runs
             with (n_ctx=, default the trained one) exceeds the original one, else
             rope_factors_short.weight, as rope_freqs; cos/sin times
             A.rope.scaling.attn_factor
  mistral3   A.attention.temperature_scale s: q (after RoPE) times
             1 + s ln(floor(p / n_ctx_orig) + 1)

Metadata keys read (`A` = the value of general.architecture)
-------------------------------------------------------------
  general.architecture                      "llama", "qwen2" or "qwen3"
  A.block_count                             n_layer (required)
  A.embedding_length                        n_embd (required)
  A.attention.head_count                    n_head (required)
  A.attention.head_count_kv                 n_head_kv, default n_head (GQA when smaller)
  A.attention.key_length                    head_dim_k, default n_embd / n_head
  A.attention.value_length                  head_dim_v, default n_embd / n_head
  A.attention.layer_norm_rms_epsilon        eps of every RMSNorm (required)
  A.rope.dimension_count                    n_rot, default head_dim_k
  A.rope.freq_base                          default 10000.0
  A.rope.scaling.type                       "none" or "linear" (default "linear", as llama.cpp)
  A.rope.scaling.factor                     f; freq_scale = 1/f (absent or 0: 1.0);
    (A.rope.scale_linear, the old name, when .factor is absent)
  A.feed_forward_length                     only checked against the tensor shapes
  tokenizer.ggml.bos_token_id / eos_token_id   exposed as .bos / .eos (None if absent)
  A.context_length                          exposed as .n_ctx_train, not enforced

Layouts
-------
A GGUF tensor's shape is in ggml order: ne[0] is the row length (contiguous).
Every tensor is dequantized with `gguf.quants.dequantize` (F32, F16, BF16,
Q8_0, Q4_0, Q4_K, Q6_K, ... anything gguf knows) to float32 and held in numpy
order, i.e. shape reversed: a matrix with ggml shape (n_in, n_out) becomes a
numpy array W of shape (n_out, n_in) whose row r is the r-th ggml row, and a
linear layer is y = W @ x (+ b) -- ggml_mul_mat(W, x).  Consequently
  token_embd.weight  (n_vocab, n_embd):  the embedding of token t is row t;
  attn_q.weight      (n_head * head_dim_k, n_embd): head h is rows
                     [h*head_dim_k, (h+1)*head_dim_k); likewise attn_k/attn_v
                     with n_head_kv heads;
  attn_output.weight (n_embd, n_head * head_dim_v): input is the heads' outputs
                     concatenated in head order;
  ffn_gate, ffn_up   (n_ff, n_embd);  ffn_down (n_embd, n_ff);
  output.weight      (n_vocab, n_embd), or token_embd.weight when absent (tied).
Optional biases (F32, length = rows): attn_q.bias, attn_k.bias, attn_v.bias
(Qwen2 has these three), attn_output.bias, ffn_gate.bias, ffn_up.bias,
ffn_down.bias (llama.cpp's llama graph accepts all of them).

The computation, per token at absolute position p (0-based)
-------------------------------------------------------------
  x = token_embd[t]
  for each layer:
    h = rms_norm(x) * attn_norm           rms_norm(v) = v / sqrt(mean(v*v) + eps)
    q = Wq h + bq, k = Wk h + bk, v = Wv h + bv       split into heads
    qwen3: q_j = rms_norm(q_j) * attn_q_norm, k_g = rms_norm(k_g) * attn_k_norm
           per head over head_dim_k, the model's eps, before RoPE
    q, k = rope(q, p), rope(k, p)          per head, see below; v is not rotated
    K/V cache[layer][p] = k, v             (written before attention, see f16 below)
    for query head j: g = j // (n_head / n_head_kv)   (GQA: consecutive query heads share)
      s_i = (q_j . K_g[i]) / sqrt(head_dim_k)   for cached positions i <= p (causal)
      a = softmax(s) (max-subtracted), o_j = sum_i a_i V_g[i]
    x = x + Wo concat(o_0..o_{n_head-1}) + bo
    h = rms_norm(x) * ffn_norm
    x = x + Wdown (silu(Wgate h + bg) * (Wup h + bu)) + bd      silu(z) = z / (1 + exp(-z))
  logits = Woutput (rms_norm(x) * output_norm)
The attention scale is 1/sqrt(head_dim_k) exactly (llama.cpp's kq_scale).

RoPE
----
theta(p, i) = freq_scale * p * freq_base^(-2i / n_rot) / freq_factor[i] for
i = 0 .. n_rot/2 - 1 (freq_factor from the optional `rope_freqs.weight`, Llama 3.1's
frequency factors, else 1).  A pair (a, b) becomes
(a cos(theta) - b sin(theta), a sin(theta) + b cos(theta)).  Which elements of a
head form pair i depends on the ordering (llama.cpp's rope type per architecture):
  normal ("llama"):  (2i, 2i+1)              -- adjacent elements
  NeoX   ("qwen2", "qwen3"):  (i, i + n_rot/2)        -- the two halves
Elements n_rot .. head_dim-1 (when n_rot < head_dim) are left as they are.
The two orderings are one permutation apart: HF Llama checkpoints rotate halves
(NeoX); convert_hf_to_gguf.py permutes the rows of each head of attn_q/attn_k
(HF row i -> GGUF row 2i, HF row i + d/2 -> GGUF row 2i+1) so that llama.cpp
applies normal ordering to a "llama" GGUF.  This module, like llama.cpp,
applies the ordering of the architecture to the rows as stored and never
un-permutes anything.  Angles are computed here in float64; llama.cpp computes
them in float32 by repeated multiplication (theta *= base^(-2/n_rot)), which
differs by about 1e-7 relative -- at position 1000 about 1e-4 rad.

Precision
---------
Weights are the exact dequantized float32 values.  The arithmetic is float64 by
default (`dtype=`), so the reference carries next to no rounding error of its
own and a test measures the engine's.  The KV cache stores K (after RoPE) and V
in `ReferenceKV.dtype`: float32 by default, or float16 to mirror an engine (and
llama.cpp) that keeps an f16 cache.  That rounding (relative 2^-11 ~ 4.9e-4 per
element) is the largest difference between an f32-accumulating GPU engine and
an f32 cache: on the synthetic models it moves the logits by up to ~2e-3 of
their standard deviation (7e-3 to 8e-3 absolute).  It applies to the current
batch's own K/V too, since llama.cpp writes K/V into the cache and then attends
over the cache view.  (llama.cpp's CPU backend also rounds q and the softmax
weights to f16 when multiplying them with an f16 cache; that is a backend
choice, not part of the model, and not mirrored here; measured, llama.cpp with
an f16 cache and F32 weights stays within 1.5e-3 of the std of the f16-cache
reference.)

An engine test should build its ReferenceKV with the engine's cache type and
compare logits with a tolerance stated relative to the logits' spread, e.g.
max |diff| <= 1e-2 * std.  For greedy token-for-token comparisons,
greedy_logits() also returns the logits each token was chosen from:
top2_margin() of those says how close the runner-up was, and a choice whose
margin is below the logit tolerance can legitimately go either way.

Greedy decoding picks np.argmax, i.e. the lowest token id among equal maxima.

Checked against llama.cpp
-------------------------
Once, by hand (llama-cpp-python 0.3.36 built from source is not a test
dependency), on tests/ggufgen/llama.py's models with a 40-token prefill, CPU,
f32 KV cache, no flash attention: with F32 weights the logits agree within
2e-5 (5e-6 of their std) for llama, mistral-style GQA (8 query / 2 KV heads),
qwen2 (NeoX RoPE, q/k/v biases), tied output and linear RoPE scaling with
freq_base 5e5, and greedy continuations are identical.  With F16, BF16, Q8_0,
Q4_0, Q4_K or Q6_K weights the CPU backend first rounds the activations to
f16 / bf16 / Q8_0 / Q8_K for each product, and the difference grows to 2e-3
(F16), 2e-2 (BF16), 7e-2 to 1e-1 (8- and 4-bit types) of the logits' std --
llama.cpp's rounding, not the model's: an engine that keeps f32 activations
and dequantizes weights exactly should stay near the F32 figure plus the f16
cache's share.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tests.engine.reference.common import (Greedy, ReferenceKV, Tensors, dequantize_tensor, metadata_key,
                                           read_attention, read_rope_scaling, rms_norm, rope, rope_angles, silu,
                                           start_forward)
from vramd.model.gguf_check import validate_gguf

# llama.cpp's rope type per architecture (llama_model_rope_type).
ROPE_ORDERING = {"llama": "normal", "qwen2": "neox", "qwen3": "neox", "mistral3": "normal", "phi3": "neox"}
# Architectures whose q and k heads are RMS-normalized before RoPE (attn_q_norm /
# attn_k_norm, required there and refused elsewhere).
QK_NORM_ARCHS = ("qwen3",)

_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_LAYER_NORMS = ("attn_norm", "ffn_norm")


@dataclass
class Layer:
    attn_norm: np.ndarray
    attn_q: np.ndarray
    attn_k: np.ndarray
    attn_v: np.ndarray
    attn_output: np.ndarray
    ffn_norm: np.ndarray
    ffn_gate: np.ndarray
    ffn_up: np.ndarray
    ffn_down: np.ndarray
    bias: dict[str, np.ndarray]     # matrix name (e.g. "attn_q") -> bias, only those present
    attn_q_norm: np.ndarray | None = None   # qwen3: [head_dim_k], one weight for every head
    attn_k_norm: np.ndarray | None = None


class ReferenceModel(Greedy):
    """A llama-family GGUF model evaluated in numpy.

    `ReferenceModel(path, dtype=np.float64)`; `.forward(tokens, kv, pos0)`;
    `.new_kv(dtype)`; `.greedy(prompt, n)`.  Hyperparameters are attributes:
    arch, rope_ordering, n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim_k,
    head_dim_v, n_ff, n_rot, eps, freq_base, freq_scale, n_ctx_train, bos, eos,
    tied_output.  `.tensors` maps every tensor name to its float32 values."""

    def __init__(self, path: str | os.PathLike[str], dtype: type = np.float64, n_ctx: int | None = None):
        self.file = validate_gguf(path)
        self.dtype = np.dtype(dtype)
        md = self.file.metadata
        self.arch = self.file.architecture
        if self.arch not in ROPE_ORDERING:
            raise ValueError(f"{path}: architecture {self.arch!r} is not in the llama family "
                             f"this reference knows ({', '.join(ROPE_ORDERING)})")
        self.rope_ordering = ROPE_ORDERING[self.arch]
        a = self.arch

        key = metadata_key(md, a, path)

        read_attention(self, key, md, path)
        self.attn_temp_scale = 0.0
        if self.arch == "mistral3":
            read_rope_scaling(self, key, path, yarn_keys=True)
            self.attn_temp_scale = float(key("attention.temperature_scale", 0.0))
        # the context the model runs with: picks phi3's LongRoPE factors (default: as llama.cpp, the trained one)
        self.n_ctx = int(n_ctx or self.n_ctx_train or 0)

        self.tensors = {t.name: dequantize_tensor(self.file, t) for t in self.file.tensors}
        if self.arch == "phi3":
            self._unfuse_phi3()
        self._load_weights(str(path), key("feed_forward_length", None))

    def _unfuse_phi3(self) -> None:
        """phi3's fused tensors as the llama names: attn_qkv -> attn_q, attn_k, attn_v (rows
        in that order), ffn_up [2 n_ff] -> ffn_gate (first half), ffn_up (second half);
        LongRoPE's rope_factors_long when the context exceeds the original one, else
        rope_factors_short, as rope_freqs (the other is dropped)."""
        t, q, kv = self.tensors, self.n_head * self.head_dim_k, self.n_head_kv * self.head_dim_k
        for name in [n for n in t if n.endswith("attn_qkv.weight")]:
            b, w = name[:-len("attn_qkv.weight")], t.pop(name)
            t[b + "attn_q.weight"], t[b + "attn_k.weight"], t[b + "attn_v.weight"] = w[:q], w[q:q + kv], w[q + kv:]
        for name in [n for n in t if n.endswith("ffn_up.weight")]:
            b, w = name[:-len("ffn_up.weight")], t[name]
            half = w.shape[0] // 2
            t[b + "ffn_gate.weight"], t[name] = w[:half], w[half:]
        long, short = t.pop("rope_factors_long.weight", None), t.pop("rope_factors_short.weight", None)
        chosen = long if self.n_ctx > self.n_ctx_orig else short
        if chosen is not None:
            t["rope_freqs.weight"] = chosen

    def _load_weights(self, path: str, n_ff_key) -> None:
        tensors = Tensors(self.tensors, path, self.dtype)
        t, known, take = tensors.tensors, tensors.known, tensors.take

        e, qd, kd, vd = (self.n_embd, self.n_head * self.head_dim_k,
                         self.n_head_kv * self.head_dim_k, self.n_head_kv * self.head_dim_v)
        embd = t.get("token_embd.weight")
        if embd is None or embd.ndim != 2 or embd.shape[1] != e:
            raise ValueError(f"{path}: token_embd.weight missing or not [n_vocab, {e}]")
        self.n_vocab = embd.shape[0]
        self.token_embd = take("token_embd.weight", None)
        self.output_norm = take("output_norm.weight", (e,))
        output = take("output.weight", (self.n_vocab, e), optional=True)
        self.tied_output = output is None
        self.output = self.token_embd if output is None else output
        freqs = take("rope_freqs.weight", (self.n_rot // 2,), optional=True)
        self.freq_factors = None if freqs is None else freqs.astype(np.float64)

        gate = t.get("blk.0.ffn_gate.weight")
        self.n_ff = gate.shape[0] if gate is not None else 0
        if n_ff_key is not None and int(n_ff_key) != self.n_ff:
            raise ValueError(f"{path}: feed_forward_length {n_ff_key} but ffn_gate has "
                             f"{self.n_ff} rows")
        shapes = {"attn_q": (qd, e), "attn_k": (kd, e), "attn_v": (vd, e),
                  "attn_output": (e, self.n_head * self.head_dim_v),
                  "ffn_gate": (self.n_ff, e), "ffn_up": (self.n_ff, e), "ffn_down": (e, self.n_ff)}
        self.layers: list[Layer] = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            mats = {m: take(f"{p}{m}.weight", s) for m, s in shapes.items()}
            bias = {}
            for m, s in shapes.items():
                b = take(f"{p}{m}.bias", (s[0],), optional=True)
                if b is not None:
                    bias[m] = b
            qk = {}
            if self.arch in QK_NORM_ARCHS:
                qk = {n: take(f"{p}{n}.weight", (self.head_dim_k,)) for n in ("attn_q_norm", "attn_k_norm")}
                if bias:
                    raise ValueError(f"{path}: {self.arch} has no attention biases "
                                     f"(llama.cpp loads none), found {', '.join(bias)}")
            self.layers.append(Layer(attn_norm=take(f"{p}attn_norm.weight", (e,)),
                                     ffn_norm=take(f"{p}ffn_norm.weight", (e,)),
                                     bias=bias, **mats, **qk))
        unknown = sorted(set(t) - known)
        if unknown:
            raise ValueError(f"{path}: tensors the reference does not implement: "
                             f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")

    # --- evaluation -------------------------------------------------------------------

    def new_kv(self, dtype: type = np.float32) -> ReferenceKV:
        """An empty cache for this model whose K/V are stored in `dtype`."""
        return ReferenceKV(self.n_layer, self.n_head_kv, self.head_dim_k, self.head_dim_v, dtype)

    def forward(self, tokens: Sequence[int], kv: ReferenceKV | None = None,
                pos0: int | None = None) -> np.ndarray:
        """Logits [len(tokens), n_vocab] (in self.dtype) of `tokens` at positions
        pos0, pos0+1, ...; each attends to the cache's positions < pos0 and to
        the tokens before it and itself.  `kv` is extended in place.
        pos0 None means len(kv); pos0 < len(kv) first drops positions >= pos0
        (prefix reuse); pos0 > len(kv) is an error.  kv None means a fresh cache
        (so pos0 must be 0 or None)."""
        kv, ids, positions = start_forward(self, tokens, kv, pos0)
        n = len(ids)
        theta = rope_angles(positions, self.n_rot, self.freq_base, self.freq_scale,
                            self.freq_factors, self.yarn)
        magnitude = self.rope_magnitude(self.freq_scale)
        q_magnitude = magnitude
        if self.attn_temp_scale:   # llama 4 / mistral3: q scaled per position (floor = the original context)
            q_magnitude = magnitude * (1.0 + self.attn_temp_scale
                                       * np.log(np.floor(positions / self.n_ctx_orig) + 1.0))
        x = self.token_embd[ids]                              # [n, n_embd]
        for il, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, self.eps)
            q = self._linear(layer, "attn_q", h).reshape(n, self.n_head, self.head_dim_k)
            k = self._linear(layer, "attn_k", h).reshape(n, self.n_head_kv, self.head_dim_k)
            v = self._linear(layer, "attn_v", h).reshape(n, self.n_head_kv, self.head_dim_v)
            if layer.attn_q_norm is not None:       # per head, over head_dim, before RoPE
                q = rms_norm(q, layer.attn_q_norm, self.eps)
                k = rms_norm(k, layer.attn_k_norm, self.eps)
            q = rope(q, theta, self.rope_ordering, q_magnitude)
            k = rope(k, theta, self.rope_ordering, magnitude)
            kv.k[il] = np.concatenate([kv.k[il], k.astype(kv.dtype)])
            kv.v[il] = np.concatenate([kv.v[il], v.astype(kv.dtype)])
            attn = self._attention(q, kv.k[il].astype(self.dtype), kv.v[il].astype(self.dtype),
                                   positions)
            x = x + self._linear(layer, "attn_output", attn)
            h = rms_norm(x, layer.ffn_norm, self.eps)
            gate = self._linear(layer, "ffn_gate", h)
            up = self._linear(layer, "ffn_up", h)
            x = x + self._linear(layer, "ffn_down", silu(gate) * up)
        h = rms_norm(x, self.output_norm, self.eps)
        self.last_hidden = h   # the final-normed rows: what an embedding pools (embed.py)
        return h @ self.output.T

    def _linear(self, layer: Layer, name: str, x: np.ndarray) -> np.ndarray:
        y = x @ getattr(layer, name).T
        if name in layer.bias:
            y = y + layer.bias[name]
        return y

    def _attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   positions: np.ndarray) -> np.ndarray:
        """q [n, n_head, dk] at `positions`; k [m, n_head_kv, dk], v [m, n_head_kv, dv]
        for positions 0..m-1.  Returns [n, n_head * dv]."""
        n, m = q.shape[0], k.shape[0]
        group = self.n_head // self.n_head_kv
        scale = 1.0 / math.sqrt(self.head_dim_k)
        causal = np.arange(m)[None, :] <= positions[:, None]  # [n, m]
        out = np.empty((n, self.n_head, self.head_dim_v), dtype=self.dtype)
        for j in range(self.n_head):
            g = j // group
            scores = (q[:, j, :] @ k[:, g, :].T) * scale       # [n, m]
            scores = np.where(causal, scores, -np.inf)
            scores = scores - scores.max(axis=1, keepdims=True)
            weights = np.exp(scores)
            weights = weights / weights.sum(axis=1, keepdims=True)
            out[:, j, :] = weights @ v[:, g, :]
        return out.reshape(n, self.n_head * self.head_dim_v)

    # --- helpers ------------------------------------------------------------------------



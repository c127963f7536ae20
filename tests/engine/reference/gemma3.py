"""The numpy reference forward pass of gemma3 and gemma2: the specification vramd/engine/arch/gemma3.py is checked against.

Owns: `Gemma3Reference` (a gemma3 GGUF file -> dequantized weights -> logits;
`.forward(tokens, kv, pos0)`, `.new_kv(dtype)`, `.greedy()`, `.greedy_logits()`),
`gelu()` and `softcap()`.  Plain numpy, one obvious operation per line, in the
style of llama.py; the pieces the families share (`dequantize_tensor`,
`rms_norm`, `rope_angles`, `rope`, `ReferenceKV`, `top2_margin`, the metadata
reader) are common.py's.  Nothing here is imported by vramd; it does not
import vramd/engine/arch/gemma3.py either (the two are written independently from
llama.cpp's gemma3 graph, src/models/gemma3.cpp, and hparams, llama-model.cpp).

Metadata keys read (`A` = "gemma3")
-----------------------------------
  A.block_count, A.embedding_length, A.attention.head_count (required)
  A.attention.head_count_kv        default head_count (the 270M: 1 KV head for 4 query heads)
  A.attention.key_length           head_dim, default n_embd / n_head (the 270M: 256)
  A.attention.value_length         must equal key_length
  A.attention.layer_norm_rms_epsilon   eps of every RMSNorm, QK-norm included (required)
  A.attention.sliding_window       window size; absent or 0: no sliding layers
  A.rope.freq_base                 base of the global layers' RoPE, default 10000
  A.rope.scaling.type / .factor    "none" or "linear" (default linear): the global
                                   layers' freq_scale = 1/factor (absent or 0: 1)
  A.rope.dimension_count           n_rot, default head_dim
  A.final_logit_softcapping        cap; absent or 0: none
  A.feed_forward_length            checked against ffn_gate's shape
Not in any key, assumed as llama.cpp does for gemma3:
  sliding pattern      layer l slides iff window > 0 and l % 6 < 5 (every 6th layer global)
  sliding-layer RoPE   base 10000, freq_scale 1
  attention scale      1/sqrt(key_length); for 62 layers (the 27B) 1/sqrt(n_embd // n_head)

gemma2 (src/models/gemma2-iswa.cpp, llama-model.cpp's LLM_ARCH_GEMMA2)
-----------------------------------------------------------------------
  no attn_q_norm / attn_k_norm; sliding pattern 2 (layer l slides iff l % 2 == 0)
  with A.attention.sliding_window default 4096 and the global RoPE on every layer;
  the scores s_i (after the scale) soft-capped: s_i = c tanh(s_i / c), c =
  A.attn_logit_softcapping (default 50); the logits always capped with
  A.final_logit_softcapping (default 30); the 27B is the 46-layer one.
  RoPE scaling for both: common.read_rope_scaling (none, linear, yarn).

The computation, per token t at position p
------------------------------------------
  x = token_embd[t] * sqrt(n_embd)
  per layer:
    h = rms_norm(x) * attn_norm                      rms_norm(v) = v / sqrt(mean(v*v) + eps)
    q, k, v = Wq h, Wk h, Wv h                        split into heads of head_dim
    q_j = rms_norm(q_j) * attn_q_norm   per head      (one [head_dim] weight for all heads)
    k_g = rms_norm(k_g) * attn_k_norm   per KV head
    q, k = rope(q, p), rope(k, p)                     NeoX ordering (pairs i, i + n_rot/2)
    K/V cache[p] = k, v
    for query head j, g = j // (n_head / n_head_kv):
      s_i = scale * (q_j . K_g[i]) over cached i <= p, and i > p - window on sliding layers
      o_j = softmax(s) V_g
    x = x + rms_norm(Wo concat(o)) * post_attention_norm
    h = rms_norm(x) * ffn_norm
    x = x + rms_norm(Wdown (gelu(Wgate h) * Wup h)) * post_ffw_norm
  logits = Wout (rms_norm(x) * output_norm)            Wout = token_embd when output.weight is absent
  logits = cap * tanh(logits / cap)                     when a cap is set
  gelu(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))   (ggml_gelu's tanh form)

Norm weights are used exactly as stored: llama.cpp's converter already added
Gemma's "+1" (HF computes x_hat * (1 + w)), and its graph multiplies by the
stored value.  See vramd/engine/arch/gemma3.py's docstring for the evidence.

Precision
---------
Like llama.py: weights are the exact dequantized values, the arithmetic
is float64 by default, K/V are stored in the cache in the ReferenceKV's dtype
(float16 to mirror the engine).  One exception, for size: the token embedding
(also the tied output matrix: 262144 x 640 in the 270M, 0.7 GB as float32) is
held in float32 and the output projection is one float32 product (float64
would take 1.3 GB and much longer per token); its rounding, ~1e-6 of the
logits, is far below any tolerance the tests use.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from tests.engine.reference.common import (Greedy, ReferenceKV, dequantize_tensor, metadata_key, read_rope_scaling,
                                           rms_norm, rope, rope_angles, start_forward, top2_margin)
from vramd.model.gguf_check import validate_gguf

__all__ = ["Gemma3Reference", "gelu", "softcap", "top2_margin"]

SWA_PATTERN = 6
SWA_FREQ_BASE = 10000.0

_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


def gelu(z: np.ndarray) -> np.ndarray:
    """ggml_gelu: the tanh approximation of GELU."""
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z * z * z)))


def softcap(logits: np.ndarray, cap: float) -> np.ndarray:
    return cap * np.tanh(logits / cap)


class Gemma3Reference(Greedy):
    """A gemma3 GGUF model evaluated in numpy.  Hyper-parameters are
    attributes (n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab,
    n_rot, eps, freq_base, freq_scale, window, swa_layers, attn_scale, cap,
    tied_output, bos, eos); `.layers[i]` maps tensor short names to values."""

    def __init__(self, path: str | os.PathLike[str], dtype: type = np.float64):
        self.file = mf = validate_gguf(path)
        self.dtype = np.dtype(dtype)
        md = mf.metadata
        self.arch = mf.architecture
        if self.arch not in ("gemma3", "gemma2"):
            raise ValueError(f"{path}: architecture {mf.architecture!r} is not gemma3 or gemma2")
        gemma2 = self.arch == "gemma2"
        key = metadata_key(md, self.arch, path)

        self.n_layer = int(key("block_count", required=True))
        self.n_embd = int(key("embedding_length", required=True))
        self.n_head = int(key("attention.head_count", required=True))
        self.n_head_kv = int(key("attention.head_count_kv", self.n_head))
        self.head_dim = int(key("attention.key_length", self.n_embd // self.n_head))
        if int(key("attention.value_length", self.head_dim)) != self.head_dim:
            raise ValueError(f"{path}: value_length != key_length")
        self.eps = float(key("attention.layer_norm_rms_epsilon", required=True))
        self.n_rot = int(key("rope.dimension_count", self.head_dim))
        self.freq_base = float(key("rope.freq_base", 10000.0))
        read_rope_scaling(self, key, path)
        self.window = int(key("attention.sliding_window", 4096 if gemma2 else 0) or 0)
        pattern = 2 if gemma2 else SWA_PATTERN
        self.swa_layers = [self.window > 0 and i % pattern < pattern - 1 for i in range(self.n_layer)]
        self.swa_rope = (self.freq_base, self.freq_scale) if gemma2 else None   # None: SWA_FREQ_BASE, scale 1
        divisor = self.n_embd // self.n_head if self.n_layer == (46 if gemma2 else 62) else self.head_dim
        self.attn_scale = 1.0 / math.sqrt(divisor)
        self.cap = float(key("final_logit_softcapping", 30.0 if gemma2 else 0.0) or 0.0)
        self.attn_cap = float(key("attn_logit_softcapping", 50.0)) if gemma2 else 0.0
        self.qk_norm = not gemma2
        self.bos = md.get("tokenizer.ggml.bos_token_id")
        self.eos = md.get("tokenizer.ggml.eos_token_id")
        self._load(str(path), key("feed_forward_length", None))

    def _load(self, path: str, n_ff_key) -> None:
        infos = {t.name: t for t in self.file.tensors}
        known: set[str] = set()

        def take(name: str, dtype=None):
            if name not in infos:
                raise ValueError(f"{path}: missing tensor {name}")
            known.add(name)
            return dequantize_tensor(self.file, infos[name]).astype(dtype or self.dtype)

        self.token_embd = take("token_embd.weight", np.float32)
        self.n_vocab = self.token_embd.shape[0]
        if self.token_embd.shape != (self.n_vocab, self.n_embd):
            raise ValueError(f"{path}: token_embd.weight is {self.token_embd.shape}")
        self.tied_output = "output.weight" not in infos
        self.output = self.token_embd if self.tied_output else take("output.weight", np.float32)
        self.output_norm = take("output_norm.weight")
        e, hd = self.n_embd, self.head_dim
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            layer = {m: take(f"{p}{m}.weight") for m in _MATRICES + _NORMS
                     if self.qk_norm or m not in ("attn_q_norm", "attn_k_norm")}
            self.layers.append(layer)
        self.n_ff = self.layers[0]["ffn_gate"].shape[0]
        if n_ff_key is not None and int(n_ff_key) != self.n_ff:
            raise ValueError(f"{path}: feed_forward_length {n_ff_key} but ffn_gate has {self.n_ff} rows")
        shapes = {"attn_q": (self.n_head * hd, e), "attn_k": (self.n_head_kv * hd, e),
                  "attn_v": (self.n_head_kv * hd, e), "attn_output": (e, self.n_head * hd),
                  "ffn_gate": (self.n_ff, e), "ffn_up": (self.n_ff, e), "ffn_down": (e, self.n_ff),
                  "attn_norm": (e,), "attn_q_norm": (hd,), "attn_k_norm": (hd,), "post_attention_norm": (e,),
                  "ffn_norm": (e,), "post_ffw_norm": (e,)}
        for i, layer in enumerate(self.layers):
            for m, s in shapes.items():
                if m in layer and layer[m].shape != s:
                    raise ValueError(f"{path}: blk.{i}.{m} has shape {layer[m].shape}, expected {s}")
        unknown = sorted(set(infos) - known)
        if unknown:
            raise ValueError(f"{path}: tensors the reference does not implement: {', '.join(unknown[:5])}")

    # --- evaluation -------------------------------------------------------------------

    def new_kv(self, dtype: type = np.float32) -> ReferenceKV:
        return ReferenceKV(self.n_layer, self.n_head_kv, self.head_dim, self.head_dim, dtype)

    def forward(self, tokens: Sequence[int], kv: ReferenceKV | None = None,
                pos0: int | None = None) -> np.ndarray:
        """Logits [len(tokens), n_vocab] of `tokens` at positions pos0.. (as
        reference.ReferenceModel.forward: `kv` is extended in place; pos0 None
        means len(kv); a smaller pos0 drops the positions from it on)."""
        kv, ids, positions = start_forward(self, tokens, kv, pos0)
        n, hd = len(ids), self.head_dim
        theta_global = rope_angles(positions, self.n_rot, self.freq_base, self.freq_scale, yarn=self.yarn)
        swa_rope = self.swa_rope or (SWA_FREQ_BASE, 1.0)
        theta_swa = rope_angles(positions, self.n_rot, *swa_rope, yarn=self.yarn)
        x = self.token_embd[ids].astype(self.dtype) * math.sqrt(self.n_embd)
        for il, L in enumerate(self.layers):
            swa = self.swa_layers[il]
            theta = theta_swa if swa else theta_global
            mag = self.rope_magnitude(swa_rope[1] if swa else self.freq_scale)
            h = rms_norm(x, L["attn_norm"], self.eps)
            q = (h @ L["attn_q"].T).reshape(n, self.n_head, hd)
            k = (h @ L["attn_k"].T).reshape(n, self.n_head_kv, hd)
            v = (h @ L["attn_v"].T).reshape(n, self.n_head_kv, hd)
            if self.qk_norm:
                q = rms_norm(q, L["attn_q_norm"], self.eps)     # over the last axis: per head
                k = rms_norm(k, L["attn_k_norm"], self.eps)
            q = rope(q, theta, "neox", mag)
            k = rope(k, theta, "neox", mag)
            kv.k[il] = np.concatenate([kv.k[il], k.astype(kv.dtype)])
            kv.v[il] = np.concatenate([kv.v[il], v.astype(kv.dtype)])
            o = self._attention(q, kv.k[il].astype(self.dtype), kv.v[il].astype(self.dtype), positions,
                                self.window if swa else 0)
            x = x + rms_norm(o @ L["attn_output"].T, L["post_attention_norm"], self.eps)
            h = rms_norm(x, L["ffn_norm"], self.eps)
            g = gelu(h @ L["ffn_gate"].T) * (h @ L["ffn_up"].T)
            x = x + rms_norm(g @ L["ffn_down"].T, L["post_ffw_norm"], self.eps)
        h = rms_norm(x, self.output_norm, self.eps)
        self.last_hidden = h   # the final-normed rows: what an embedding pools (embed.py)
        logits = (h.astype(np.float32) @ self.output.T).astype(self.dtype)   # float32: see Precision
        if self.cap > 0:
            logits = softcap(logits, self.cap)
        return logits

    def _attention(self, q, k, v, positions, window: int) -> np.ndarray:
        n, m = q.shape[0], k.shape[0]
        group = self.n_head // self.n_head_kv
        j = np.arange(m)[None, :]
        visible = j <= positions[:, None]
        if window > 0:
            visible &= j > positions[:, None] - window
        out = np.empty((n, self.n_head, self.head_dim), dtype=self.dtype)
        for h in range(self.n_head):
            g = h // group
            s = (q[:, h, :] @ k[:, g, :].T) * self.attn_scale
            if self.attn_cap > 0:
                s = softcap(s, self.attn_cap)
            s = np.where(visible, s, -np.inf)
            s = s - s.max(axis=1, keepdims=True)
            w = np.exp(s)
            w = w / w.sum(axis=1, keepdims=True)
            out[:, h, :] = w @ v[:, g, :]
        return out.reshape(n, self.n_head * self.head_dim)

    # --- helpers ------------------------------------------------------------------------



"""The numpy reference forward pass of gemma4 (Gemma 4's dense text decoder): the specification vramd/engine/arch/gemma4.py is checked against.

Owns `Gemma4Reference` (a gemma4 GGUF file -> dequantized weights -> logits;
`.forward(tokens, kv, pos0)`, `.new_kv(dtype)`).  Written from llama.cpp's
description (src/models/gemma4.cpp: its load_arch_hparams, load_arch_tensors
and graph; llama-hparams.cpp's per-layer n_rot / head sizes; the converter's
Gemma4Model), not from the engine; gelu, softcap and the common helpers are
gemma3.py's and common.py's.

Metadata keys read (`A` = "gemma4")
-----------------------------------
  A.block_count, A.embedding_length, A.attention.head_count (required)
  A.attention.sliding_window_pattern   bool per layer (required): the layer slides
  A.attention.sliding_window           the window (required)
  A.attention.head_count_kv            a number or one per layer
  A.attention.key_length / value_length         global layers' head size (equal)
  A.attention.key_length_swa / value_length_swa sliding layers' head size (equal)
  A.rope.dimension_count               global layers' n_rot, default key_length
  A.rope.dimension_count_swa           sliding layers' n_rot, default key_length_swa
  A.rope.freq_base                     global layers' base, default 10000
  A.rope.freq_base_swa                 sliding layers' base, default rope.freq_base
  A.rope.scaling.*                     common.read_rope_scaling (both kinds of layer)
  A.attention.layer_norm_rms_epsilon   (required)
  A.final_logit_softcapping            absent or 0: none
  A.attention.shared_kv_layers = N      the last N layers share K/V (E2B / E4B), 0: none
  A.embedding_length_per_layer_input = P  per-layer embeddings of P (E2B / E4B), 0: none

The computation, per token t at position p (layer l: sliding or global)
----------------------------------------------------------------------
  x = token_embd[t] * sqrt(n_embd)
  per layer (hd, kvh, n_rot, base: the layer kind's):
    h = rms_norm(x) * attn_norm
    q = Wq h; k = Wk h; v = Wv h, or v = k (the projection, before any norm) where
        the layer has no attn_v (Gemma 4's attention_k_eq_v)
    q_j = rms_norm(q_j) * attn_q_norm; k_g = rms_norm(k_g) * attn_k_norm   per head
    v_g = rms_norm(v_g)                                  per head, no weight
    q, k = rope_neox(q, k; n_rot, base, freq_factors)    freq_factors = rope_freqs.weight
        on global layers only (the "proportional" RoPE: 1e30 for unrotated pairs)
    s_i = q_j . K_g[i]   (scale 1: Gemma 4 has no query_pre_attn_scalar)
        over cached i <= p, and i > p - window on sliding layers
    o_j = softmax(s) V_g
    x = x + rms_norm(Wo o) * post_attention_norm
    h = rms_norm(x) * ffn_norm
    x = x + rms_norm(Wdown (gelu(Wgate h) * Wup h)) * post_ffw_norm
    x = x + rms_norm(Wproj_l (gelu(Winp_gate_l x) * ple[l])) * post_norm_l   where P > 0
    x = x * layer_output_scale                           where blk.l.layer_output_scale exists
  KV sharing (llama.cpp's layer_reuse_cb): with n_kv = block_count - N, a layer l >= n_kv
  projects no K/V and attends over layer n_kv - 2's (sliding l) or n_kv - 1's (global l).
  Per-layer inputs (x0 = token_embd[t] * sqrt(n_embd); per layer a row of P):
    ple[l] = (rms_norm((per_layer_model_proj x0 / sqrt(n_embd))[l]) * per_layer_proj_norm
              + per_layer_token_embd[t][l] * sqrt(P)) / sqrt(2)
  logits = Wout (rms_norm(x) * output_norm); logits = cap tanh(logits / cap) when cap > 0

Precision as gemma3.py (float64, the K/V cache in the ReferenceKV's dtype, the
output projection in float32).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from tests.engine.reference.common import (Greedy, ReferenceKV, dequantize_tensor, metadata_key, read_rope_scaling,
                                           rms_norm, rope, rope_angles, start_forward)
from tests.engine.reference.gemma3 import gelu, softcap
from vramd.model.gguf_check import validate_gguf

__all__ = ["Gemma4Reference"]

_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_NORMS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
          "layer_output_scale")
_OPTIONAL = ("attn_v", "layer_output_scale")
_PLE = ("inp_gate", "proj", "post_norm")   # per-layer embeddings' tensors of a layer


class Gemma4Reference(Greedy):
    """A gemma4 GGUF model evaluated in numpy.  Per layer: `swa[l]`, `head_dim[l]`,
    `n_head_kv[l]`, `n_rot[l]`, `base[l]`; `.layers[l]` maps tensor short names to values.
    A subclass computes another FFN by `_ffn` and reads its tensors by `_layer_tensors`
    (tests/engine/reference/gemma4_moe.py)."""

    TENSORS = tuple(m + ".weight" for m in _MATRICES + _NORMS)     # a layer's, by their names less blk.l.
    OPTIONAL = tuple(m + ".weight" for m in _OPTIONAL)

    def __init__(self, path: str | os.PathLike[str], dtype: type = np.float64):
        self.file = mf = validate_gguf(path)
        self.dtype = np.dtype(dtype)
        md = mf.metadata
        if mf.architecture != "gemma4":
            raise ValueError(f"{path}: architecture {mf.architecture!r} is not gemma4")
        key = metadata_key(md, "gemma4", path)
        n = self.n_layer = int(key("block_count", required=True))
        self.n_embd = int(key("embedding_length", required=True))
        self.n_head = int(key("attention.head_count", required=True))
        self.swa = [bool(b) for b in key("attention.sliding_window_pattern", required=True)]
        if len(self.swa) != n:
            raise ValueError(f"{path}: sliding_window_pattern has {len(self.swa)} entries for {n} layers")
        self.window = int(key("attention.sliding_window", required=True))
        kvh = key("attention.head_count_kv", self.n_head)
        kvh = list(kvh) if isinstance(kvh, list) else [kvh] * n
        hd_full = int(key("attention.key_length", self.n_embd // self.n_head))
        hd_swa = int(key("attention.key_length_swa", hd_full))
        if (int(key("attention.value_length", hd_full)) != hd_full
                or int(key("attention.value_length_swa", hd_swa)) != hd_swa):
            raise ValueError(f"{path}: value_length != key_length")
        rot_full = int(key("rope.dimension_count", hd_full))
        rot_swa = int(key("rope.dimension_count_swa", hd_swa))
        self.freq_base = float(key("rope.freq_base", 10000.0))
        base_swa = float(key("rope.freq_base_swa", self.freq_base))
        read_rope_scaling(self, key, path)
        self.head_dim = [hd_swa if s else hd_full for s in self.swa]
        self.n_head_kv = [int(k) for k in kvh]
        self.n_rot = [rot_swa if s else rot_full for s in self.swa]
        self.base = [base_swa if s else self.freq_base for s in self.swa]
        self.eps = float(key("attention.layer_norm_rms_epsilon", required=True))
        self.cap = float(key("final_logit_softcapping", 0.0) or 0.0)
        self.v_norm = True   # Gemma 4 always norms V (an attribute so that a test can turn it off)
        shared = int(key("attention.shared_kv_layers", 0) or 0)
        first = n - shared
        self.kv_source = [l if l < first else first - (2 if self.swa[l] else 1) for l in range(n)]
        self.n_ple = int(key("embedding_length_per_layer_input", 0) or 0)
        self._load(str(path))

    def _load(self, path: str) -> None:
        infos = {t.name: t for t in self.file.tensors}
        known: set[str] = set()

        def take(name: str, dtype=None):
            known.add(name)
            return dequantize_tensor(self.file, infos[name]).astype(dtype or self.dtype)

        self.token_embd = take("token_embd.weight", np.float32)
        self.n_vocab = self.token_embd.shape[0]
        self.output = self.token_embd if "output.weight" not in infos else take("output.weight", np.float32)
        self.output_norm = take("output_norm.weight")
        self.rope_freqs = take("rope_freqs.weight") if "rope_freqs.weight" in infos else None
        if self.n_ple:
            self.ple_table = take("per_layer_token_embd.weight")
            self.ple_proj = take("per_layer_model_proj.weight")
            self.ple_norm = take("per_layer_proj_norm.weight")
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            layer = {}
            for m in self._layer_tensors(i):
                if p + m in infos:
                    layer[m.removesuffix(".weight")] = take(p + m)
                elif m not in self.OPTIONAL:
                    raise ValueError(f"{path}: missing tensor {p}{m}")
            self.layers.append(layer)
        unknown = sorted(set(infos) - known)
        if unknown:
            raise ValueError(f"{path}: tensors the reference does not implement: {', '.join(unknown[:5])}")

    def _layer_tensors(self, il: int) -> tuple:
        return self.TENSORS + (tuple(m + ".weight" for m in _PLE) if self.n_ple else ())


    def new_kv(self, dtype: type = np.float32) -> ReferenceKV:
        kv = ReferenceKV(self.n_layer, 1, 1, 1, dtype)
        kv.k = [np.zeros((0, g, hd), kv.dtype) for g, hd in zip(self.n_head_kv, self.head_dim)]
        kv.v = [np.zeros((0, g, hd), kv.dtype) for g, hd in zip(self.n_head_kv, self.head_dim)]
        return kv

    def forward(self, tokens: Sequence[int], kv: ReferenceKV | None = None,
                pos0: int | None = None) -> np.ndarray:
        """Logits [len(tokens), n_vocab] of `tokens` at positions pos0.. (`kv` extended in place)."""
        kv, ids, positions = start_forward(self, tokens, kv, pos0)
        n = len(ids)
        x = self.token_embd[ids].astype(self.dtype) * math.sqrt(self.n_embd)
        ple = self._per_layer_inputs(x, ids) if self.n_ple else None
        for il, L in enumerate(self.layers):
            hd, g = self.head_dim[il], self.n_head_kv[il]
            factors = None if self.swa[il] else self.rope_freqs
            theta = rope_angles(positions, self.n_rot[il], self.base[il], self.freq_scale, factors, yarn=self.yarn)
            mag = self.rope_magnitude(self.freq_scale)
            h = rms_norm(x, L["attn_norm"], self.eps)
            q = (h @ L["attn_q"].T).reshape(n, self.n_head, hd)
            k = (h @ L["attn_k"].T).reshape(n, g, hd)
            v = (h @ L["attn_v"].T).reshape(n, g, hd) if "attn_v" in L else k.copy()
            q = rope(rms_norm(q, L["attn_q_norm"], self.eps), theta, "neox", mag)
            k = rope(rms_norm(k, L["attn_k_norm"], self.eps), theta, "neox", mag)
            if self.v_norm:
                v = rms_norm(v, np.ones(hd, self.dtype), self.eps)
            src = self.kv_source[il]
            if src == il:   # else the layer's own K/V are not used: it reads layer src's
                kv.k[il] = np.concatenate([kv.k[il], k.astype(kv.dtype)])
                kv.v[il] = np.concatenate([kv.v[il], v.astype(kv.dtype)])
            o = self._attention(q, kv.k[src].astype(self.dtype), kv.v[src].astype(self.dtype), positions,
                                self.window if self.swa[il] else 0)
            x = x + rms_norm(o @ L["attn_output"].T, L["post_attention_norm"], self.eps)
            x = x + rms_norm(self._ffn(il, L, x), L["post_ffw_norm"], self.eps)
            if ple is not None:
                g = gelu(x @ L["inp_gate"].T) * ple[:, il, :]
                x = x + rms_norm(g @ L["proj"].T, L["post_norm"], self.eps)
            if "layer_output_scale" in L:
                x = x * L["layer_output_scale"][0]
        h = rms_norm(x, self.output_norm, self.eps)
        logits = (h.astype(np.float32) @ self.output.T).astype(self.dtype)
        return softcap(logits, self.cap) if self.cap > 0 else logits

    def _per_layer_inputs(self, x0, ids) -> np.ndarray:
        """[n, n_layer, P]: each token's input to each layer (x0 the scaled token embeddings)."""
        n, P = len(ids), self.n_ple
        proj = (x0 @ self.ple_proj.T / math.sqrt(self.n_embd)).reshape(n, self.n_layer, P)
        tok = self.ple_table[ids].reshape(n, self.n_layer, P) * math.sqrt(P)
        return (rms_norm(proj, self.ple_norm, self.eps) + tok) / math.sqrt(2.0)

    def _ffn(self, il: int, L: dict, x: np.ndarray) -> np.ndarray:
        """Layer il's FFN of the residual stream x, before its post_ffw_norm."""
        h = rms_norm(x, L["ffn_norm"], self.eps)
        return (gelu(h @ L["ffn_gate"].T) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T

    def _attention(self, q, k, v, positions, window: int) -> np.ndarray:
        n, m, hd = q.shape[0], k.shape[0], q.shape[2]
        group = self.n_head // k.shape[1]
        j = np.arange(m)[None, :]
        visible = j <= positions[:, None]
        if window > 0:
            visible &= j > positions[:, None] - window
        out = np.empty((n, self.n_head, hd), dtype=self.dtype)
        for h in range(self.n_head):
            s = np.where(visible, q[:, h, :] @ k[:, h // group, :].T, -np.inf)   # scale 1
            w = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, h, :] = (w / w.sum(axis=1, keepdims=True)) @ v[:, h // group, :]
        return out.reshape(n, self.n_head * hd)

"""The numpy reference forward pass of gpt-oss (general.architecture "gpt-oss").

Owns `GptOssReference` (a GGUF file -> dequantized weights -> logits; the API
of the other references: `.forward(tokens, kv, pos0)`, `.new_kv(dtype)`,
`.greedy()`, `.greedy_logits()`, and `.last_routes` as reference.moe's) and
`swiglu_oai`.  Written from llama.cpp's description of the model
(src/models/openai-moe-iswa.cpp, src/llama-graph.cpp build_moe_ffn with
LLM_FFN_SWIGLU_OAI_MOE and LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT,
ggml's soft_max_ext with sinks and swiglu_oai ops, llama-model.cpp's hparams
for LLM_ARCH_OPENAI_MOE); it shares nothing with vramd's engine.

Per layer, x the residual stream:
    h = rms_norm(x) * attn_norm
    q, k, v = W h + b (biases on all three); NeoX RoPE on q and k with the
        file's YaRN (common.read_rope_scaling: beta_fast 32, beta_slow 1)
    attention over the cache, scale 1/sqrt(head_dim); layers 0, 2, 4, ...
        slide (a key at j is seen from position p iff p - window < j <= p:
        llama.cpp's set_swa_pattern(2), LLAMA_SWA_TYPE_STANDARD), odd layers
        are full.  Each head has a sink logit s_h: the softmax runs over the
        scores and s_h, and s_h's share carries no value:
            out = sum_j exp(a_j - m) v_j / (sum_j exp(a_j - m) + exp(s_h - m)),
            m = max(max_j a_j, s_h)
    x += W_o out + b_o
    h = rms_norm(x) * post_attention_norm
    router logits r = W_r h + b_r; the top-k (k = expert_used_count) by r;
        their weights softmax(r over the k chosen) (SOFTMAX_WEIGHT)
    per chosen expert e: g = W_gate[e] h + b_gate[e], u = W_up[e] h + b_up[e],
        a = swiglu_oai(g, u), y_e = W_down[e] a + b_down[e]
    x += sum_e weight_e y_e
then rms_norm * output_norm and the output matrix (gpt-oss files never tie).

swiglu_oai (ggml's, alpha 1.702 and limit 7 fixed in build_moe_ffn):
    g' = min(g, limit), u' = clip(u, -limit, limit), g' sigmoid(alpha g') (u' + 1)
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from tests.engine.reference.common import (Greedy, ReferenceKV, Tensors, dequantize_tensor, metadata_key,
                                           read_attention, rms_norm, rope, rope_angles, start_forward)
from tests.engine.reference.moe import Route, sigmoid
from vramd.model.gguf_check import validate_gguf

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def swiglu_oai(g: np.ndarray, u: np.ndarray, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT):
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return g * sigmoid(alpha * g) * (u + 1.0)


class GptOssReference(Greedy):
    """A gpt-oss GGUF model evaluated in numpy.  Attributes: read_attention's
    (n_layer, n_embd, n_head, n_head_kv, head_dim_k, ...), n_expert,
    n_expert_used, n_ff_exp, window, swa_layers; `.layers[i]` maps tensor
    short names (attn_q, attn_q.bias, attn_sinks, ffn_gate_exps, ...) to values."""

    def __init__(self, path: str | os.PathLike[str], dtype: type = np.float64):
        self.file = mf = validate_gguf(path)
        self.dtype = np.dtype(dtype)
        if mf.architecture != "gpt-oss":
            raise ValueError(f"{path}: architecture {mf.architecture!r} is not gpt-oss")
        key = metadata_key(mf.metadata, "gpt-oss", path)
        read_attention(self, key, mf.metadata, path)
        if self.head_dim_k != self.head_dim_v or self.n_rot != self.head_dim_k:
            raise ValueError(f"{path}: key/value length and rope dimension differ")
        self.head_dim = self.head_dim_k
        self.n_expert = int(key("expert_count", required=True))
        self.n_expert_used = int(key("expert_used_count", required=True))
        self.n_ff_exp = int(key("expert_feed_forward_length", required=True))
        self.window = int(key("attention.sliding_window", required=True))
        self.swa_layers = [i % 2 == 0 for i in range(self.n_layer)]
        self.attn_scale = 1.0 / math.sqrt(self.head_dim)
        self._load(str(path))
        self.last_routes: list[Route] = []

    def _load(self, path: str) -> None:
        tensors = Tensors({t.name: dequantize_tensor(self.file, t) for t in self.file.tensors}, path, self.dtype)
        e, hd, f, ne = self.n_embd, self.head_dim, self.n_ff_exp, self.n_expert
        qd, kd = self.n_head * hd, self.n_head_kv * hd
        self.token_embd = tensors.take("token_embd.weight", None).astype(np.float32)
        self.n_vocab = self.token_embd.shape[0]
        self.output_norm = tensors.take("output_norm.weight", (e,))
        self.output = tensors.take("output.weight", (self.n_vocab, e)).astype(np.float32)
        shapes = {"attn_norm.weight": (e,), "attn_q.weight": (qd, e), "attn_q.bias": (qd,),
                  "attn_k.weight": (kd, e), "attn_k.bias": (kd,), "attn_v.weight": (kd, e), "attn_v.bias": (kd,),
                  "attn_output.weight": (e, qd), "attn_output.bias": (e,), "attn_sinks.weight": (self.n_head,),
                  "post_attention_norm.weight": (e,), "ffn_gate_inp.weight": (ne, e), "ffn_gate_inp.bias": (ne,),
                  "ffn_gate_exps.weight": (ne, f, e), "ffn_gate_exps.bias": (ne, f),
                  "ffn_up_exps.weight": (ne, f, e), "ffn_up_exps.bias": (ne, f),
                  "ffn_down_exps.weight": (ne, e, f), "ffn_down_exps.bias": (ne, e)}
        self.layers = [{name.removesuffix(".weight"): tensors.take(f"blk.{i}.{name}", s) for name, s in shapes.items()}
                       for i in range(self.n_layer)]
        unknown = tensors.unknown()
        if unknown:
            raise ValueError(f"{path}: tensors the reference does not implement: {', '.join(unknown[:5])}")

    def new_kv(self, dtype: type = np.float32) -> ReferenceKV:
        return ReferenceKV(self.n_layer, self.n_head_kv, self.head_dim, self.head_dim, dtype)

    def forward(self, tokens: Sequence[int], kv: ReferenceKV | None = None, pos0: int | None = None) -> np.ndarray:
        """Logits [len(tokens), n_vocab] of `tokens` at positions pos0.. (kv extended in place)."""
        kv, ids, positions = start_forward(self, tokens, kv, pos0)
        n, hd = len(ids), self.head_dim
        theta = rope_angles(positions, self.n_rot, self.freq_base, self.freq_scale, yarn=self.yarn)
        mag = self.rope_magnitude(self.freq_scale)
        x = self.token_embd[ids].astype(self.dtype)
        self.last_routes = []
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], self.eps)
            q = (h @ L["attn_q"].T + L["attn_q.bias"]).reshape(n, self.n_head, hd)
            k = (h @ L["attn_k"].T + L["attn_k.bias"]).reshape(n, self.n_head_kv, hd)
            v = (h @ L["attn_v"].T + L["attn_v.bias"]).reshape(n, self.n_head_kv, hd)
            q, k = rope(q, theta, "neox", mag), rope(k, theta, "neox", mag)
            kv.k[il] = np.concatenate([kv.k[il], k.astype(kv.dtype)])
            kv.v[il] = np.concatenate([kv.v[il], v.astype(kv.dtype)])
            o = self._attention(q, kv.k[il].astype(self.dtype), kv.v[il].astype(self.dtype), positions,
                                self.window if self.swa_layers[il] else 0, L["attn_sinks"])
            x = x + o @ L["attn_output"].T + L["attn_output.bias"]
            x = x + self._moe(L, rms_norm(x, L["post_attention_norm"], self.eps))
        h = rms_norm(x, self.output_norm, self.eps)
        return (h.astype(np.float32) @ self.output.T).astype(self.dtype)

    def _attention(self, q, k, v, positions, window: int, sinks: np.ndarray) -> np.ndarray:
        n, m = q.shape[0], k.shape[0]
        group = self.n_head // self.n_head_kv
        j = np.arange(m)[None, :]
        visible = j <= positions[:, None]
        if window > 0:
            visible &= j > positions[:, None] - window
        out = np.empty((n, self.n_head, self.head_dim), dtype=self.dtype)
        for hh in range(self.n_head):
            g = hh // group
            s = np.where(visible, (q[:, hh, :] @ k[:, g, :].T) * self.attn_scale, -np.inf)
            mx = np.maximum(s.max(axis=1, keepdims=True), sinks[hh])
            w = np.exp(s - mx)
            out[:, hh, :] = (w @ v[:, g, :]) / (w.sum(axis=1, keepdims=True) + np.exp(sinks[hh] - mx))
        return out.reshape(n, self.n_head * self.head_dim)

    def _moe(self, L: dict, h: np.ndarray) -> np.ndarray:
        logits = h @ L["ffn_gate_inp"].T + L["ffn_gate_inp.bias"]
        k = self.n_expert_used
        order = np.argsort(-logits, axis=1, kind="stable")
        ids = order[:, :k]
        chosen = np.take_along_axis(logits, ids, axis=1)
        w = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        w = w / w.sum(axis=1, keepdims=True)
        nxt = np.take_along_axis(logits, order[:, k:k + 1], axis=1)[:, 0] if k < self.n_expert else np.inf
        self.last_routes.append(Route(ids=ids, weights=w, margin=chosen[:, -1] - nxt, logits=logits))
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for e, we in zip(ids[t], w[t]):
                g = L["ffn_gate_exps"][e] @ h[t] + L["ffn_gate_exps.bias"][e]
                u = L["ffn_up_exps"][e] @ h[t] + L["ffn_up_exps.bias"][e]
                out[t] += we * (L["ffn_down_exps"][e] @ swiglu_oai(g, u) + L["ffn_down_exps.bias"][e])
        return out


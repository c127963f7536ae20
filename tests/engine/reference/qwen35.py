"""The numpy reference forward pass of Qwen3.5 (qwen35, qwen35moe): Gated DeltaNet layers interleaved with gated attention.

Owns: `Qwen35Reference` (a qwen35 GGUF file -> dequantized weights -> logits; the API
of ReferenceModel: `.forward(tokens, cache, pos0)`, `.new_kv(dtype)`, `.greedy()`,
`.greedy_logits()`), `Qwen35Cache` (the K/V of the attention layers and the recurrent
state of the others), and the two forms of the gated delta rule, `delta_rule_recurrent`
and `delta_rule_chunked` (the same numbers; the chunked one is the form llama.cpp's
prefill uses, chunks of CHUNK = 64 tokens).  Written from llama.cpp's description
(src/models/qwen35.cpp, delta-net-base.cpp, ggml-cpu's ssm_conv / l2_norm / softplus);
plain numpy, nothing of vramd's engine.

What a file computes (x the residual stream, rms_norm with eps = attention.layer_norm_rms_epsilon)
  every layer:  x += mixer(rms_norm(x, attn_norm));  x += ffn(rms_norm(x, post_attention_norm)),
                ffn(h) = ffn_down(silu(ffn_gate h) * ffn_up h).  Layer i is a DeltaNet layer
                unless (i + 1) % full_attention_interval == 0 (default interval 4).
  gated attention: attn_q gives per head [q (hd), gate (hd)]; q and k RMS-normed per head
                (attn_q_norm / attn_k_norm), NeoX RoPE over rope.dimension_count dimensions
                (M-RoPE with text positions: every section rotates by the one position), causal
                softmax attention with scale 1/sqrt(hd) (GQA: query head j reads KV head
                j // (n_head / n_head_kv)); out = attn_output(attn * sigmoid(gate)).
  DeltaNet:     H_k = ssm.group_count key heads and H_v = ssm.time_step_rank value heads of size
                S = ssm.state_size.  m = attn_qkv h (channels q [H_k S], k [H_k S], v [H_v S]),
                z = attn_gate h, beta = sigmoid(ssm_beta h), g = softplus(ssm_alpha h +
                ssm_dt.bias) * ssm_a (softplus(x) = x for x > 20, else log(1 + e^x); ssm_a < 0).
                Causal depthwise conv over time: c_t = sum_j w[:, j] m_{t - (d-1) + j} (tap d-1 on
                the current token; m before the first token: the conv state, zeros at the start),
                then silu.  q, k l2-normalised per head: x / max(|x|, eps); q scaled 1/sqrt(S).
                Value head h reads key head h % H_k (ggml tiles the repeat).  Per head the state
                M [S, S] (value x key) runs the gated delta rule:
                    M <- exp(g_t) M;  M <- M + beta_t (v_t - M k_t) k_t^T;  o_t = M q_t,
                then o = rms_norm(o, ssm_norm) (per head) * silu(z), out = ssm_out o.
                The recurrent state carried between calls: the last d-1 conv inputs m (per
                layer [d-1, channels]) and M (per layer [H_v, S, S]), both f32 in llama.cpp.
  qwen35moe:    ffn is Qwen35Reference._moe (softmax routing, renormalized top-k, gated shared expert).
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np

from tests.engine.reference.common import (Greedy, ReferenceKV, Tensors, dequantize_tensor, metadata_key, rms_norm,
                                           rope, rope_angles, silu)
from vramd.model.gguf_check import validate_gguf

CHUNK = 64   # llama.cpp's delta-rule chunk (build_delta_net_chunking, CS for scalar gates)


def sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def softplus(x):
    """ggml's softplus: x above 20, else log(1 + e^x)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def l2_norm(x, eps):
    """ggml_l2_norm: x / max(|x|, eps) over the last axis (eps a floor on the norm)."""
    return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), eps)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """One head, token by token: q, k [n, S], v [n, S], g, beta [n], state M [S, S]
    (value x key).  Returns (o [n, S], the final state)."""
    m = state.copy()
    out = np.empty_like(v)
    for t in range(len(q)):
        m = m * np.exp(g[t])
        m = m + np.outer(beta[t] * (v[t] - m @ k[t]), k[t])
        out[t] = m @ q[t]
    return out, m


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same as delta_rule_recurrent, chunk tokens at a time (the WY form llama.cpp's
    build_delta_net_chunking computes).  Within a chunk, G = cumsum(g), D[i, j] =
    exp(G_i - G_j) for j <= i; A = strictly-lower (beta_i k_i.k_j D[i, j]); T = (I + A)^-1;
    U = T (beta v); W = T (beta e^G k); then with the state M at the chunk's start:
        V' = U - W M^T,  o = (e^G q) M^T + (lower-incl. (q_i.k_j D[i, j])) V',
        M <- e^{G_last} M + V'^T (e^{G_last - G} k)."""
    m = state.copy()
    out = np.empty_like(v)
    for c0 in range(0, len(q), chunk):
        sl = slice(c0, c0 + chunk)
        qc, kc, vc, gc, bc = q[sl], k[sl], v[sl], g[sl], beta[sl]
        n = len(qc)
        big_g = np.cumsum(gc)
        lower = np.tril(np.ones((n, n), bool))
        decay = np.where(lower, np.exp(np.where(lower, big_g[:, None] - big_g[None, :], 0.0)), 0.0)
        a = np.tril(bc[:, None] * (kc @ kc.T) * decay, -1)
        t = np.linalg.inv(np.eye(n) + a)
        u = t @ (bc[:, None] * vc)
        w = t @ ((bc * np.exp(big_g))[:, None] * kc)
        v_new = u - w @ m.T
        out[sl] = (np.exp(big_g)[:, None] * qc) @ m.T + ((qc @ kc.T) * decay) @ v_new
        m = np.exp(big_g[-1]) * m + v_new.T @ (np.exp(big_g[-1] - big_g)[:, None] * kc)
    return out, m


class Qwen35Cache:
    """One sequence's cache: `kv` (a ReferenceKV over the attention layers, in order), and
    per DeltaNet layer `conv` [d_conv - 1, channels] and `ssm` [H_v, S, S] (float64 here;
    f32 in llama.cpp).  `n` positions seen.  It cannot be truncated (the recurrent state
    of a prefix is gone): `copy()` is how a caller keeps a checkpoint."""

    def __init__(self, model: "Qwen35Reference", dtype):
        n_attn = sum(not r for r in model.recurrent)
        self.kv = ReferenceKV(n_attn, model.n_head_kv, model.head_dim, model.head_dim, dtype)
        n_rec = sum(model.recurrent)
        self.conv = [np.zeros((model.d_conv - 1, model.conv_dim)) for _ in range(n_rec)]
        self.ssm = [np.zeros((model.n_v_heads, model.s, model.s)) for _ in range(n_rec)]
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def copy(self) -> "Qwen35Cache":
        other = Qwen35Cache.__new__(Qwen35Cache)
        other.kv, other.n = self.kv.copy(), self.n
        other.conv = [c.copy() for c in self.conv]
        other.ssm = [s.copy() for s in self.ssm]
        return other


class Qwen35Reference(Greedy):
    """`Qwen35Reference(path, dtype=np.float64, chunked=True)`: chunked picks the delta
    rule's form for calls of more than one token (both give the same numbers)."""

    def __init__(self, path: str | os.PathLike[str], dtype: type = np.float64, chunked: bool = True):
        self.file = validate_gguf(path)
        self.dtype, self.chunked = np.dtype(dtype), chunked
        # switches a test turns off to show llama.cpp's chain depends on them (not parameters of the file)
        self.head_broadcast, self.attn_gate = "tile", True
        md, a = self.file.metadata, self.file.architecture
        if a not in ("qwen35", "qwen35moe"):
            raise ValueError(f"{path}: architecture {a!r} is not qwen35 or qwen35moe")
        key = metadata_key(md, a, path)
        self.n_expert = int(key("expert_count", 0)) if a == "qwen35moe" else 0
        self.n_expert_used = int(key("expert_used_count", 0))
        self.n_layer = int(key("block_count", required=True))
        self.n_embd = int(key("embedding_length", required=True))
        self.n_head = int(key("attention.head_count", required=True))
        self.n_head_kv = int(key("attention.head_count_kv", self.n_head))
        self.head_dim = int(key("attention.key_length", self.n_embd // self.n_head))
        if int(key("attention.value_length", self.head_dim)) != self.head_dim:
            raise ValueError(f"{path}: key_length and value_length differ (llama.cpp asserts them equal)")
        self.eps = float(key("attention.layer_norm_rms_epsilon", required=True))
        self.n_rot = int(key("rope.dimension_count", self.head_dim))
        self.freq_base = float(key("rope.freq_base", 10000.0))
        sections = [int(s) for s in key("rope.dimension_sections", required=True)]
        if len(sections) < 4 or sections[3] != 0:
            raise ValueError(f"{path}: rope.dimension_sections {sections}: a fourth section is not "
                             f"implemented (text positions leave it at 0)")
        interval = int(key("full_attention_interval", 4))
        self.recurrent = [(i + 1) % interval != 0 for i in range(self.n_layer)]
        self.d_conv = int(key("ssm.conv_kernel", required=True))
        self.s = int(key("ssm.state_size", required=True))
        self.n_k_heads = int(key("ssm.group_count", required=True))
        self.n_v_heads = int(key("ssm.time_step_rank", required=True))
        if int(key("ssm.inner_size", required=True)) != self.n_v_heads * self.s:
            raise ValueError(f"{path}: ssm.inner_size is not time_step_rank x state_size")
        self.conv_dim = 2 * self.n_k_heads * self.s + self.n_v_heads * self.s
        self._load(str(path), {t.name: dequantize_tensor(self.file, t) for t in self.file.tensors})

    def _load(self, path: str, tensors: dict) -> None:
        t = Tensors(tensors, path, self.dtype)
        e, hd, s, hv = self.n_embd, self.head_dim, self.s, self.n_v_heads
        self.token_embd = t.take("token_embd.weight", None)
        self.n_vocab = self.token_embd.shape[0]
        self.output_norm = t.take("output_norm.weight", (e,))
        out = t.take("output.weight", (self.n_vocab, e), optional=True)
        self.output = self.token_embd if out is None else out
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            w = {"attn_norm": t.take(p + "attn_norm.weight", (e,)),
                 "post_norm": t.take(p + "post_attention_norm.weight", (e,))}
            if self.n_expert:
                w |= {n: t.take(f"{p}ffn_{n}.weight", None) for n in
                      ("gate_inp", "gate_exps", "up_exps", "down_exps", "gate_inp_shexp", "gate_shexp",
                       "up_shexp", "down_shexp")}
            else:
                w |= {n: t.take(f"{p}{n}.weight", None) for n in ("ffn_gate", "ffn_up", "ffn_down")}
            if self.recurrent[i]:
                w |= {"qkv": t.take(p + "attn_qkv.weight", (self.conv_dim, e)),
                      "z": t.take(p + "attn_gate.weight", (hv * s, e)),
                      "conv": t.take(p + "ssm_conv1d.weight", (self.conv_dim, self.d_conv)),
                      "dt": t.take(p + "ssm_dt.bias", (hv,)), "a": t.take(p + "ssm_a", (hv,)),
                      "alpha": t.take(p + "ssm_alpha.weight", (hv, e)),
                      "beta": t.take(p + "ssm_beta.weight", (hv, e)),
                      "norm": t.take(p + "ssm_norm.weight", (s,)),
                      "out": t.take(p + "ssm_out.weight", (e, hv * s))}
            else:
                w |= {"q": t.take(p + "attn_q.weight", (2 * self.n_head * hd, e)),
                      "k": t.take(p + "attn_k.weight", (self.n_head_kv * hd, e)),
                      "v": t.take(p + "attn_v.weight", (self.n_head_kv * hd, e)),
                      "q_norm": t.take(p + "attn_q_norm.weight", (hd,)),
                      "k_norm": t.take(p + "attn_k_norm.weight", (hd,)),
                      "o": t.take(p + "attn_output.weight", (e, self.n_head * hd))}
            self.layers.append(w)
        if t.unknown():
            raise ValueError(f"{path}: tensors the reference does not implement: {', '.join(t.unknown()[:5])}")

    def new_kv(self, dtype: type = np.float32) -> Qwen35Cache:
        return Qwen35Cache(self, dtype)

    def forward(self, tokens: Sequence[int], cache: Qwen35Cache | None = None,
                pos0: int | None = None) -> np.ndarray:
        """Logits [len(tokens), n_vocab] of `tokens` after the cache's positions; the cache
        is extended in place.  pos0 (None: len(cache)) must be len(cache), or 0 (the cache
        is then reset): a recurrent state cannot go back to a shorter prefix."""
        cache = self.new_kv() if cache is None else cache
        pos0 = len(cache) if pos0 is None else pos0
        if pos0 == 0 and len(cache):
            cache.__init__(self, cache.kv.dtype)
        elif pos0 != len(cache):
            raise ValueError(f"pos0 {pos0}: a qwen35 cache of {len(cache)} positions can only be continued "
                             f"or restarted (the recurrent state cannot be truncated)")
        ids = np.asarray(list(tokens), dtype=np.int64)
        if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= self.n_vocab:
            raise ValueError(f"forward needs a non-empty list of token ids in 0..{self.n_vocab - 1}")
        positions = np.arange(pos0, pos0 + len(ids))
        theta = rope_angles(positions, self.n_rot, self.freq_base, 1.0)
        x = self.token_embd[ids]
        i_attn = i_rec = 0
        for il, w in enumerate(self.layers):
            h = rms_norm(x, w["attn_norm"], self.eps)
            if self.recurrent[il]:
                x = x + self._deltanet(w, h, cache, i_rec)
                i_rec += 1
            else:
                x = x + self._attention(w, h, cache.kv, i_attn, theta, positions)
                i_attn += 1
            h = rms_norm(x, w["post_norm"], self.eps)
            x = x + (self._moe(w, h) if self.n_expert else
                     (silu(h @ w["ffn_gate"].T) * (h @ w["ffn_up"].T)) @ w["ffn_down"].T)
        cache.n += len(ids)
        h = rms_norm(x, self.output_norm, self.eps)
        self.last_hidden = h
        return h @ self.output.T

    def _attention(self, w, h, kv: ReferenceKV, il: int, theta, positions):
        n, hd = len(h), self.head_dim
        qg = (h @ w["q"].T).reshape(n, self.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, self.n_head * hd)
        k = (h @ w["k"].T).reshape(n, self.n_head_kv, hd)
        v = (h @ w["v"].T).reshape(n, self.n_head_kv, hd)
        q = rope(rms_norm(q, w["q_norm"], self.eps), theta, "neox")
        k = rope(rms_norm(k, w["k_norm"], self.eps), theta, "neox")
        kv.k[il] = np.concatenate([kv.k[il], k.astype(kv.dtype)])
        kv.v[il] = np.concatenate([kv.v[il], v.astype(kv.dtype)])
        keys, values = kv.k[il].astype(self.dtype), kv.v[il].astype(self.dtype)
        causal = np.arange(len(keys))[None, :] <= positions[:, None]
        group = self.n_head // self.n_head_kv
        out = np.empty((n, self.n_head, hd), dtype=self.dtype)
        for j in range(self.n_head):
            scores = np.where(causal, (q[:, j] @ keys[:, j // group].T) / math.sqrt(hd), -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, j] = (p / p.sum(axis=1, keepdims=True)) @ values[:, j // group]
        out = out.reshape(n, -1) * (sigmoid(gate) if self.attn_gate else 1.0)
        return out @ w["o"].T

    def _moe(self, w, h):
        """qwen35moe's FFN (build_moe_ffn, softmax gating, norm_w): softmax over all experts,
        the top n_expert_used (ties: lower id), their probabilities renormalized (sum floored at
        6.103515625e-5), plus sigmoid(gate_inp_shexp . h) * the shared SwiGLU expert."""
        logits = h @ w["gate_inp"].T
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        ids = np.argsort(-probs, axis=1, kind="stable")[:, :self.n_expert_used]
        weights = np.take_along_axis(probs, ids, axis=1)
        weights /= np.maximum(weights.sum(axis=1, keepdims=True), 6.103515625e-5)
        out = np.zeros_like(h)
        for r in range(len(h)):
            for e_id, wt in zip(ids[r], weights[r]):
                act = silu(w["gate_exps"][e_id] @ h[r]) * (w["up_exps"][e_id] @ h[r])
                out[r] += wt * (w["down_exps"][e_id] @ act)
        shared = (silu(h @ w["gate_shexp"].T) * (h @ w["up_shexp"].T)) @ w["down_shexp"].T
        return out + sigmoid(h @ w["gate_inp_shexp"])[:, None] * shared

    def _deltanet(self, w, h, cache: Qwen35Cache, il: int):
        n, s, hk, hv = len(h), self.s, self.n_k_heads, self.n_v_heads
        mixed = h @ w["qkv"].T                                          # [n, conv_dim]
        z = (h @ w["z"].T).reshape(n, hv, s)
        beta = sigmoid(h @ w["beta"].T)                                 # [n, H_v]
        g = softplus(h @ w["alpha"].T + w["dt"]) * w["a"]               # [n, H_v], <= 0
        window = np.concatenate([cache.conv[il], mixed])                # [d - 1 + n, conv_dim]
        cache.conv[il] = window[n:] if self.d_conv > 1 else window[:0]
        conv = sum(window[j:j + n] * w["conv"][:, j] for j in range(self.d_conv))
        conv = silu(conv)
        kd = hk * s
        q = l2_norm(conv[:, :kd].reshape(n, hk, s), self.eps) / math.sqrt(s)
        k = l2_norm(conv[:, kd:2 * kd].reshape(n, hk, s), self.eps)
        v = conv[:, 2 * kd:].reshape(n, hv, s)
        rule = delta_rule_chunked if self.chunked and n > 1 else delta_rule_recurrent
        o = np.empty((n, hv, s), dtype=self.dtype)
        for head in range(hv):
            kh = head % hk if self.head_broadcast == "tile" else head // (hv // hk)
            o[:, head], cache.ssm[il][head] = rule(q[:, kh], k[:, kh], v[:, head],
                                                   g[:, head], beta[:, head], cache.ssm[il][head])
        o = rms_norm(o, w["norm"], self.eps) * silu(z)
        return o.reshape(n, hv * s) @ w["out"].T


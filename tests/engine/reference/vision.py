"""The numpy reference of the vision encoder (ViT + projector): the specification
vramd's encoder kernels are checked against.

Owns: `ReferenceVision` (an mmproj GGUF file -> dequantized float32 weights ->
the embeddings the language model receives for one preprocessed image), and
the pieces it is made of: `patch_embed`, `layer_norm`, `rms_norm`,
`attention`, `gelu_tanh`, `gelu_quick`, `silu`, `avg_pool`.  Plain numpy, one
obvious operation per line; nothing here is imported by vramd itself.

The file is read through vramd's own checks (validate_gguf, then
vramd.model.mmproj.load_mmproj), so the reference refuses what vramd refuses
and reads the tensors check_tensors names (legacy swapped ffn names
included).  The metadata keys and tensor shapes are documented in
vramd/model/mmproj.py.

The computation (what llama.cpp's clip_graph_llava / clip_graph_siglip compute)
----------------------------------------------------------------------------
Input: pixels [3, S, S] float32, already resized and normalized
(vramd.model.image.preprocess_image), S = image_size, p = patch_size,
g = S / p patches per side, n = g*g patches in raster order (row-major:
patch (r, c) is index r*g + c).

  patches    x[r*g + c] = W_patch . pixels[:, r*p:(r+1)*p, c*p:(c+1)*p] + b_patch
             W_patch numpy [n_embd, 3, p, p] (ggml [p, p, 3, n_embd], ggml_conv_2d's
             kernel layout): a convolution of stride p, no padding
  class      mlp with v.class_embd: the sequence is [class, x_0 .. x_{n-1}]
             (see vramd/model/mmproj.py for why class first)
  positions  x[i] += position_embd[i] for every position i of the sequence
  pre_ln     if present: x = layer_norm(x) * w + b
  layers     for the first n_layer_run layers (mlp: block_count - 1 by default):
               h = layer_norm(x) * ln1.w + ln1.b
               q, k, v = W h + b (attn_q/attn_k/attn_v), split into n_head heads of
                 head_dim contiguous rows each
               per head: softmax(q k^T / sqrt(head_dim)) v over ALL positions (non-causal,
                 no mask), max-subtracted
               x = x + W_out concat(heads) + b_out
               h = layer_norm(x) * ln2.w + ln2.b
               x = x + W_down act(W_up h + b_up) + b_down
             act = the config's ffn_act: "gelu" (tanh approximation), "gelu_quick"
             (x * sigmoid(1.702 x)) or "silu"
  post_ln    if present: x = layer_norm(x) * w + b
  mlp        drop the class position; y = mm.2 (gelu_tanh(mm.0 x + b0)) + b2
  gemma3     grid [g, g, n_embd] -> k x k average pooling, non-overlapping
             (k = n_merge) -> [(g/k)^2, n_embd] in raster order of the pooled grid;
             rms_norm(x) * soft_emb_norm (eps = the tower's eps); y = x @ W_in,
             W_in numpy [n_embd, n_text] (ggml [n_text, n_embd], used transposed as
             llama.cpp does)
Output: [n_tokens, n_text] (mlp: n tokens; gemma3: (g/k)^2).

layer_norm(v) = (v - mean(v)) / sqrt(var(v) + eps), over the embedding axis
(ggml_norm); rms_norm(v) = v / sqrt(mean(v^2) + eps) (ggml_rms_norm).

GELU: llama.cpp's ggml_gelu is the tanh approximation
0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -- the LLaVA projector's
activation and the SigLIP tower's FFN (clip.use_gelu true, HF's
gelu_pytorch_tanh); CLIP's tower uses quick GELU (clip.use_gelu false,
HF's quick_gelu).  No projector here uses the erf GELU (ggml_gelu_erf).
On the CPU, ggml_gelu goes through an f16 lookup table (GGML_GELU_FP16) and
ggml_conv_2d converts the image to the kernel's type (F16 for F16 kernels)
before the product: llama.cpp's rounding, not the model's; not mirrored.

Precision: weights are the exact dequantized float32 values, the arithmetic
is float64 by default (`dtype=`), so the reference carries next to no
rounding of its own; compare an engine with a tolerance relative to the
output's spread (e.g. max |diff| <= 1e-2 * std).

Not checked against a llama.cpp run (no mtmd binary here): the graph was
read from llama.cpp's tools/mtmd sources (clip.cpp build_vit / build_inp /
build_ffn / build_attn, models/llava.cpp, models/siglip.cpp).
"""

from __future__ import annotations

import os

import numpy as np

from tests.engine.reference.common import dequantize_tensor
from vramd.model.gguf_check import validate_gguf
from vramd.model.mmproj import MmprojConfig, MmprojTensors, load_mmproj


def layer_norm(x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_quick(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-1.702 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


ACTIVATIONS = {"gelu": gelu_tanh, "gelu_quick": gelu_quick, "silu": silu}


def patch_embed(pixels: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """pixels [3, S, S], weight [n_embd, 3, p, p] -> [n_patches, n_embd] in raster order."""
    n_embd, channels, p, _ = weight.shape
    _, height, width = pixels.shape
    gh, gw = height // p, width // p
    blocks = pixels.reshape(channels, gh, p, gw, p).transpose(1, 3, 0, 2, 4)   # [gh, gw, 3, p, p]
    x = blocks.reshape(gh * gw, channels * p * p) @ weight.reshape(n_embd, -1).T
    return x + bias if bias is not None else x


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int) -> np.ndarray:
    """Non-causal multi-head attention: q, k, v [n_pos, n_head*d] -> [n_pos, n_head*d]."""
    n_pos, width = q.shape
    d = width // n_head
    out = np.empty_like(q)
    for h in range(n_head):
        cols = slice(h * d, (h + 1) * d)
        scores = q[:, cols] @ k[:, cols].T / np.sqrt(d)
        scores = scores - scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        out[:, cols] = weights @ v[:, cols]
    return out


def avg_pool(x: np.ndarray, side: int, k: int) -> np.ndarray:
    """x [side*side, n] in raster order -> k x k means, [(side/k)^2, n] in raster order."""
    n = x.shape[1]
    g = side // k
    return x.reshape(g, k, g, k, n).mean(axis=(1, 3)).reshape(g * g, n)


class ReferenceVision:
    """An mmproj file evaluated in numpy: `ReferenceVision(path).encode(pixels)`.

    `.cfg` (MmprojConfig), `.info` (MmprojTensors), `.tensors` (name -> float32
    values in numpy order), `.n_embd_text`.  `encode(pixels, layers=None)`
    returns [n_tokens, n_embd_text]; `tower(pixels)` the ViT output before the
    projector (class position included), for tests of the pieces."""

    def __init__(self, path: str | os.PathLike[str], dtype: type = np.float64):
        self.file = validate_gguf(path)
        self.cfg: MmprojConfig
        self.info: MmprojTensors
        self.cfg, self.info = load_mmproj(self.file)
        self.dtype = np.dtype(dtype)
        self.tensors = {name: dequantize_tensor(self.file, self.file.tensor(name)) for name in self.info.names}
        self.n_embd_text = self.info.n_embd_text

    def _t(self, name: str) -> np.ndarray | None:
        value = self.tensors.get(name)
        return None if value is None else value.astype(self.dtype)

    def tower(self, pixels: np.ndarray) -> np.ndarray:
        cfg, t = self.cfg, self._t
        s = cfg.image_size
        if pixels.shape != (3, s, s):
            raise ValueError(f"pixels have shape {pixels.shape}, expected (3, {s}, {s})")
        x = patch_embed(pixels.astype(self.dtype), t("v.patch_embd.weight"), t("v.patch_embd.bias"))
        if self.info.has_class_embd:
            x = np.concatenate([t("v.class_embd")[None, :], x], axis=0)
        x = x + t("v.position_embd.weight")
        if self.info.has_pre_ln:
            x = layer_norm(x, t("v.pre_ln.weight"), t("v.pre_ln.bias"), cfg.eps)
        act = ACTIVATIONS[cfg.ffn_act]
        for i in range(cfg.n_layer_run):
            b = f"v.blk.{i}."

            def linear(name: str, h: np.ndarray) -> np.ndarray:
                y = h @ t(name + ".weight").T
                bias = t(name + ".bias")
                return y + bias if bias is not None else y

            h = layer_norm(x, t(b + "ln1.weight"), t(b + "ln1.bias"), cfg.eps)
            o = attention(linear(b + "attn_q", h), linear(b + "attn_k", h), linear(b + "attn_v", h), cfg.n_head)
            x = x + linear(b + "attn_out", o)
            h = layer_norm(x, t(b + "ln2.weight"), t(b + "ln2.bias"), cfg.eps)
            up, down = self.info.ffn_names[i]
            x = x + linear(down, act(linear(up, h)))
        if self.info.has_post_ln:
            x = layer_norm(x, t("v.post_ln.weight"), t("v.post_ln.bias"), cfg.eps)
        return x

    def project(self, x: np.ndarray) -> np.ndarray:
        """The tower's output (class position included) -> the language model's embeddings."""
        cfg, t = self.cfg, self._t
        if cfg.projector == "mlp":
            if self.info.has_class_embd:
                x = x[1:]
            h = gelu_tanh(x @ t("mm.0.weight").T + t("mm.0.bias"))
            return h @ t("mm.2.weight").T + t("mm.2.bias")
        pooled = avg_pool(x, cfg.patches_per_side, cfg.n_merge)
        normed = rms_norm(pooled, cfg.eps) * t("mm.soft_emb_norm.weight")
        return normed @ t("mm.input_projection.weight")

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        out = self.project(self.tower(pixels))
        assert out.shape == (self.cfg.n_tokens, self.n_embd_text)
        return out

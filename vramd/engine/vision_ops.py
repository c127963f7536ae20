"""The vision encoder's compute ops (a ViT and its projector, as llama.cpp's
clip runs them): LayerNorm, the FFN activations (GELU in its three forms,
SiLU), non-causal attention, the patch-embedding convolution and the average
pool of the Gemma 3 projector, over the GLSL kernels native/shaders/
{layer_norm, gelu, attention_full, patch_embed, avg_pool}.comp.

`VisionOps` is an `Ops` (vramd/engine/ops.py) of the same residency core:
it records into the same batches, binds buffers by the same rules (a Tensor
or a `view`, any 4-byte aligned offset, at most one maxStorageBufferRange
per binding) and brings the text kernels along for the encoder's linear
layers and residuals:

    vops = VisionOps(residency)
    with vops.batch():
        vops.patch_embed(image, w_patch, b_patch, x, 3, 336, 336, 14)
        vops.add(x, pos_embd, x, n * hidden)                  # position embedding
        vops.layer_norm(x, ln1_w, ln1_b, h, eps, n, hidden)
        vops.matvec(w_q, h, q, n); vops.add(q, b_q, q, n * hidden, b_len=hidden)
        ...
        vops.attention_full(q, k, v, a, n, n_heads, head_dim, head_dim ** -0.5)
        ...
        vops.activation(f, f, n * n_ff, cfg.ffn_act)          # "gelu_quick" for CLIP
    vops.sync()

tests/engine/test_vision_kernels.py (encode_on_device) runs a synthetic
mmproj's whole encoder, both projectors, this way.  The class token of a
CLIP tower goes in row 0 (`copy`) and the patches from row 1 (patch_embed
into `view(x, 4 * hidden)`).  Gemma 3's mm.input_projection is multiplied
transposed by llama.cpp (y = x W, W numpy [n_embd, n_text]): matvec needs it
as [n_text, n_embd] rows, i.e. transposed once when it is placed.

Linear layers.  A ViT linear layer y = x W^T + b over n_tokens activation
rows is `matvec(Weight(w, type, rows, k), x, y, n_tokens)` (the tiled
matmul from 4 tokens up, any weight type the kit reads) followed by
`add(y, b, y, n_tokens * rows, b_len=rows)` (the bias broadcast over token
rows); tests/engine/test_vision_kernels.py checks it at 577 tokens with F32
and F16 weights.

All activations are f32, row-major [n_tokens, width] (row = token).
"""
from __future__ import annotations

import struct

from vramd.errors import ModelError, UsageError
from vramd.gpu.kernels import Kernel, grid
from vramd.engine.ops import BF16, F16, F32, Ops, Weight, type_name

# kernel -> (storage buffers, push-constant bytes); the shaders' layouts
_VISION_KERNELS = {"layer_norm": (4, 44), "gelu": (2, 16), "attention_full": (4, 48), "patch_embed": (4, 56),
                   "avg_pool": (2, 20)}

GELU_MODES = {"tanh": 0, "erf": 1, "quick": 2}   # gelu.comp's `mode` (3: silu)
# the tower's FFN activation by vramd.model.mmproj's name (MmprojConfig.ffn_act)
# -> gelu.comp's mode; llama.cpp's FFN_GELU, FFN_GELU_ERF, FFN_GELU_QUICK, FFN_SILU
ACTIVATIONS = {"gelu": 0, "gelu_erf": 1, "gelu_quick": 2, "silu": 3}
ATTENTION_MAX_HEAD_DIM = 128   # attention_full.comp: MAXD
_ATTENTION_QUERIES = 32        # queries per work group (BQ)
_PATCH_ROWS, _PATCH_TOKENS = 64, 32   # patch_embed.comp's tile (BR, BT)
# patch-embedding weight type -> (wtype in patch_embed.comp, bytes per element)
PATCH_WEIGHT_TYPES = {int(F32): (0, 4), int(F16): (1, 2), int(BF16): (2, 2)}


class VisionOps(Ops):
    """The encoder's kernels plus every op of `Ops`, on one residency core."""

    def _kernel(self, name: str, family: str | None = None) -> Kernel:
        spec = _VISION_KERNELS.get(family or name)
        if spec is None:
            return super()._kernel(name, family)
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = Kernel(self.residency, name, n_buffers=spec[0], push_bytes=spec[1])
        return k

    def layer_norm(self, x, w, b, y, eps: float, n_tokens: int, width: int, *, x_stride: int | None = None,
                   y_stride: int | None = None) -> None:
        """y[t] = (x[t] - mean(x[t])) / sqrt(var(x[t]) + eps) * w + b per token
        row, var the biased variance (ggml_norm, then the weight and bias as
        clip.cpp's build_norm applies them).

        x, y: f32 [n_tokens, stride] (strides default to width; y may be x);
        w, b: f32 [width], or None for a norm without weight (w = 1) or
        without bias (b = 0)."""
        if n_tokens < 1 or width < 1:
            raise UsageError(f"layer_norm: {n_tokens} tokens of width {width}")
        x_stride = width if x_stride is None else int(x_stride)
        y_stride = width if y_stride is None else int(y_stride)
        if x_stride < width or y_stride < width:
            raise UsageError(f"layer_norm: strides {x_stride}/{y_stride} below the width {width}")
        xv, xo = self._bind(x, 4 * ((n_tokens - 1) * x_stride + width), "layer_norm x")
        yv, yo = self._bind(y, 4 * ((n_tokens - 1) * y_stride + width), "layer_norm y")
        wv, wo = self._bind(w, 4 * width, "layer_norm weight") if w is not None else (xv, 0)  # unread
        bv, bo = self._bind(b, 4 * width, "layer_norm bias") if b is not None else (xv, 0)    # unread
        push = struct.pack("<2If8I", width, n_tokens, eps, xo, x_stride, wo, bo, yo, y_stride,
                           int(w is not None), int(b is not None))
        gx, gy = grid(n_tokens, self.max_groups)
        self._dispatch(self._kernel("layer_norm"), [xv, wv, bv, yv], push, (gx, gy, 1))

    def gelu(self, x, y, n: int, approximate: str = "tanh") -> None:
        """y[i] = gelu(x[i]), i < n (f32; y may be x).  approximate:
        "tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (ggml_gelu,
        clip's FFN_GELU); "erf": 0.5 x (1 + erf(x / sqrt 2)) (ggml_gelu_erf,
        FFN_GELU_ERF), erf to a fractional 1.2e-7 (see gelu.comp);
        "quick": x sigmoid(1.702 x) (ggml_gelu_quick, FFN_GELU_QUICK: what
        clip.cpp uses when the mmproj sets neither clip.use_gelu nor
        clip.use_silu, e.g. LLaVA's CLIP ViT-L)."""
        mode = GELU_MODES.get(approximate)
        if mode is None:
            raise UsageError(f"gelu: approximate={approximate!r}, expected one of {', '.join(GELU_MODES)}")
        self._activation(x, y, n, mode, "gelu")

    def silu(self, x, y, n: int) -> None:
        """y[i] = x[i] sigmoid(x[i]), i < n (f32; y may be x): ggml_silu,
        clip's FFN_SILU (Ops.silu_mul is the gated form)."""
        self._activation(x, y, n, ACTIVATIONS["silu"], "silu")

    def activation(self, x, y, n: int, name: str) -> None:
        """The tower's FFN activation by its mmproj name (MmprojConfig.ffn_act):
        "gelu" (tanh form), "gelu_erf", "gelu_quick" or "silu"; y may be x."""
        mode = ACTIVATIONS.get(name)
        if mode is None:
            raise UsageError(f"activation {name!r}: expected one of {', '.join(ACTIVATIONS)}")
        self._activation(x, y, n, mode, name)

    def _activation(self, x, y, n: int, mode: int, what: str) -> None:
        if n < 1:
            raise UsageError(f"{what}: n {n}")
        xv, xo = self._bind(x, 4 * n, f"{what} x")
        yv, yo = self._bind(y, 4 * n, f"{what} y")
        self._dispatch(self._kernel("gelu"), [xv, yv], struct.pack("<4I", n, xo, yo, mode),
                       self._groups1d(n, self.max_groups))

    def attention_full(self, q, k, v, out, n_tokens: int, n_heads: int, head_dim: int, scale: float, *,
                       q_stride: int | None = None, k_stride: int | None = None, v_stride: int | None = None,
                       o_stride: int | None = None) -> None:
        """out[t, h*hd:(h+1)*hd] = sum_j softmax_j(scale * q[t, h] . k[j, h]) v[j, h]
        over every token j < n_tokens (no mask, no cache: the encoder's
        self-attention), online softmax in f32.

        q, k, v: f32 [n_tokens, n_heads * head_dim], token rows *_stride
        floats apart (default n_heads * head_dim; views into one fused
        [n_tokens, 3 * hidden] QKV buffer with stride 3 * hidden work);
        out: f32 [n_tokens, o_stride] (default n_heads * head_dim), must not
        alias q, k or v.  head_dim <= 128 (any size, odd included)."""
        if n_tokens < 1 or n_heads < 1 or head_dim < 1:
            raise UsageError(f"attention_full: {n_tokens} tokens, {n_heads} heads of {head_dim}")
        if head_dim > ATTENTION_MAX_HEAD_DIM:
            raise ModelError(f"head_dim {head_dim}: the encoder attention kernel takes up to "
                             f"{ATTENTION_MAX_HEAD_DIM}")
        width = n_heads * head_dim
        strides = [width if s is None else int(s) for s in (q_stride, k_stride, v_stride, o_stride)]
        if min(strides) < width:
            raise UsageError(f"attention_full: strides {strides} below the row width {width}")
        q_tiles = -(-n_tokens // _ATTENTION_QUERIES)
        if n_heads > self.max_groups[0] or q_tiles > self.max_groups[1]:
            raise UsageError(f"attention_full: {n_heads} heads x {n_tokens} tokens exceed the device's grid")
        views = []
        for buf, stride, what in zip((q, k, v, out), strides, ("q", "k", "v", "out")):
            views.append(self._bind(buf, 4 * ((n_tokens - 1) * stride + width), f"attention_full {what}"))
        (qv, qo), (kv, ko), (vv, vo), (ov, oo) = views
        qs, ks, vs, os_ = strides
        push = struct.pack("<11If", n_tokens, n_heads, head_dim, qo, qs, ko, ks, vo, vs, oo, os_, scale)
        self._dispatch(self._kernel("attention_full"), [qv, kv, vv, ov], push, (n_heads, q_tiles, 1))

    def patch_embed(self, image, w: Weight, b, out, channels: int, height: int, width: int, patch: int, *,
                    o_stride: int | None = None) -> None:
        """out[p, o] = b[o] + sum_{c,ky,kx} W[o, c, ky, kx] * image[c, py*patch + ky, px*patch + kx]
        for each patch p = py * (width / patch) + px (raster order): the
        strided convolution of the ViT's patch embedding (ggml_conv_2d with
        stride = kernel = patch, no padding, no kernel flip).

        image: f32 [channels, height, width], planar (clip.cpp's inp_raw:
        channel planes of rows), height and width multiples of patch.
        w: `Weight(v.patch_embd.weight, type, hidden, patch * patch *
        channels)`, i.e. the GGUF tensor of ggml shape [patch, patch,
        channels, hidden] (numpy [hidden, channels, patch, patch], the
        torch Conv2d layout): row o holds kernel o in (c, ky, kx) order, kx
        fastest; F32, F16 or BF16.  b: f32 [hidden] or None.  out: f32
        [n_patches, o_stride] (default hidden), row = patch; must not alias
        the image."""
        if min(channels, height, width, patch) < 1:
            raise UsageError(f"patch_embed: image {channels}x{height}x{width}, patch {patch}")
        if height % patch or width % patch:
            raise UsageError(f"patch_embed: a {height}x{width} image is not a whole number of {patch}-pixel "
                             "patches (resize it to the model's image size first)")
        wt = PATCH_WEIGHT_TYPES.get(w.qtype)
        if wt is None:
            raise ModelError(f"patch embedding weight of type {type_name(w.qtype)}: the kernel reads "
                             + ", ".join(type_name(t) for t in PATCH_WEIGHT_TYPES))
        kdim = channels * patch * patch
        if w.cols != kdim:
            raise ModelError(f"patch embedding weight {w}: rows of {w.cols} elements, the image's "
                             f"{channels} channels x {patch}x{patch} patches need {kdim}")
        hidden = w.rows
        n_patches = (height // patch) * (width // patch)
        o_stride = hidden if o_stride is None else int(o_stride)
        if o_stride < hidden:
            raise UsageError(f"patch_embed: o_stride {o_stride} below hidden {hidden}")
        wtype, esize = wt
        wv, wo = self._bind(w.tensor, hidden * w.row_bytes, "patch_embed weight", elem=esize)
        iv, io = self._bind(image, 4 * channels * height * width, "patch_embed image")
        ov, oo = self._bind(out, 4 * ((n_patches - 1) * o_stride + hidden), "patch_embed out")
        bv, bo = self._bind(b, 4 * hidden, "patch_embed bias") if b is not None else (iv, 0)  # unread
        gx, gy = -(-hidden // _PATCH_ROWS), -(-n_patches // _PATCH_TOKENS)
        if gx > self.max_groups[0] or gy > self.max_groups[1]:
            raise UsageError(f"patch_embed: {hidden} channels x {n_patches} patches exceed the device's grid")
        push = struct.pack("<14I", hidden, kdim, n_patches, channels, height, width, patch, wo, wtype, io, bo,
                           int(b is not None), oo, o_stride)
        self._dispatch(self._kernel("patch_embed"), [wv, iv, bv, ov], push, (gx, gy, 1),
                       label=f"patch_embed {hidden}x{kdim}", nbytes=hidden * w.row_bytes)

    def avg_pool_2d(self, x, out, side: int, pool: int, hidden: int) -> None:
        """Average pooling of a side x side token grid, pool x pool tokens
        at a time with stride pool (the Gemma 3 projector: 64x64 -> 16x16
        with pool 4):
            out[oy * (side/pool) + ox, c] =
                mean_{dy,dx < pool} x[(oy*pool + dy) * side + ox*pool + dx, c]
        x: f32 [side * side, hidden], tokens in raster order (row-major
        grid, as patch_embed makes them); out: f32 [(side/pool)^2, hidden],
        must not alias x.  side must be a multiple of pool."""
        if min(side, pool, hidden) < 1 or side % pool:
            raise UsageError(f"avg_pool_2d: a {side}x{side} grid does not split into {pool}x{pool} pools")
        n_out = (side // pool) ** 2 * hidden
        xv, xo = self._bind(x, 4 * side * side * hidden, "avg_pool_2d x")
        ov, oo = self._bind(out, 4 * n_out, "avg_pool_2d out")
        self._dispatch(self._kernel("avg_pool"), [xv, ov], struct.pack("<5I", side, pool, hidden, xo, oo),
                       self._groups1d(n_out, self.max_groups))

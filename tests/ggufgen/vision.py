"""Synthetic mmproj (vision projector) GGUF files for the tests.

Owns: `write_mmproj` (and `MmprojSpec`, `make_mmproj_weights`,
`mmproj_metadata`, `write_mmproj_weights`), which writes a small,
deterministic projector file in llama.cpp's clip format
(general.architecture "clip"), with either projector vramd supports:

  "mlp"     a CLIP-style tower: class embedding, pre-layer norm, no patch
            bias, no post-layer norm (LLaVA conversions), quick-GELU FFN
            (clip.use_gelu false), projector mm.0 -> GELU -> mm.2
  "gemma3"  a SigLIP-style tower: patch bias, no class embedding, no
            pre-norm, post-layer norm, tanh-GELU FFN (clip.use_gelu true),
            k x k average pooling, RMS norm x mm.soft_emb_norm,
            mm.input_projection

Each default can be changed (class_embd, pre_ln, post_ln, patch_bias,
layer_bias, use_gelu, feature_layer, n_merge ...), so a test can write the
variants llama.cpp accepts.  Sizes default to tiny: a 32x32 image in 8x8
patches (a 4x4 grid: 16 patches), hidden size 64 in 4 heads, 2 layers, FFN
128, text width 96.  gemma3 writes clip.vision.projector.scale_factor 2 by
default (4 tokens; n_merge=None writes no key: llama.cpp's default 4, one
token).  A file is ~0.2 MB in F16 and takes a few milliseconds to write.

Weights (numpy default_rng streams seeded by (seed, crc32(name)), as
tests/ggufgen/common.py, so one option leaves every other tensor alone):
    v.patch_embd.weight    N(0, 1/(3 p^2))       a patch's embedding has std ~1
    v.patch_embd.bias, v.class_embd   N(0, 0.1^2), N(0, 1)
    v.position_embd.weight N(0, 0.5^2)
    ln1, ln2, pre_ln, post_ln   weight 1 + N(0, 0.1^2), bias N(0, 0.1^2)
    attn_q, attn_k         N(0, (1.5/sqrt(n_embd))^2): q.k/sqrt(d) has std ~1.5^2,
                           attention is selective without being one-hot
    attn_v, attn_out       N(0, 1/n_embd);  ffn_up N(0, 1/n_embd), ffn_down N(0, 1/n_ff)
    layer biases           N(0, 0.1^2)
    mm.0 N(0, 1/n_embd), mm.2 N(0, 1/n_text), biases N(0, 0.1^2)
    mm.input_projection    N(0, 1/n_embd) (numpy shape [n_embd, n_text]: y = x W)
    mm.soft_emb_norm       1 + N(0, 0.1^2), stored as the graph multiplies it (the
                           converter has already added Gemma's +1)
Matrices and the patch kernel take `weight_type` (F32 or F16); vectors and the
position embedding are F32.  Nothing binary is committed: tests write what
they need.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# LLaVA-1.5's CLIP normalization and SigLIP's.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)

_DEFAULT = object()


@dataclass(frozen=True)
class MmprojSpec:
    projector: str = "mlp"
    image_size: int = 32
    patch_size: int = 8
    n_embd: int = 64
    n_head: int = 4
    n_layer: int = 2
    n_ff: int = 128
    n_embd_text: int = 96
    weight_type: str = "F16"            # "F32" | "F16"
    eps: float | None = None            # None: 1e-5 (CLIP) / 1e-6 (SigLIP)
    class_embd: bool | None = None      # None: the projector's style (see the module docstring)
    pre_ln: bool | None = None
    post_ln: bool | None = None
    patch_bias: bool | None = None
    layer_bias: bool = True
    use_gelu: bool | None = None
    feature_layer: int | None = None    # mlp: write clip.vision.feature_layer [L]
    n_merge: int | None | object = _DEFAULT   # gemma3: scale_factor to write; None writes none
    swap_ffn_names: bool = False        # write fc1 as "ffn_down", fc2 as "ffn_up" (legacy files)
    seed: int = 0

    def resolve(self) -> "MmprojSpec":
        mlp = self.projector == "mlp"
        pick = lambda v, a, b: (a if mlp else b) if v is None else v  # noqa: E731
        return replace(self, eps=pick(self.eps, 1e-5, 1e-6),
                       class_embd=pick(self.class_embd, True, False), pre_ln=pick(self.pre_ln, True, False),
                       post_ln=pick(self.post_ln, False, True), patch_bias=pick(self.patch_bias, False, True),
                       use_gelu=pick(self.use_gelu, False, True),
                       n_merge=(2 if self.n_merge is _DEFAULT else self.n_merge) if not mlp else None)

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def make_mmproj_weights(spec: MmprojSpec) -> dict[str, np.ndarray]:
    """Every tensor as float32 in numpy order (ggml shape reversed), in file order."""
    s = spec.resolve()
    e, f, t, p = s.n_embd, s.n_ff, s.n_embd_text, s.patch_size

    def normal(name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
        return (_rng(s.seed, name).standard_normal(shape) * std).astype(np.float32)

    def gain(name: str, n: int) -> np.ndarray:
        return (1.0 + 0.1 * _rng(s.seed, name).standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {}
    w["v.patch_embd.weight"] = normal("v.patch_embd.weight", (e, 3, p, p), 1 / np.sqrt(3 * p * p))
    if s.patch_bias:
        w["v.patch_embd.bias"] = normal("v.patch_embd.bias", (e,), 0.1)
    if s.class_embd:
        w["v.class_embd"] = normal("v.class_embd", (e,), 1.0)
    w["v.position_embd.weight"] = normal("v.position_embd.weight",
                                         (s.n_patches + (1 if s.class_embd else 0), e), 0.5)
    if s.pre_ln:
        w["v.pre_ln.weight"] = gain("v.pre_ln.weight", e)
        w["v.pre_ln.bias"] = normal("v.pre_ln.bias", (e,), 0.1)
    qk = 1.5 / np.sqrt(e)
    for i in range(s.n_layer):
        b = f"v.blk.{i}."
        w[b + "ln1.weight"] = gain(b + "ln1.weight", e)
        w[b + "ln1.bias"] = normal(b + "ln1.bias", (e,), 0.1)
        for m, std in (("attn_q", qk), ("attn_k", qk), ("attn_v", 1 / np.sqrt(e)), ("attn_out", 1 / np.sqrt(e))):
            w[b + m + ".weight"] = normal(b + m + ".weight", (e, e), std)
            if s.layer_bias:
                w[b + m + ".bias"] = normal(b + m + ".bias", (e,), 0.1)
        w[b + "ln2.weight"] = gain(b + "ln2.weight", e)
        w[b + "ln2.bias"] = normal(b + "ln2.bias", (e,), 0.1)
        up, down = ("ffn_down", "ffn_up") if s.swap_ffn_names else ("ffn_up", "ffn_down")
        # Streams are named after the role (fc1/fc2), so swapping names keeps the values.
        w[b + up + ".weight"] = normal(b + "fc1.weight", (f, e), 1 / np.sqrt(e))
        if s.layer_bias:
            w[b + up + ".bias"] = normal(b + "fc1.bias", (f,), 0.1)
        w[b + down + ".weight"] = normal(b + "fc2.weight", (e, f), 1 / np.sqrt(f))
        if s.layer_bias:
            w[b + down + ".bias"] = normal(b + "fc2.bias", (e,), 0.1)
    if s.post_ln:
        w["v.post_ln.weight"] = gain("v.post_ln.weight", e)
        w["v.post_ln.bias"] = normal("v.post_ln.bias", (e,), 0.1)
    if s.projector == "mlp":
        w["mm.0.weight"] = normal("mm.0.weight", (t, e), 1 / np.sqrt(e))
        w["mm.0.bias"] = normal("mm.0.bias", (t,), 0.1)
        w["mm.2.weight"] = normal("mm.2.weight", (t, t), 1 / np.sqrt(t))
        w["mm.2.bias"] = normal("mm.2.bias", (t,), 0.1)
    elif s.projector == "gemma3":
        w["mm.input_projection.weight"] = normal("mm.input_projection.weight", (e, t), 1 / np.sqrt(e))
        w["mm.soft_emb_norm.weight"] = gain("mm.soft_emb_norm.weight", e)
    else:
        # Other projector types are written with the mlp tensors: tests of the
        # refusal only need the metadata to name them.
        return make_mmproj_weights(replace(spec, projector="mlp"))
    return w


def mmproj_metadata(spec: MmprojSpec) -> dict[str, tuple[str, Any]]:
    """The clip.* keys as {key: (kind, value)}, kind one of u32, f32, bool, str,
    f32s, i32s.  Tests edit this dict to write malformed files."""
    s = spec.resolve()
    mlp = s.projector == "mlp"
    v = "clip.vision."
    md: dict[str, tuple[str, Any]] = {
        "clip.projector_type": ("str", s.projector),
        "clip.has_vision_encoder": ("bool", True),
        "clip.use_gelu": ("bool", bool(s.use_gelu)),
        v + "image_size": ("u32", s.image_size),
        v + "patch_size": ("u32", s.patch_size),
        v + "embedding_length": ("u32", s.n_embd),
        v + "feed_forward_length": ("u32", s.n_ff),
        v + "block_count": ("u32", s.n_layer),
        v + "projection_dim": ("u32", s.n_embd_text),
        v + "attention.head_count": ("u32", s.n_head),
        v + "attention.layer_norm_epsilon": ("f32", s.eps),
        v + "image_mean": ("f32s", list(CLIP_MEAN if mlp else SIGLIP_MEAN)),
        v + "image_std": ("f32s", list(CLIP_STD if mlp else SIGLIP_STD)),
    }
    if s.feature_layer is not None:
        md[v + "feature_layer"] = ("i32s", [s.feature_layer])
    if s.n_merge is not None:
        md[v + "projector.scale_factor"] = ("u32", s.n_merge)
    return md


def write_mmproj_weights(path: str | Path, spec: MmprojSpec, weights: dict[str, np.ndarray],
                         metadata: dict[str, tuple[str, Any]] | None = None,
                         architecture: str = "clip") -> Path:
    """Write `weights` (numpy order, float32) with `metadata` (default: mmproj_metadata(spec))."""
    s = spec.resolve()
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"synthetic-mmproj-{s.projector}-{s.seed}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if s.weight_type == "F16" else gguf.LlamaFileType.ALL_F32)
    adders = {"u32": writer.add_uint32, "f32": writer.add_float32, "bool": writer.add_bool,
              "str": writer.add_string,
              "f32s": lambda k, vals: writer.add_key_value(k, vals, gguf.GGUFValueType.ARRAY,
                                                            sub_type=gguf.GGUFValueType.FLOAT32),
              "i32s": lambda k, vals: writer.add_key_value(k, vals, gguf.GGUFValueType.ARRAY,
                                                            sub_type=gguf.GGUFValueType.INT32)}
    for key, (kind, value) in (mmproj_metadata(spec) if metadata is None else metadata).items():
        adders[kind](key, value)
    for name, value in weights.items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        matrix = value.ndim >= 2 and name != "v.position_embd.weight"
        if matrix and s.weight_type == "F16":
            writer.add_tensor(name, value.astype(np.float16))
        elif matrix and s.weight_type != "F32":
            raise ValueError(f"weight_type {s.weight_type!r}: expected F32 or F16")
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_mmproj(path: str | Path, projector: str = "mlp", **more) -> Path:
    """Write a synthetic projector file to `path`; `more` takes MmprojSpec's fields.
    Same arguments, same bytes."""
    spec = MmprojSpec(projector=projector, **more)
    return write_mmproj_weights(path, spec, make_mmproj_weights(spec))

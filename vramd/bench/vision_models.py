"""Synthetic LLaVA-style vision projectors (mmproj GGUF) for benchmarks.

Owns: `VisionShape` (a CLIP tower with LLaVA's MLP projector: its
hyper-parameters, `preset` names ViT-L/14 at 336 px and a tiny one) and
`write_llava_mmproj`, which writes a file in llama.cpp's clip format that
vramd/model/mmproj.py loads: class embedding, pre-layer norm, quick-GELU FFN,
no post-layer norm, projector mm.0 -> GELU -> mm.2 (what LLaVA-1.5's
conversion writes).  The data is streamed tensor by tensor into a sparse
file (as vramd/bench/models.py does for the llama writer), so a 0.6 GB
encoder is written in seconds without holding it in memory.

Tests have their own writer (tests/ggufgen/vision.py): it builds every
variant llama.cpp accepts and returns the float32 weights the numpy
reference needs; this one writes one variant, big, fast.
tests/engine/test_bench_encode.py checks both write the same layout.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vramd.bench.models import extend_to_data

# LLaVA-1.5's CLIP image normalization (what its mmproj files carry).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionShape:
    image_size: int = 336
    patch_size: int = 14
    n_embd: int = 1024
    n_head: int = 16
    n_layer: int = 24           # the file's block_count; LLaVA runs n_layer - 1 (its feature layer is -2)
    n_ff: int = 4096
    n_embd_text: int = 4096     # the language model's width (LLaVA-1.5-7B's)
    weight_type: str = "F16"    # "F16" | "F32": matrices and the patch kernel

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @staticmethod
    def preset(name: str, n_embd_text: int) -> "VisionShape":
        """vit-l: CLIP ViT-L/14 at 336 px, as in LLaVA-1.5 (~0.6 GB in F16);
        small: a tiny tower that encodes in well under a second on lavapipe."""
        if name == "vit-l":
            return VisionShape(n_embd_text=n_embd_text)
        if name == "small":
            return VisionShape(image_size=64, patch_size=16, n_embd=64, n_head=4, n_layer=3, n_ff=256,
                               n_embd_text=n_embd_text)
        raise ValueError(f"unknown vision shape {name!r} (vit-l, small)")

    def tensors(self) -> list[tuple[str, tuple[int, ...], str, float]]:
        """(name, numpy shape, "matrix" | "gain" | "bias" | "embedding", std) of
        every tensor, in file order.  Matrices have std 1/sqrt(fan-in), so
        activations keep their scale through the layers; gains are 1 + noise."""
        e, f, t, p = self.n_embd, self.n_ff, self.n_embd_text, self.patch_size
        out = [("v.patch_embd.weight", (e, 3, p, p), "matrix", 1 / np.sqrt(3 * p * p)),
               ("v.class_embd", (e,), "embedding", 1.0),
               ("v.position_embd.weight", (self.n_patches + 1, e), "embedding", 0.5),
               ("v.pre_ln.weight", (e,), "gain", 0.1), ("v.pre_ln.bias", (e,), "bias", 0.1)]
        for i in range(self.n_layer):
            b = f"v.blk.{i}."
            out += [(b + "ln1.weight", (e,), "gain", 0.1), (b + "ln1.bias", (e,), "bias", 0.1)]
            for m in ("attn_q", "attn_k", "attn_v", "attn_out"):
                out += [(b + m + ".weight", (e, e), "matrix", 1 / np.sqrt(e)), (b + m + ".bias", (e,), "bias", 0.1)]
            out += [(b + "ln2.weight", (e,), "gain", 0.1), (b + "ln2.bias", (e,), "bias", 0.1),
                    (b + "ffn_up.weight", (f, e), "matrix", 1 / np.sqrt(e)), (b + "ffn_up.bias", (f,), "bias", 0.1),
                    (b + "ffn_down.weight", (e, f), "matrix", 1 / np.sqrt(f)),
                    (b + "ffn_down.bias", (e,), "bias", 0.1)]
        return out + [("mm.0.weight", (t, e), "matrix", 1 / np.sqrt(e)), ("mm.0.bias", (t,), "bias", 0.1),
                      ("mm.2.weight", (t, t), "matrix", 1 / np.sqrt(t)), ("mm.2.bias", (t,), "bias", 0.1)]

    def dtype(self, kind: str, name: str) -> np.dtype:
        """Matrices in the weight type; vectors and the position embedding F32 (as converters write them)."""
        if kind == "matrix":
            if self.weight_type not in ("F16", "F32"):
                raise ValueError(f"weight_type {self.weight_type!r}: expected F16 or F32")
            return np.dtype(np.float16 if self.weight_type == "F16" else np.float32)
        return np.dtype(np.float32)

    def file_bytes(self) -> int:
        """Bytes of tensor data in the file (every layer, the one LLaVA skips included)."""
        return sum(int(np.prod(shape)) * self.dtype(kind, name).itemsize for name, shape, kind, _ in self.tensors())


def clip_metadata(shape: VisionShape) -> dict[str, tuple[str, object]]:
    """The clip.* keys as {key: (kind, value)}: what vramd/model/mmproj.py reads."""
    v = "clip.vision."
    return {
        "clip.projector_type": ("str", "mlp"),
        "clip.has_vision_encoder": ("bool", True),
        "clip.use_gelu": ("bool", False),            # quick-GELU, as CLIP
        v + "image_size": ("u32", shape.image_size),
        v + "patch_size": ("u32", shape.patch_size),
        v + "embedding_length": ("u32", shape.n_embd),
        v + "feed_forward_length": ("u32", shape.n_ff),
        v + "block_count": ("u32", shape.n_layer),
        v + "projection_dim": ("u32", shape.n_embd_text),
        v + "attention.head_count": ("u32", shape.n_head),
        v + "attention.layer_norm_epsilon": ("f32", 1e-5),
        v + "image_mean": ("f32s", list(CLIP_MEAN)),
        v + "image_std": ("f32s", list(CLIP_STD)),
    }


def _add_metadata(writer, metadata: dict[str, tuple[str, object]]) -> None:
    import gguf
    arrays = {"f32s": gguf.GGUFValueType.FLOAT32}
    adders = {"u32": writer.add_uint32, "f32": writer.add_float32, "bool": writer.add_bool, "str": writer.add_string}
    for key, (kind, value) in metadata.items():
        if kind in arrays:
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=arrays[kind])
        else:
            adders[kind](key, value)


def _values(seed: int, name: str, shape: tuple[int, ...], kind: str, std: float) -> np.ndarray:
    """One tensor's seeded values (a stream per name, so shapes can change without
    changing the other tensors): gains around 1, everything else around 0."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return x + np.float32(1.0) if kind == "gain" else x


def write_llava_mmproj(path: str | os.PathLike, shape: VisionShape, *, fill: str = "random", seed: int = 0) -> Path:
    """Write a LLaVA-style projector of `shape` to `path`.  `fill` "random":
    seeded values that keep every activation finite and of unit scale;
    "zeros": a hole in a sparse file (nothing written; an encode of zeros
    is finite too: layer norms of zero rows are zero)."""
    import gguf
    if fill not in ("random", "zeros"):
        raise ValueError(f"fill {fill!r}: random or zeros")
    path = Path(path)
    specs = shape.tensors()
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_name(f"synthetic-llava-mmproj-{shape.n_layer}x{shape.n_embd}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if shape.weight_type == "F16" else gguf.LlamaFileType.ALL_F32)
    _add_metadata(writer, clip_metadata(shape))
    sizes = []
    for name, dims, kind, _std in specs:
        dt = shape.dtype(kind, name)
        nbytes = int(np.prod(dims)) * dt.itemsize
        writer.add_tensor_info(name, dims, dt, nbytes)
        sizes.append(nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    offsets = extend_to_data(path, sizes)
    if fill == "random":
        with open(path, "r+b") as f:
            for (name, dims, kind, std), off in zip(specs, offsets):
                f.seek(off)
                f.write(_values(seed, name, dims, kind, std).astype(shape.dtype(kind, name)).tobytes())
    return path

"""The vision projector file (`--mmproj`): its hyper-parameters and tensors, checked.

Owns: `MmprojConfig.from_model(mf)`, which reads and checks the vision
tower's metadata from a GGUF file that `gguf_check.validate_gguf` has
already validated (the mmproj file is as untrusted as the model file and
passes the same bounded parser), and `check_tensors(mf, cfg)`, which checks
that every tensor the encoder reads exists with the shape the metadata
implies and returns an `MmprojTensors` describing what is there.  Every
refusal is a one-line `vramd.errors.ModelError`: `<path>: <problem>`.

Does not own: reading tensor data (vramd.model.loader, into an `encoder`
region: kept in host memory, restored just in time for an image),
the encoder's kernels (vramd.engine.vision_ops), image decoding
(vramd.model.image).

The format is llama.cpp's clip loader's (tools/mtmd/clip.cpp, clip-impl.h);
two projectors are supported, each with the vision tower llama.cpp builds
for it:

  "mlp"     LLaVA-1.5 style: a CLIP ViT (class embedding, pre-layer-norm),
            then mm.0 -> GELU -> mm.2.  llama.cpp's clip_graph_llava.
  "gemma3"  Gemma 3: a SigLIP ViT (no class embedding, no pre-norm,
            post-layer-norm), then a k x k average pooling of the patch
            grid (k = n_merge, 4 unless clip.vision.projector.scale_factor
            says otherwise), RMS norm times mm.soft_emb_norm, times
            mm.input_projection.  llama.cpp's clip_graph_siglip.
Anything else ("ldp", "resampler", "qwen2vl_merger", ...) is refused by name.

Metadata keys (all under clip.vision. unless written in full)
-------------------------------------------------------------
  general.architecture             must be "clip"
  clip.has_vision_encoder          must be true
  clip.projector_type              "mlp" | "gemma3" (clip.vision.projector_type as fallback,
                                   as llama.cpp reads mixed-modality files)
  image_size, patch_size           pixels; image_size a multiple of patch_size
  embedding_length                 n_embd (hidden size of the tower)
  attention.head_count             n_head, dividing n_embd
  block_count                      n_layer (layers in the file)
  feed_forward_length              n_ff
  attention.layer_norm_epsilon     eps of every norm of the tower and of gemma3's soft_emb_norm
  projection_dim                   read and checked positive, not used for shapes: legacy LLaVA
                                   conversions wrote CLIP's contrastive projection size (768)
                                   here, newer ones the text model's n_embd; the projector's
                                   output width is taken from its tensors (MmprojTensors.n_embd_text)
  image_mean, image_std            3 floats each (RGB); std > 0
  clip.use_gelu / clip.use_silu    the tower's FFN activation, as llama.cpp decides it:
                                   use_gelu -> "gelu" (tanh approximation, ggml_gelu),
                                   use_silu -> "silu", neither -> "gelu_quick"
                                   (x * sigmoid(1.702 x), CLIP's quick_gelu); both -> refused
  feature_layer                    mlp only, optional: llama.cpp runs layers [0, L) and
                                   projects their output; a single value L is honoured, several
                                   (granite's stacked features) are refused; absent, L is
                                   n_layer - 1 (LLaVA uses the second-to-last layer's output,
                                   llama.cpp's default for this projector).  gemma3 runs every
                                   layer and ignores the key, as llama.cpp does.
  projector.scale_factor           gemma3 only, optional: the pooling kernel (default 4)

Tensors (ggml order, ne[0] first; n_pos = n_patches (+1 with a class embedding))
-----------------------------------------------------------------------------
  v.patch_embd.weight   [p, p, 3, n_embd]   the patch convolution (stride p)    required
  v.patch_embd.bias     [n_embd]                                               optional
  v.class_embd          [n_embd]            mlp only (ignored by gemma3)        optional
  v.position_embd.weight [n_embd, n_pos]    exactly n_pos rows (no interpolation) required
  v.pre_ln.weight/.bias [n_embd]                                               optional
  v.blk.{i}.ln1/ln2.weight/.bias [n_embd]                                      weight required
  v.blk.{i}.attn_q/attn_k/attn_v/attn_out.weight [n_embd, n_embd], .bias [n_embd]
  v.blk.{i}.ffn_up.weight [n_embd, n_ff], .bias [n_ff]
  v.blk.{i}.ffn_down.weight [n_ff, n_embd], .bias [n_embd]
  v.post_ln.weight/.bias [n_embd]                                              optional
  mlp:    mm.0.weight [n_embd, n_text], mm.0.bias [n_text],
          mm.2.weight [n_text, n_text], mm.2.bias [n_text]                       required
  gemma3: mm.input_projection.weight [n_text, n_embd] (used transposed: y = x W, numpy
          shape [n_embd, n_text]), mm.soft_emb_norm.weight [n_embd]              required
Layer tensors are checked for layers [0, n_layer_run) only: the others may be
absent (a converter that drops LLaVA's unused last layer) and are never read.
Biases of the layers are optional, as llama.cpp loads them (required=false);
when present their shape is checked.  Weights are required.

Legacy ffn naming: some old conversions named CLIP's fc1 "ffn_down" and fc2
"ffn_up".  llama.cpp swaps them back for these projectors when
ffn_down.weight's ne[0] equals n_embd; so does check_tensors (reported as
MmprojTensors.ffn_swapped, the names to read per layer in `ffn_names`).
Like llama.cpp's, the rule cannot tell when n_ff == n_embd, and then swaps.

Uncertainties (stated, not guessed around)
------------------------------------------
* The llama.cpp version read (tools/mtmd/models/llava.cpp, 2026) concatenates
  the class embedding *after* the patches and then projects rows 1..n_patches,
  which drops patch 0 and keeps the class token: it looks like a regression.
  vramd follows CLIP (and llama.cpp's earlier clip.cpp): class token first,
  at position 0, patches at positions 1..n_patches, class token dropped
  before the projector.  tests/engine/reference/vision.py does the same.
* Image preprocessing: see vramd/model/image.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vramd.errors import ModelError
from vramd.model.gguf_check import ModelFile

SUPPORTED_PROJECTORS = ("mlp", "gemma3")
FFN_ACTIVATIONS = ("gelu", "gelu_quick", "silu")
GEMMA3_DEFAULT_MERGE = 4

# Bounds: far above real encoders (SigLIP-so400m: 896 px / 14, 1152 wide, 27 layers,
# 4304 FFN; CLIP-L/336: 1024 wide, 24 layers) and far below what would make a
# buffer size overflow or a loop run for ever.
MAX_IMAGE_SIZE = 4096
MAX_PATCHES = 1 << 16
MAX_EMBD = 1 << 15
MAX_HEADS = 1 << 10
MAX_LAYERS = 1 << 8
MAX_FF = 1 << 17

_P = "clip.vision."


@dataclass(frozen=True)
class MmprojConfig:
    """The vision tower's hyper-parameters, checked.  Derived values are properties."""

    path: str
    projector: str                      # "mlp" | "gemma3"
    image_size: int
    patch_size: int
    n_embd: int
    n_head: int
    n_layer: int                        # block_count: layers in the file
    n_layer_run: int                    # layers the encoder runs (see feature_layer)
    n_ff: int
    eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    projection_dim: int
    ffn_act: str                        # "gelu" (tanh approx.) | "gelu_quick" | "silu"
    n_merge: int                        # gemma3's pooling kernel; 1 for mlp

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def n_tokens(self) -> int:
        """Embeddings one image becomes: the language model's image token count."""
        return (self.patches_per_side // self.n_merge) ** 2

    @property
    def resample(self) -> str:
        """The resize filter llama.cpp uses for this projector (vramd.model.image)."""
        return "bicubic" if self.projector == "mlp" else "bilinear"

    @property
    def pad_color(self) -> tuple[int, int, int]:
        """Colour of the padding that keeps the aspect ratio (vramd.model.image):
        LLaVA's mean colour, black for gemma3 (llama.cpp's default)."""
        return (122, 116, 104) if self.projector == "mlp" else (0, 0, 0)

    @classmethod
    def from_model(cls, mf: ModelFile) -> "MmprojConfig":
        md, path = mf.metadata, mf.path

        def fail(problem: str) -> ModelError:
            return ModelError(f"{path}: {problem}")

        if mf.architecture != "clip":
            raise fail(f"general.architecture is {mf.architecture!r}, expected 'clip' "
                       f"(is this the language model rather than its projector file?)")
        if md.get("clip.has_vision_encoder") is not True:
            raise fail("clip.has_vision_encoder is missing or false: not a vision projector")
        projector = _get(md, path, "clip.projector_type", str, required=False)
        if projector is None:
            projector = _get(md, path, _P + "projector_type", str, required=False)
        if projector is None:
            raise fail("missing clip.projector_type")
        if projector not in SUPPORTED_PROJECTORS:
            raise fail(f"unsupported projector type {projector!r} "
                       f"(supported: {', '.join(SUPPORTED_PROJECTORS)})")

        def u32(suffix: str, limit: int) -> int:
            key = _P + suffix
            value = _get(md, path, key, int)
            if not 1 <= value <= limit:
                raise fail(f"{key} is {value}, expected 1..{limit}")
            return value

        image_size = u32("image_size", MAX_IMAGE_SIZE)
        patch_size = u32("patch_size", MAX_IMAGE_SIZE)
        n_embd = u32("embedding_length", MAX_EMBD)
        n_head = u32("attention.head_count", MAX_HEADS)
        n_layer = u32("block_count", MAX_LAYERS)
        n_ff = u32("feed_forward_length", MAX_FF)
        projection_dim = u32("projection_dim", MAX_EMBD)
        eps = _get(md, path, _P + "attention.layer_norm_epsilon", float)
        if not (math.isfinite(eps) and 0.0 < eps < 1.0):
            raise fail(f"{_P}attention.layer_norm_epsilon is {eps!r}, expected a number in (0, 1)")
        if image_size % patch_size:
            raise fail(f"{_P}image_size {image_size} is not a multiple of patch_size {patch_size}")
        if (image_size // patch_size) ** 2 > MAX_PATCHES:
            raise fail(f"{(image_size // patch_size) ** 2} patches per image exceed the limit {MAX_PATCHES}")
        if n_embd % n_head:
            raise fail(f"{_P}embedding_length {n_embd} is not a multiple of "
                       f"attention.head_count {n_head}")
        mean = _rgb(md, path, _P + "image_mean")
        std = _rgb(md, path, _P + "image_std")
        if min(std) <= 0.0:
            raise fail(f"{_P}image_std {list(std)} has a value that is not positive")

        use_gelu = _get(md, path, "clip.use_gelu", bool, required=False)
        use_silu = _get(md, path, "clip.use_silu", bool, required=False)
        if use_gelu and use_silu:
            raise fail("clip.use_gelu and clip.use_silu are both true")
        ffn_act = "gelu" if use_gelu else "silu" if use_silu else "gelu_quick"

        if projector == "mlp":
            n_merge = 1
            layers = _get(md, path, _P + "feature_layer", list, required=False)
            if layers is None:
                if n_layer < 2:
                    raise fail(f"{_P}block_count is 1: the mlp projector reads the output of "
                               f"block_count - 1 layers, which leaves none")
                n_layer_run = n_layer - 1
            else:
                if len(layers) != 1:
                    raise fail(f"{_P}feature_layer {layers}: stacked feature layers are not supported "
                               f"(one layer index, or none)")
                n_layer_run = layers[0]
                if isinstance(n_layer_run, bool) or not isinstance(n_layer_run, int) \
                        or not 1 <= n_layer_run <= n_layer:
                    raise fail(f"{_P}feature_layer {layers} is not a layer count in 1..{n_layer}")
        else:
            n_layer_run = n_layer
            n_merge = _get(md, path, _P + "projector.scale_factor", int, required=False)
            if n_merge is None:
                n_merge = GEMMA3_DEFAULT_MERGE
            side = image_size // patch_size
            if not 1 <= n_merge <= side or side % n_merge:
                raise fail(f"{_P}projector.scale_factor {n_merge} does not divide the "
                           f"{side}x{side} patch grid")

        return cls(path=path, projector=projector, image_size=image_size, patch_size=patch_size,
                   n_embd=n_embd, n_head=n_head, n_layer=n_layer, n_layer_run=n_layer_run, n_ff=n_ff,
                   eps=float(eps), image_mean=mean, image_std=std, projection_dim=projection_dim,
                   ffn_act=ffn_act, n_merge=n_merge)


def _get(md: dict[str, Any], path: str, key: str, kind: type, required: bool = True) -> Any:
    """md[key] checked to be of `kind` (int excludes bool; float accepts int)."""
    if key not in md:
        if required:
            raise ModelError(f"{path}: missing {key}")
        return None
    value = md[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        names = {int: "an integer", float: "a number", str: "a string", bool: "a bool", list: "an array"}
        raise ModelError(f"{path}: {key} must be {names[kind]}, got {_shown(value)}")
    return float(value) if kind is float else value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rgb(md: dict[str, Any], path: str, key: str) -> tuple[float, float, float]:
    values = _get(md, path, key, list)
    if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                   and math.isfinite(v) for v in values):
        raise ModelError(f"{path}: {key} must be 3 finite numbers (R, G, B), got {_shown(values)}")
    return (float(values[0]), float(values[1]), float(values[2]))


# --- tensors ------------------------------------------------------------------------

@dataclass(frozen=True)
class MmprojTensors:
    """What check_tensors found: the projector's output width and which optional
    tensors are present.  `ffn_names[i]` is (up, down): the tensor names to read
    as layer i's expansion and contraction (swapped for legacy files)."""

    n_embd_text: int
    has_patch_bias: bool
    has_class_embd: bool
    has_pre_ln: bool
    has_post_ln: bool
    ffn_swapped: bool
    ffn_names: tuple[tuple[str, str], ...]
    names: tuple[str, ...] = field(repr=False)   # every tensor the encoder reads, in reading order

    def has(self, name: str) -> bool:
        return name in self.names


def check_tensors(mf: ModelFile, cfg: MmprojConfig) -> MmprojTensors:
    """Check every tensor the encoder of `cfg` reads; raise ModelError naming the first problem."""
    by_name = {t.name: t for t in mf.tensors}
    names: list[str] = []
    e, p, f = cfg.n_embd, cfg.patch_size, cfg.n_ff

    def shape_error(name: str, shape: tuple[int, ...], expected: tuple[int, ...], why: str = "") -> ModelError:
        return ModelError(f"{mf.path}: tensor {name!r} has shape {_dims(shape)}, expected "
                          f"{_dims(expected)}{why} (ggml order)")

    def need(name: str, expected: tuple[int, ...] | None, what: str, required: bool = True,
             why: str = "") -> tuple[int, ...] | None:
        t = by_name.get(name)
        if t is None:
            if required:
                raise ModelError(f"{mf.path}: missing tensor {name!r} ({what})")
            return None
        if expected is not None and tuple(t.shape) != expected:
            raise shape_error(name, tuple(t.shape), expected, why)
        names.append(name)
        return tuple(t.shape)

    def vector(prefix: str, what: str, weight_required: bool = True) -> bool:
        have = need(prefix + ".weight", (e,), what, required=weight_required) is not None
        bias = need(prefix + ".bias", (e,), what, required=False) is not None
        if bias and not have:
            raise ModelError(f"{mf.path}: tensor {prefix + '.bias'!r} present without {prefix + '.weight'!r}")
        return have

    need("v.patch_embd.weight", (p, p, 3, e), "the patch embedding",
         why=f" (patch_size {p}, 3 channels, embedding_length {e})")
    has_patch_bias = need("v.patch_embd.bias", (e,), "the patch embedding", required=False) is not None
    has_class = cfg.projector == "mlp" and need("v.class_embd", (e,), "", required=False) is not None
    n_pos = cfg.n_patches + (1 if has_class else 0)
    why = f" ({cfg.n_patches} patches{' + the class embedding' if has_class else ''})"
    need("v.position_embd.weight", (e, n_pos), "the position embedding", why=why)
    has_pre = vector("v.pre_ln", "the pre-layer norm", weight_required=False)

    ffn_names = []
    swapped = False
    for i in range(cfg.n_layer_run):
        b = f"v.blk.{i}."
        what = f"vision tower layer {i}"
        vector(b + "ln1", what)
        for m in ("attn_q", "attn_k", "attn_v", "attn_out"):
            need(b + m + ".weight", (e, e), what)
            need(b + m + ".bias", (e,), what, required=False)
        vector(b + "ln2", what)
        up_name, down_name = b + "ffn_up", b + "ffn_down"
        for name in (up_name, down_name):
            if name + ".weight" not in by_name:
                raise ModelError(f"{mf.path}: missing tensor {name + '.weight'!r} ({what})")
        # llama.cpp's is_ffn_swapped: ffn_down.weight's ne[0] == n_embd means the names are reversed.
        layer_swapped = by_name[down_name + ".weight"].shape[0] == e
        if i and layer_swapped != swapped:
            raise ModelError(f"{mf.path}: layer {i}'s ffn_up/ffn_down naming differs from layer 0's")
        swapped = layer_swapped
        if swapped:
            up_name, down_name = down_name, up_name
        need(up_name + ".weight", (e, f), what, why=f" (embedding_length {e}, feed_forward_length {f})")
        need(up_name + ".bias", (f,), what, required=False)
        need(down_name + ".weight", (f, e), what, why=f" (feed_forward_length {f}, embedding_length {e})")
        need(down_name + ".bias", (e,), what, required=False)
        ffn_names.append((up_name, down_name))
    has_post = vector("v.post_ln", "the post-layer norm", weight_required=False)

    if cfg.projector == "mlp":
        what = "the mlp projector"
        shape = need("mm.0.weight", None, what)
        n_text = shape[1] if len(shape) == 2 else 0
        if len(shape) != 2 or shape[0] != e:
            raise shape_error("mm.0.weight", shape, (e, n_text or 1), " (embedding_length, text n_embd)")
        need("mm.0.bias", (n_text,), what)
        need("mm.2.weight", (n_text, n_text), what, why=f" (mm.0 projects to {n_text})")
        need("mm.2.bias", (n_text,), what)
    else:
        what = "the gemma3 projector"
        shape = need("mm.input_projection.weight", None, what)
        n_text = shape[0] if len(shape) == 2 else 0
        if len(shape) != 2 or shape[1] != e:
            raise shape_error("mm.input_projection.weight", shape, (n_text or 1, e),
                              " (text n_embd, embedding_length)")
        need("mm.soft_emb_norm.weight", (e,), what)
    if n_text > MAX_EMBD:
        raise ModelError(f"{mf.path}: the projector's output width {n_text} exceeds the limit {MAX_EMBD}")
    return MmprojTensors(n_embd_text=n_text, has_patch_bias=has_patch_bias, has_class_embd=has_class,
                         has_pre_ln=has_pre, has_post_ln=has_post, ffn_swapped=swapped,
                         ffn_names=tuple(ffn_names), names=tuple(names))


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def load_mmproj(mf: ModelFile) -> tuple[MmprojConfig, MmprojTensors]:
    """Both checks at once: what a loader calls after validate_gguf(path)."""
    cfg = MmprojConfig.from_model(mf)
    return cfg, check_tensors(mf, cfg)

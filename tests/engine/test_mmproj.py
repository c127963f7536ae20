"""The mmproj file: MmprojConfig.from_model and check_tensors on synthetic projector
files (tests/ggufgen/vision.py), every refusal with its one-line message,
and the numpy reference (tests/engine/reference/vision.py) checked against
independent computations of its pieces.  No GPU: files and numpy only."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ggufgen.vision import (CLIP_MEAN, MmprojSpec, make_mmproj_weights, mmproj_metadata,
                                        write_mmproj, write_mmproj_weights)
from tests.engine.reference.vision import (ReferenceVision, attention, avg_pool, gelu_quick, gelu_tanh,
                                           layer_norm, patch_embed)
from vramd.errors import ModelError
from vramd.model.gguf_check import validate_gguf
from vramd.model.mmproj import MmprojConfig, check_tensors, load_mmproj

V = "clip.vision."


def _write(tmp_path, projector="mlp", metadata_edit=None, weights_edit=None, architecture="clip", **spec_fields):
    """A projector file with its metadata and weights edited: `metadata_edit(md)` and
    `weights_edit(w)` change the dicts in place before writing."""
    spec = MmprojSpec(projector=projector, **spec_fields)
    md = mmproj_metadata(spec)
    w = make_mmproj_weights(spec)
    if metadata_edit:
        metadata_edit(md)
    if weights_edit:
        weights_edit(w)
    path = tmp_path / f"mmproj-{projector}.gguf"
    return write_mmproj_weights(path, spec, w, md, architecture=architecture)


def _refusal(path) -> str:
    with pytest.raises(ModelError) as err:
        load_mmproj(validate_gguf(path))
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: "), message
    return message[len(f"{path}: "):]


# --- accepted files ---------------------------------------------------------------------

def test_mlp_config_and_tensors(tmp_path):
    mf = validate_gguf(write_mmproj(tmp_path / "m.gguf", "mlp"))
    cfg, info = load_mmproj(mf)
    assert (cfg.projector, cfg.image_size, cfg.patch_size, cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.n_ff) \
        == ("mlp", 32, 8, 64, 4, 2, 128)
    assert cfg.n_layer_run == 1             # LLaVA: the second-to-last layer's output
    assert cfg.ffn_act == "gelu_quick"      # clip.use_gelu false: CLIP's quick GELU
    assert cfg.head_dim == 16 and cfg.patches_per_side == 4 and cfg.n_patches == 16 and cfg.n_tokens == 16
    assert cfg.n_merge == 1 and cfg.projection_dim == 96
    assert cfg.eps == pytest.approx(1e-5, rel=1e-6)
    assert cfg.image_mean == pytest.approx(CLIP_MEAN, rel=1e-6)
    assert cfg.resample == "bicubic" and cfg.pad_color == (122, 116, 104)
    assert info.n_embd_text == 96
    assert (info.has_class_embd, info.has_pre_ln, info.has_post_ln, info.has_patch_bias) == (True, True, False, False)
    assert not info.ffn_swapped and info.ffn_names == (("v.blk.0.ffn_up", "v.blk.0.ffn_down"),)
    # Only the layers that run are read: layer 1 is in the file but not in the list.
    assert "v.blk.0.attn_q.weight" in info.names and "v.blk.1.attn_q.weight" not in info.names
    assert {"mm.0.weight", "mm.0.bias", "mm.2.weight", "mm.2.bias", "v.class_embd"} <= set(info.names)


def test_gemma3_config_and_tensors(tmp_path):
    mf = validate_gguf(write_mmproj(tmp_path / "g.gguf", "gemma3"))
    cfg, info = load_mmproj(mf)
    assert cfg.projector == "gemma3" and cfg.n_layer_run == 2 and cfg.ffn_act == "gelu"
    assert cfg.n_merge == 2 and cfg.n_tokens == 4
    assert cfg.resample == "bilinear" and cfg.pad_color == (0, 0, 0)
    assert info.n_embd_text == 96
    assert (info.has_class_embd, info.has_pre_ln, info.has_post_ln, info.has_patch_bias) == (False, False, True, True)
    assert {"mm.input_projection.weight", "mm.soft_emb_norm.weight"} <= set(info.names)


def test_gemma3_default_pooling_is_4x4(tmp_path):
    cfg = MmprojConfig.from_model(validate_gguf(write_mmproj(tmp_path / "g.gguf", "gemma3", n_merge=None)))
    assert cfg.n_merge == 4 and cfg.n_tokens == 1


def test_mlp_feature_layer_and_silu(tmp_path):
    path = _write(tmp_path, feature_layer=2, metadata_edit=lambda md: md.update({
        "clip.use_gelu": ("bool", False), "clip.use_silu": ("bool", True)}))
    cfg = MmprojConfig.from_model(validate_gguf(path))
    assert cfg.n_layer_run == 2 and cfg.ffn_act == "silu"


def test_projector_type_from_the_vision_key(tmp_path):
    def edit(md):
        del md["clip.projector_type"]
        md[V + "projector_type"] = ("str", "gemma3")
    path = _write(tmp_path, "gemma3", metadata_edit=edit)
    assert MmprojConfig.from_model(validate_gguf(path)).projector == "gemma3"


def test_optional_tensors_absent(tmp_path):
    path = write_mmproj(tmp_path / "m.gguf", "mlp", class_embd=False, pre_ln=False, layer_bias=False)
    cfg, info = load_mmproj(validate_gguf(path))
    assert not info.has_class_embd and not info.has_pre_ln
    assert "v.blk.0.attn_q.bias" not in info.names


def test_legacy_swapped_ffn_names(tmp_path):
    path = write_mmproj(tmp_path / "m.gguf", "mlp", swap_ffn_names=True)
    _, info = load_mmproj(validate_gguf(path))
    assert info.ffn_swapped
    assert info.ffn_names == (("v.blk.0.ffn_down", "v.blk.0.ffn_up"),)


# --- refused metadata ---------------------------------------------------------------------

def test_language_model_given_as_mmproj(tmp_path):
    path = _write(tmp_path, architecture="llama",
                  metadata_edit=lambda md: md.update({"llama.block_count": ("u32", 1),
                                                      "llama.embedding_length": ("u32", 8),
                                                      "llama.attention.head_count": ("u32", 1)}))
    assert _refusal(path) == ("general.architecture is 'llama', expected 'clip' "
                              "(is this the language model rather than its projector file?)")


def test_no_vision_encoder(tmp_path):
    path = _write(tmp_path, metadata_edit=lambda md: md.update({"clip.has_vision_encoder": ("bool", False)}))
    assert _refusal(path) == "clip.has_vision_encoder is missing or false: not a vision projector"


# gemma4v: llama.cpp mtmd's Gemma 4 projector, not built yet (docs/architecture.md)
@pytest.mark.parametrize("projector", ["ldp", "resampler", "qwen2vl_merger", "pixtral", "gemma4v"])
def test_unsupported_projector_is_named(tmp_path, projector):
    path = _write(tmp_path, projector)
    assert _refusal(path) == f"unsupported projector type {projector!r} (supported: mlp, gemma3)"


def test_missing_projector_type(tmp_path):
    path = _write(tmp_path, metadata_edit=lambda md: md.pop("clip.projector_type"))
    assert _refusal(path) == "missing clip.projector_type"


@pytest.mark.parametrize("key", ["image_size", "patch_size", "embedding_length", "attention.head_count",
                                 "block_count", "feed_forward_length", "projection_dim",
                                 "attention.layer_norm_epsilon", "image_mean", "image_std"])
def test_missing_key(tmp_path, key):
    path = _write(tmp_path, metadata_edit=lambda md: md.pop(V + key))
    assert _refusal(path) == f"missing {V}{key}"


@pytest.mark.parametrize("edit, message", [
    ({V + "image_size": ("str", "32")}, f"{V}image_size must be an integer, got '32'"),
    ({V + "image_size": ("u32", 0)}, f"{V}image_size is 0, expected 1..4096"),
    ({V + "image_size": ("u32", 8192)}, f"{V}image_size is 8192, expected 1..4096"),
    ({V + "block_count": ("u32", 1000)}, f"{V}block_count is 1000, expected 1..256"),
    ({V + "image_size": ("u32", 36)}, f"{V}image_size 36 is not a multiple of patch_size 8"),
    ({V + "image_size": ("u32", 4096), V + "patch_size": ("u32", 1)},
     "16777216 patches per image exceed the limit 65536"),
    ({V + "attention.head_count": ("u32", 5)},
     f"{V}embedding_length 64 is not a multiple of attention.head_count 5"),
    ({V + "attention.layer_norm_epsilon": ("f32", 0.0)},
     f"{V}attention.layer_norm_epsilon is 0.0, expected a number in (0, 1)"),
    ({V + "attention.layer_norm_epsilon": ("f32", float("nan"))},
     f"{V}attention.layer_norm_epsilon is nan, expected a number in (0, 1)"),
    ({V + "attention.layer_norm_epsilon": ("str", "1e-5")},
     f"{V}attention.layer_norm_epsilon must be a number, got '1e-5'"),
    ({V + "image_mean": ("f32s", [0.5, 0.5])}, f"{V}image_mean must be 3 finite numbers (R, G, B), got [0.5, 0.5]"),
    ({V + "image_mean": ("u32", 1)}, f"{V}image_mean must be an array, got 1"),
    ({V + "image_std": ("f32s", [0.5, 0.0, 0.5])}, f"{V}image_std [0.5, 0.0, 0.5] has a value that is not positive"),
    ({"clip.use_silu": ("bool", True), "clip.use_gelu": ("bool", True)},
     "clip.use_gelu and clip.use_silu are both true"),
    ({"clip.use_gelu": ("u32", 1)}, "clip.use_gelu must be a bool, got 1"),
    ({"clip.projector_type": ("u32", 3)}, "clip.projector_type must be a string, got 3"),
    ({V + "feature_layer": ("i32s", [4, 8])},
     f"{V}feature_layer [4, 8]: stacked feature layers are not supported (one layer index, or none)"),
    ({V + "feature_layer": ("i32s", [3])}, f"{V}feature_layer [3] is not a layer count in 1..2"),
    ({V + "feature_layer": ("i32s", [-1])}, f"{V}feature_layer [-1] is not a layer count in 1..2"),
    ({V + "block_count": ("u32", 1)},
     f"{V}block_count is 1: the mlp projector reads the output of block_count - 1 layers, which leaves none"),
])
def test_bad_metadata(tmp_path, edit, message):
    path = _write(tmp_path, metadata_edit=lambda md: md.update(edit))
    assert _refusal(path) == message


@pytest.mark.parametrize("merge", [3, 8, 0])
def test_gemma3_pooling_must_divide_the_grid(tmp_path, merge):
    path = _write(tmp_path, "gemma3", metadata_edit=lambda md: md.update(
        {V + "projector.scale_factor": ("u32", merge)}))
    assert _refusal(path) == f"{V}projector.scale_factor {merge} does not divide the 4x4 patch grid"


# --- refused tensors ------------------------------------------------------------------

@pytest.mark.parametrize("projector, name, what", [
    ("mlp", "v.patch_embd.weight", "the patch embedding"),
    ("mlp", "v.position_embd.weight", "the position embedding"),
    ("mlp", "v.blk.0.ln1.weight", "vision tower layer 0"),
    ("mlp", "v.blk.0.attn_q.weight", "vision tower layer 0"),
    ("mlp", "v.blk.0.attn_out.weight", "vision tower layer 0"),
    ("mlp", "v.blk.0.ffn_down.weight", "vision tower layer 0"),
    ("mlp", "mm.0.weight", "the mlp projector"),
    ("mlp", "mm.2.bias", "the mlp projector"),
    ("gemma3", "v.blk.1.ffn_up.weight", "vision tower layer 1"),
    ("gemma3", "v.blk.1.ln2.weight", "vision tower layer 1"),
    ("gemma3", "mm.input_projection.weight", "the gemma3 projector"),
    ("gemma3", "mm.soft_emb_norm.weight", "the gemma3 projector"),
])
def test_missing_tensor(tmp_path, projector, name, what):
    path = _write(tmp_path, projector, weights_edit=lambda w: w.pop(name))
    assert _refusal(path) == f"missing tensor {name!r} ({what})"


def test_unused_layer_may_be_absent(tmp_path):
    # LLaVA reads layers [0, n_layer - 1): a file without the last layer's tensors loads.
    def drop_last(w):
        for name in [n for n in w if n.startswith("v.blk.1.")]:
            del w[name]
    _, info = load_mmproj(validate_gguf(_write(tmp_path, weights_edit=drop_last)))
    assert info.n_embd_text == 96


def _reshape(name, shape):
    def edit(w):
        w[name] = np.zeros(shape, np.float32)
    return edit


@pytest.mark.parametrize("projector, name, numpy_shape, message", [
    ("mlp", "v.patch_embd.weight", (64, 3, 4, 4),
     "tensor 'v.patch_embd.weight' has shape [4, 4, 3, 64], expected [8, 8, 3, 64] "
     "(patch_size 8, 3 channels, embedding_length 64) (ggml order)"),
    ("mlp", "v.position_embd.weight", (16, 64),
     "tensor 'v.position_embd.weight' has shape [64, 16], expected [64, 17] "
     "(16 patches + the class embedding) (ggml order)"),
    ("gemma3", "v.position_embd.weight", (17, 64),
     "tensor 'v.position_embd.weight' has shape [64, 17], expected [64, 16] (16 patches) (ggml order)"),
    ("mlp", "v.blk.0.attn_k.weight", (64, 32),
     "tensor 'v.blk.0.attn_k.weight' has shape [32, 64], expected [64, 64] (ggml order)"),
    ("mlp", "v.blk.0.attn_v.bias", (63,),
     "tensor 'v.blk.0.attn_v.bias' has shape [63], expected [64] (ggml order)"),
    ("mlp", "v.blk.0.ffn_up.weight", (100, 64),
     "tensor 'v.blk.0.ffn_up.weight' has shape [64, 100], expected [64, 128] "
     "(embedding_length 64, feed_forward_length 128) (ggml order)"),
    ("mlp", "v.pre_ln.weight", (32,),
     "tensor 'v.pre_ln.weight' has shape [32], expected [64] (ggml order)"),
    ("mlp", "mm.0.weight", (96, 32),
     "tensor 'mm.0.weight' has shape [32, 96], expected [64, 96] (embedding_length, text n_embd) (ggml order)"),
    ("mlp", "mm.2.weight", (80, 96),
     "tensor 'mm.2.weight' has shape [96, 80], expected [96, 96] (mm.0 projects to 96) (ggml order)"),
    ("mlp", "mm.0.bias", (95,), "tensor 'mm.0.bias' has shape [95], expected [96] (ggml order)"),
    ("gemma3", "mm.input_projection.weight", (32, 96),
     "tensor 'mm.input_projection.weight' has shape [96, 32], expected [96, 64] "
     "(text n_embd, embedding_length) (ggml order)"),
    ("gemma3", "mm.soft_emb_norm.weight", (96,),
     "tensor 'mm.soft_emb_norm.weight' has shape [96], expected [64] (ggml order)"),
])
def test_wrong_shape(tmp_path, projector, name, numpy_shape, message):
    path = _write(tmp_path, projector, weights_edit=_reshape(name, numpy_shape))
    assert _refusal(path) == message


def test_norm_bias_without_weight(tmp_path):
    path = _write(tmp_path, weights_edit=lambda w: w.pop("v.pre_ln.weight"))
    assert _refusal(path) == "tensor 'v.pre_ln.bias' present without 'v.pre_ln.weight'"


def test_ffn_naming_must_agree_across_layers(tmp_path):
    def swap_layer_1(w):
        for kind in ("weight", "bias"):
            up, down = f"v.blk.1.ffn_up.{kind}", f"v.blk.1.ffn_down.{kind}"
            w[up], w[down] = w[down], w[up]
    path = _write(tmp_path, "gemma3", weights_edit=swap_layer_1)
    assert _refusal(path) == "layer 1's ffn_up/ffn_down naming differs from layer 0's"


def test_projector_output_width_limit(tmp_path):
    path = _write(tmp_path, "gemma3", weights_edit=_reshape("mm.input_projection.weight", (64, 40000)))
    assert _refusal(path) == "the projector's output width 40000 exceeds the limit 32768"


def test_check_tensors_against_another_config(tmp_path):
    # check_tensors follows the config: the mlp file checked as if it were 16 wide fails on the first tensor.
    mf = validate_gguf(write_mmproj(tmp_path / "m.gguf", "mlp"))
    cfg = MmprojConfig.from_model(mf)
    narrow = MmprojConfig(**{**cfg.__dict__, "n_embd": 16, "n_head": 1})
    with pytest.raises(ModelError, match=r"'v.patch_embd.weight' has shape \[8, 8, 3, 64\], expected \[8, 8, 3, 16\]"):
        check_tensors(mf, narrow)


# --- the numpy reference -----------------------------------------------------------------

def test_patch_embed_is_a_strided_convolution():
    rng = np.random.default_rng(1)
    pixels = rng.standard_normal((3, 12, 12))
    weight = rng.standard_normal((5, 3, 4, 4))
    bias = rng.standard_normal(5)
    got = patch_embed(pixels, weight, bias)
    want = np.empty((9, 5))
    for r in range(3):
        for c in range(3):
            window = pixels[:, 4 * r:4 * r + 4, 4 * c:4 * c + 4]
            for o in range(5):
                want[r * 3 + c, o] = np.sum(window * weight[o]) + bias[o]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_attention_is_non_causal_per_head():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((6, 8)) for _ in range(3))
    got = attention(q, k, v, n_head=2)
    for h in range(2):
        cols = slice(4 * h, 4 * h + 4)
        for i in range(6):
            s = np.array([q[i, cols] @ k[j, cols] / 2.0 for j in range(6)])   # sqrt(head_dim 4) = 2
            a = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(got[i, cols], a @ v[:, cols], rtol=1e-12)
    # Non-causal: the first position sees the last one.
    v2 = v.copy()
    v2[5] += 1.0
    assert not np.allclose(attention(q, k, v2, 2)[0], got[0])


def test_activations_and_norms():
    x = np.array([-3.0, -1.0, 0.0, 0.5, 2.0])
    # tanh GELU: values from the formula by hand at x = 2: 0.5*2*(1 + tanh(0.79788456*(2 + 0.35772))).
    assert gelu_tanh(np.array([2.0]))[0] == pytest.approx(1.9545976940, rel=1e-9)
    assert gelu_quick(np.array([1.0]))[0] == pytest.approx(1.0 / (1.0 + np.exp(-1.702)), rel=1e-12)
    y = layer_norm(x, None, None, 0.0)
    assert y.mean() == pytest.approx(0.0, abs=1e-12) and (y ** 2).mean() == pytest.approx(1.0, rel=1e-12)
    grid = np.arange(16 * 2, dtype=float).reshape(16, 2)            # 4x4 grid, 2 channels
    pooled = avg_pool(grid, 4, 2)
    assert pooled.shape == (4, 2)
    np.testing.assert_allclose(pooled[0], grid[[0, 1, 4, 5]].mean(axis=0))
    np.testing.assert_allclose(pooled[3], grid[[10, 11, 14, 15]].mean(axis=0))


def test_reference_shapes_and_spread(tmp_path):
    pixels = np.random.default_rng(3).standard_normal((3, 32, 32)).astype(np.float32)
    for projector, tokens in (("mlp", 16), ("gemma3", 4)):
        ref = ReferenceVision(write_mmproj(tmp_path / f"{projector}.gguf", projector))
        out = ref.encode(pixels)
        assert out.shape == (tokens, 96)
        assert np.isfinite(out).all() and 0.3 < out.std() < 3.0
        # Every token differs: the image, not the position embedding alone, drives the output.
        assert len({row.tobytes() for row in out}) == tokens


def test_reference_mlp_by_hand(tmp_path):
    """The mlp path recomputed without the reference's helpers, layer by layer."""
    path = write_mmproj(tmp_path / "m.gguf", "mlp", n_layer=3, feature_layer=2, weight_type="F32")
    ref = ReferenceVision(path)
    t = ref.tensors
    pixels = np.random.default_rng(4).standard_normal((3, 32, 32))
    x = np.stack([np.tensordot(t["v.patch_embd.weight"], pixels[:, 8 * r:8 * r + 8, 8 * c:8 * c + 8], axes=3)
                  for r in range(4) for c in range(4)])
    x = np.vstack([t["v.class_embd"], x]) + t["v.position_embd.weight"]

    def ln(v, name):
        return (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + ref.cfg.eps) \
            * t[name + ".weight"] + t[name + ".bias"]

    x = ln(x, "v.pre_ln")
    for i in range(2):                    # feature_layer 2: two of the three layers run
        b = f"v.blk.{i}."
        h = ln(x, b + "ln1")
        q, k, v = (h @ t[b + m + ".weight"].T + t[b + m + ".bias"] for m in ("attn_q", "attn_k", "attn_v"))
        heads = []
        for hd in range(4):
            c = slice(16 * hd, 16 * hd + 16)
            s = q[:, c] @ k[:, c].T / 4.0
            a = np.exp(s - s.max(1, keepdims=True))
            heads.append((a / a.sum(1, keepdims=True)) @ v[:, c])
        x = x + np.hstack(heads) @ t[b + "attn_out.weight"].T + t[b + "attn_out.bias"]
        h = ln(x, b + "ln2")
        u = h @ t[b + "ffn_up.weight"].T + t[b + "ffn_up.bias"]
        x = x + (u / (1 + np.exp(-1.702 * u))) @ t[b + "ffn_down.weight"].T + t[b + "ffn_down.bias"]
    z = x[1:] @ t["mm.0.weight"].T + t["mm.0.bias"]
    z = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    want = z @ t["mm.2.weight"].T + t["mm.2.bias"]
    np.testing.assert_allclose(ref.encode(pixels), want, rtol=1e-10, atol=1e-10)


def test_reference_gemma3_projector_by_hand(tmp_path):
    ref = ReferenceVision(write_mmproj(tmp_path / "g.gguf", "gemma3", weight_type="F32"))
    t = ref.tensors
    x = np.random.default_rng(5).standard_normal((16, 64))           # a tower output: 4x4 grid
    grid = x.reshape(4, 4, 64)
    pooled = np.stack([grid[2 * r:2 * r + 2, 2 * c:2 * c + 2].mean(axis=(0, 1)) for r in range(2) for c in range(2)])
    normed = pooled / np.sqrt((pooled ** 2).mean(-1, keepdims=True) + ref.cfg.eps) * t["mm.soft_emb_norm.weight"]
    want = np.stack([[normed[i] @ t["mm.input_projection.weight"][:, j] for j in range(96)] for i in range(4)])
    np.testing.assert_allclose(ref.project(x), want, rtol=1e-10, atol=1e-10)


def test_reference_reads_swapped_ffn_names(tmp_path):
    pixels = np.random.default_rng(6).standard_normal((3, 32, 32))
    plain = ReferenceVision(write_mmproj(tmp_path / "a.gguf", "mlp"))
    legacy = ReferenceVision(write_mmproj(tmp_path / "b.gguf", "mlp", swap_ffn_names=True))
    np.testing.assert_array_equal(plain.encode(pixels), legacy.encode(pixels))

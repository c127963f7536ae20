"""vramd.model.image: decoding PNG/JPEG request bytes, fitting them to the encoder's
square, normalizing by the projector's mean/std -- and refusing malformed,
truncated, oversize, bomb and unsupported images with one clear UsageError line.
Images are built here with Pillow (or by hand, for headers Pillow would not
write); no files are committed.  No GPU."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tests.ggufgen.vision import write_mmproj
from vramd.errors import UsageError
from vramd.model.gguf_check import validate_gguf
from vramd.model.image import (MAX_IMAGE_BYTES, ImageLimits, decode_image, fit_square, normalize,
                               preprocess_image, sniff_format)
from vramd.model.mmproj import MmprojConfig


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def rgb_array(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def refused(data, **kw) -> str:
    with pytest.raises(UsageError) as err:
        decode_image(data, **kw)
    message = str(err.value)
    assert "\n" not in message and err.value.http_status == 400
    return message


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mmproj")
    return {p: MmprojConfig.from_model(validate_gguf(write_mmproj(d / f"{p}.gguf", p))) for p in ("mlp", "gemma3")}


# --- decoding -----------------------------------------------------------------------

def test_png_rgb_round_trip():
    pixels = rgb_array(5, 7)
    image = decode_image(encode(Image.fromarray(pixels)))
    assert image.mode == "RGB" and image.size == (7, 5)
    np.testing.assert_array_equal(np.asarray(image), pixels)


def test_png_modes_become_rgb():
    rgba = np.concatenate([rgb_array(4, 4), np.full((4, 4, 1), 7, np.uint8)], axis=2)
    np.testing.assert_array_equal(np.asarray(decode_image(encode(Image.fromarray(rgba, "RGBA")))), rgba[..., :3])
    grey = np.arange(16, dtype=np.uint8).reshape(4, 4) * 16
    np.testing.assert_array_equal(np.asarray(decode_image(encode(Image.fromarray(grey, "L")))),
                                  np.repeat(grey[..., None], 3, axis=2))
    palette = Image.fromarray(rgb_array(6, 6)).quantize(8)
    np.testing.assert_array_equal(np.asarray(decode_image(encode(palette))), np.asarray(palette.convert("RGB")))
    # 16-bit grey keeps the high byte (stb_image's 16 -> 8 bit rule), not a clip at 255.
    deep = (np.arange(16, dtype=np.uint16).reshape(4, 4) * 4000)
    np.testing.assert_array_equal(np.asarray(decode_image(encode(Image.fromarray(deep))))[..., 0], deep >> 8)


def test_jpeg():
    flat = Image.new("RGB", (24, 16), (200, 40, 90))
    image = decode_image(encode(flat, "JPEG", quality=95))
    assert image.mode == "RGB" and image.size == (24, 16)
    assert np.abs(np.asarray(image, dtype=int) - (200, 40, 90)).max() <= 3      # lossy, but close
    grey_jpeg = encode(Image.new("L", (8, 8), 100), "JPEG", quality=95)
    assert np.abs(np.asarray(decode_image(grey_jpeg), dtype=int) - 100).max() <= 2


def test_sniff_format():
    assert sniff_format(encode(Image.new("RGB", (2, 2)))) == "PNG"
    assert sniff_format(encode(Image.new("RGB", (2, 2)), "JPEG")) == "JPEG"
    assert sniff_format(encode(Image.new("RGB", (2, 2)), "GIF")) == "GIF"
    assert sniff_format(b"hello") == "unknown"


# --- refusals ---------------------------------------------------------------------

def test_empty_and_not_bytes():
    assert refused(b"") == "image: empty image data"
    assert refused("iVBORw0KGgo=") == "image: expected image bytes, got str"


@pytest.mark.parametrize("fmt, name", [("GIF", "GIF"), ("BMP", "BMP"), ("WEBP", "WebP"), ("TIFF", "TIFF")])
def test_unsupported_format_is_named(fmt, name):
    data = encode(Image.new("RGB", (4, 4), (1, 2, 3)), fmt)
    assert refused(data, label="image 2") == f"image 2: unsupported image format {name} (PNG and JPEG are supported)"


def test_not_an_image():
    assert refused(b"<html>not found</html>") == "image: not a PNG or JPEG image (PNG and JPEG are supported)"


def test_truncated():
    png = encode(Image.fromarray(rgb_array(64, 64)))
    assert refused(png[: len(png) // 2]) == "image: truncated PNG image data"
    assert refused(png[:20]) == "image: truncated PNG image data"
    jpeg = encode(Image.fromarray(rgb_array(64, 64)), "JPEG")
    assert refused(jpeg[: len(jpeg) // 2]) == "image: truncated JPEG image data"


def test_malformed():
    png = bytearray(encode(Image.fromarray(rgb_array(16, 16))))
    png[29] ^= 0xFF                            # inside the IHDR chunk: its CRC no longer matches
    message = refused(bytes(png))
    assert message.startswith("image: malformed PNG image"), message
    jpeg = b"\xff\xd8\xff" + bytes(range(256)) * 4
    assert refused(jpeg).startswith("image: malformed JPEG image"), refused(jpeg)


def test_too_many_bytes():
    png = encode(Image.fromarray(rgb_array(32, 32)))
    assert refused(png, limits=ImageLimits(max_bytes=1000)) == \
        f"image: {len(png)} bytes exceeds the limit of 1000 bytes"
    # The default limit: refused from the length alone, before any parsing.
    huge = b"\x89PNG\r\n\x1a\n" + bytes(MAX_IMAGE_BYTES)
    assert refused(huge) == f"image: {len(huge)} bytes exceeds the limit of {MAX_IMAGE_BYTES} bytes"


def test_too_many_pixels():
    png = encode(Image.new("RGB", (100, 60)))
    assert refused(png, limits=ImageLimits(max_pixels=5000)) == \
        "image: 100x60 image exceeds the limit of 5000 pixels and 16384 per side"
    assert refused(png, limits=ImageLimits(max_side=64)) == \
        "image: 100x60 image exceeds the limit of 50000000 pixels and 64 per side"


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height, with a few bytes of IDAT: a bomb's
    header (decoding it would allocate width*height*3 bytes)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(64)))
            + chunk(b"IEND", b""))


def test_png_bomb_refused_before_decoding():
    # 9000 x 8000 = 72 MP: above our 50 MP, below Pillow's own warning (~89 MP): our check
    # refuses it from the header (decoding would report "truncated", not this).
    assert refused(_png_header_only(9000, 8000)) == \
        "image: 9000x8000 image exceeds the limit of 50000000 pixels and 16384 per side"
    # 100000 x 100000: Pillow's MAX_IMAGE_PIXELS guard trips inside Image.open, same refusal.
    assert refused(_png_header_only(100000, 100000)) == \
        "image: the PNG image's dimensions exceed the limit of 50000000 pixels (decompression bomb?)"


def _jpeg_with_size(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("RGB", (16, 16), (9, 9, 9)), "JPEG"))
    sof = data.index(b"\xff\xc0")             # baseline SOF0: length(2) precision(1) height(2) width(2)
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def test_jpeg_bomb_refused_before_decoding():
    assert refused(_jpeg_with_size(9000, 8000)) == \
        "image: 9000x8000 image exceeds the limit of 50000000 pixels and 16384 per side"
    assert refused(_jpeg_with_size(60000, 60000)) == \
        "image: the JPEG image's dimensions exceed the limit of 50000000 pixels (decompression bomb?)"


# --- resizing -------------------------------------------------------------------------

def test_same_size_is_unchanged():
    image = Image.fromarray(rgb_array(32, 32))
    np.testing.assert_array_equal(np.asarray(fit_square(image, 32, "bicubic", (1, 2, 3))), np.asarray(image))


def test_wide_image_is_padded_top_and_bottom():
    image = Image.new("RGB", (64, 32), (10, 20, 30))
    out = np.asarray(fit_square(image, 32, "bicubic", (122, 116, 104)))
    assert out.shape == (32, 32, 3)
    # scale 0.5: 32 x 16 content at rows 8..23
    assert (out[:8] == (122, 116, 104)).all() and (out[24:] == (122, 116, 104)).all()
    assert (out[8:24] == (10, 20, 30)).all()          # a flat colour stays flat through bicubic


def test_tall_image_odd_ratio_llama_cpp_rounding():
    image = Image.new("RGB", (20, 50), (200, 100, 0))
    out = np.asarray(fit_square(image, 32, "bilinear", (0, 0, 0)))
    # scale = 32/50 = 0.64; width ceil(20 * 0.64) = ceil(12.8) = 13, offset (32 - 13) // 2 = 9
    assert (out[:, :9] == 0).all() and (out[:, 22:] == 0).all()
    assert (out[:, 9:22] == (200, 100, 0)).all()


def test_upscale_and_downscale_filters():
    small = Image.fromarray(rgb_array(4, 4, seed=5))
    for resample in ("bicubic", "bilinear"):
        up = fit_square(small, 32, resample, (0, 0, 0))
        assert up.size == (32, 32)
        np.testing.assert_array_equal(np.asarray(up), np.asarray(small.resize((32, 32), getattr(Image.Resampling, resample.upper()))))
    with pytest.raises(UsageError, match="unknown resize filter 'lanczos'"):
        fit_square(small, 32, "lanczos", (0, 0, 0))


# --- normalization -----------------------------------------------------------------------

def test_normalize_by_hand():
    values = np.array([[[0, 128, 255], [10, 20, 30]],
                       [[255, 255, 255], [1, 2, 3]]], dtype=np.uint8)              # [H=2, W=2, 3]
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    out = normalize(Image.fromarray(values), mean, std)
    assert out.dtype == np.float32 and out.shape == (3, 2, 2)
    # by hand, pixel (0, 0): R (0/255 - 0.48145466) / 0.26862954 = -1.79226...,
    # G (128/255 - 0.4578275) / 0.26130258 = 0.04413328 / 0.26130258 = 0.16889..., B (255/255 - 0.40821073) / 0.27577711 = 2.145897...
    assert out[0, 0, 0] == pytest.approx(-1.7922626, rel=1e-6)
    assert out[1, 0, 0] == pytest.approx(0.1688973, rel=1e-6)
    assert out[2, 0, 0] == pytest.approx(2.1458969, rel=1e-6)
    for y in range(2):
        for x in range(2):
            for c in range(3):
                want = (float(values[y, x, c]) / 255.0 - mean[c]) / std[c]
                assert out[c, y, x] == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_preprocess_image_for_each_projector(configs):
    pixels = rgb_array(32, 32, seed=9)
    data = encode(Image.fromarray(pixels))
    for cfg in configs.values():
        out = preprocess_image(data, cfg)
        assert out.shape == (3, 32, 32) and out.dtype == np.float32 and out.flags.c_contiguous
        mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
        std = np.asarray(cfg.image_std, np.float32)[:, None, None]
        want = (pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255) - mean) / std
        np.testing.assert_array_equal(out, want)       # no resize needed: exactly llama.cpp's input
    # gemma3's SigLIP normalization maps 0..255 to -1..1
    assert preprocess_image(encode(Image.new("RGB", (32, 32), (255, 0, 255))), configs["gemma3"])[:, 0, 0] == \
        pytest.approx([1.0, -1.0, 1.0])


def test_preprocess_image_resizes_with_the_projector_filter(configs):
    image = Image.fromarray(rgb_array(48, 80, seed=11))
    for projector, cfg in configs.items():
        out = preprocess_image(encode(image), cfg)
        square = fit_square(image, 32, cfg.resample, cfg.pad_color)
        np.testing.assert_array_equal(out, normalize(square, cfg.image_mean, cfg.image_std))
        # 80 x 48 -> 32 x 20 (ceil(19.2)), padded rows 0..5 and 26..31 in the projector's pad colour
        pad = (np.asarray(cfg.pad_color, np.float32) / 255 - np.asarray(cfg.image_mean, np.float32)) \
            / np.asarray(cfg.image_std, np.float32)
        np.testing.assert_allclose(out[:, 0, 0], pad, rtol=1e-6)
        np.testing.assert_allclose(out[:, 31, 31], pad, rtol=1e-6)


def test_preprocess_image_refusal_carries_the_label(configs):
    with pytest.raises(UsageError, match=r"^image 3: unsupported image format GIF"):
        preprocess_image(encode(Image.new("RGB", (4, 4)), "GIF"), configs["mlp"], label="image 3")

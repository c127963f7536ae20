"""Images from a request to the encoder's input: decode, resize, normalize.

Owns: `preprocess_image(data, cfg)` -- PNG or JPEG bytes (untrusted: from an
API request) to float32 pixels [3, S, S] for the vision encoder of an
`MmprojConfig` -- and its steps `decode_image`, `fit_square`, `normalize`,
with `ImageLimits`.  Every refusal is a `vramd.errors.UsageError` (HTTP 400)
whose message is one line: `<label>: <problem>`.

Does not own: base64 / data: URI parsing and the count of images per
request (the API layer), the encoder itself.

Decoding uses Pillow, restricted to its PNG and JPEG plugins (the format is
told from the magic bytes first; anything else is refused by name without
any other decoder seeing the data).  Bounds, checked in this order:
  1. the encoded size (ImageLimits.max_bytes) before anything is parsed;
  2. the dimensions from the header against ImageLimits.max_pixels (and
     max_side) before any pixel is decoded -- a decompression bomb (a small
     file declaring a huge image) is refused here; Pillow's own
     Image.MAX_IMAGE_PIXELS guard (DecompressionBombWarning / Error) is
     also turned into the same refusal, for whatever slips past;
  3. decoding itself: a truncated or corrupt stream is an error
     (Pillow's default ImageFile.LOAD_TRUNCATED_IMAGES = False, which
     vramd never changes), not a half-grey image.

Colour: every mode becomes 8-bit RGB (Pillow's convert("RGB")): alpha is
dropped without compositing, grey is replicated, palettes are expanded, CMYK
JPEGs converted -- what llama.cpp gets from stb_image with 3 channels.
16-bit grey PNGs keep their high byte (stb_image's 16 -> 8 bit rule).  EXIF
orientation is not applied (neither stb_image nor llama.cpp does).

Resizing follows llama.cpp's fixed-size preprocessing (mtmd-image.cpp,
img_tool::resize with padding): the image is scaled by
min(S / w, S / h) to (min(ceil(w s), S), min(ceil(h s), S)) -- aspect ratio
kept, computed in float32 as llama.cpp does -- and pasted centred at
((S - w') // 2, (S - h') // 2) on an S x S canvas of the pad colour.  An
image already S x S is copied unchanged.  The filter per projector is
MmprojConfig.resample: "bicubic" for mlp (LLaVA), "bilinear" for gemma3
(llama.cpp's RESIZE_ALGO_BILINEAR for that projector); the pad colour is
MmprojConfig.pad_color: LLaVA's mean colour (122, 116, 104), black for gemma3.
Uncertainties: (1) which of llama.cpp's paths a LLaVA-1.5 image takes was
not traced to the end: for the mlp projector without image_grid_pinpoints,
llama.cpp (2026) configures a bicubic resize padded with (122, 116, 104)
for the "refined" image and a bilinear one without padding for the
"overview"; vramd uses the former, which is also LLaVA-1.5's own "pad"
preprocessing.  For gemma3 llama.cpp sets bilinear; that it pads (its
img_tool default) rather than stretches is assumed, not traced.
(2) The filters are Pillow's (which antialias when shrinking),
not llama.cpp's hand-written ones (which do not; its bicubic is ViT.cpp's
cubic on a clamped 4x4 neighbourhood, sampled at x * w / w'); so pixels of a resized image differ
from llama.cpp's by a few grey levels, more for strong downscaling.  HF's
processors differ from both (CLIP: resize the short side + centre crop;
Gemma 3: stretch to 896 x 896 without padding).  An image that needs no
resize is bit-for-bit what llama.cpp feeds its encoder.

Normalization, as llama.cpp's img_u8_to_f32 in float32:
  x[c, y, x] = (u8[y, x, c] / 255 - mean[c]) / std[c].
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vramd.errors import UsageError

MAX_IMAGE_BYTES = 20 << 20          # an encoded image: 20 MiB (OpenAI's own limit is of that order)
MAX_IMAGE_PIXELS = 50_000_000       # decoded: 50 megapixels, 150 MB as RGB
MAX_IMAGE_SIDE = 16384

RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}

# Magic bytes -> format: the two decoded, and a few common ones named in the refusal.
_SUPPORTED = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG"}
_KNOWN_UNSUPPORTED = [(b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"),
                      (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"), (b"8BPS", "PSD")]


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_side: int = MAX_IMAGE_SIDE


DEFAULT_LIMITS = ImageLimits()


def sniff_format(data: bytes) -> str:
    """"PNG" or "JPEG" from the magic bytes; else the name of a known format, or "unknown"."""
    for magic, name in _SUPPORTED.items():
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        return "AVIF" if brand in (b"avif", b"avis") else "HEIF" if brand[:3] in (b"hei", b"mif", b"hev") else "unknown"
    for magic, name in _KNOWN_UNSUPPORTED:
        if data.startswith(magic):
            return name
    return "unknown"


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS, label: str = "image") -> Image.Image:
    """Decode PNG or JPEG bytes into an 8-bit RGB image, within `limits`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise UsageError(f"{label}: expected image bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise UsageError(f"{label}: empty image data")
    if len(data) > limits.max_bytes:
        raise UsageError(f"{label}: {len(data)} bytes exceeds the limit of {limits.max_bytes} bytes")
    fmt = sniff_format(data)
    if fmt not in _SUPPORTED.values():
        what = "not a PNG or JPEG image" if fmt == "unknown" else f"unsupported image format {fmt}"
        raise UsageError(f"{label}: {what} (PNG and JPEG are supported)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[fmt])
            _check_size(image.size, limits, label)
            image.load()
            rgb = _to_rgb(image)
    except UsageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own guard tripped in open() (before our check could see the size).
        raise UsageError(f"{label}: the {fmt} image's dimensions exceed the limit of "
                         f"{limits.max_pixels} pixels (decompression bomb?)") from None
    except Image.UnidentifiedImageError:
        raise UsageError(f"{label}: malformed {fmt} image (the header cannot be read)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        text = str(e).strip() or type(e).__name__
        if "truncated" in text.lower():
            raise UsageError(f"{label}: truncated {fmt} image data") from None
        raise UsageError(f"{label}: malformed {fmt} image: {_one_line(text)}") from None
    return rgb


def _check_size(size: tuple[int, int], limits: ImageLimits, label: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise UsageError(f"{label}: image has no pixels ({width}x{height})")
    if width > limits.max_side or height > limits.max_side or width * height > limits.max_pixels:
        raise UsageError(f"{label}: {width}x{height} image exceeds the limit of {limits.max_pixels} "
                         f"pixels and {limits.max_side} per side")


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 120 else line[:117] + "..."


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit grey: keep the high byte (stb_image's rule); convert("RGB") would clip at 255.
        values = np.asarray(image, dtype=np.uint32)
        grey = (values >> 8 if image.mode != "I" or values.max(initial=0) > 255 else values)
        return Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8), "L").convert("RGB")
    return image.convert("RGB")


def fit_square(image: Image.Image, size: int, resample: str, pad_color: tuple[int, int, int]) -> Image.Image:
    """Scale `image` (RGB) to fit in size x size, keeping its aspect ratio, centred on
    a canvas of `pad_color` (llama.cpp's img_tool::resize with padding)."""
    if resample not in RESAMPLE:
        raise UsageError(f"unknown resize filter {resample!r}: one of {', '.join(RESAMPLE)}")
    width, height = image.size
    if (width, height) == (size, size):
        return image.copy()
    target = np.float32(size)
    scale = min(target / np.float32(width), target / np.float32(height))
    new_w = min(int(math.ceil(np.float32(width) * scale)), size)
    new_h = min(int(math.ceil(np.float32(height) * scale)), size)
    new_w, new_h = max(new_w, 1), max(new_h, 1)
    resized = image.resize((new_w, new_h), RESAMPLE[resample])
    if (new_w, new_h) == (size, size):
        return resized
    canvas = Image.new("RGB", (size, size), tuple(pad_color))
    canvas.paste(resized, ((size - new_w) // 2, (size - new_h) // 2))
    return canvas


def normalize(image: Image.Image, mean, std) -> np.ndarray:
    """RGB image -> float32 [3, H, W]: (v / 255 - mean[c]) / std[c], in float32."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)            # [H, W, 3]
    mean32 = np.asarray(mean, dtype=np.float32)
    std32 = np.asarray(std, dtype=np.float32)
    out = (pixels / np.float32(255.0) - mean32) / std32
    return np.ascontiguousarray(out.transpose(2, 0, 1), dtype=np.float32)


def preprocess_image(data: bytes, cfg, limits: ImageLimits = DEFAULT_LIMITS, label: str = "image") -> np.ndarray:
    """PNG/JPEG bytes -> float32 [3, S, S] for the encoder of `cfg` (an MmprojConfig:
    image_size, image_mean, image_std, resample, pad_color)."""
    image = decode_image(data, limits, label)
    square = fit_square(image, cfg.image_size, cfg.resample, cfg.pad_color)
    return normalize(square, cfg.image_mean, cfg.image_std)

"""`vramd bench encode`: an image request with the vision encoder on demand, and resident.

Owns the measurement of issue 8's cost: what bringing the encoder in for
each image (and freeing it after) adds to an image request, against what
keeping it resident (`--mmproj-resident`) costs in VRAM on the text path.

In one process, on one device: a synthetic llama backbone (weights zero in
a sparse file) and a synthetic LLaVA-style projector (vramd/bench/
vision_models.py: `--shape vit-l` is CLIP ViT-L/14 at 336 px, ~0.6 GB in
F16; seeded weights), loaded as the daemon loads them, with an Engine
driving requests exactly as the daemon's loop does (Engine.prompt: decode
and preprocess the image, encode it in a session; Engine.generate: prefill,
first token).  Then:

  - the link: the residency core's plain host->device copy of the encoder's
    byte count (pinned memory, as the shadows), so restore time stands
    next to encoder bytes / link rate of the same run;
  - each mode, on-demand then resident (the same encoder, its `resident`
    flag set as --mmproj-resident sets it): a warm-up image request
    (pipelines compiled; in resident mode it brings the encoder in for
    good), a text request after which the residency breakdown shows what
    the text path holds on the device, then `--reps` pairs of image
    requests, each with its own JPEG (so prefix reuse never skips an
    image's positions):
      1. phases: the encoder waits for its upload before the graph, so
         restore (to completion), encode and release are timed apart;
      2. serving: the path as the daemon runs it (the graph recorded while
         the upload runs); its time from request to the first sampled
         token is the first-token figure.

Times are medians with p90, min and max.  Absolute figures mean something
only on the GPU machine; on lavapipe the run checks that everything works.
"""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from vramd.bench.handover import percentile

MODES = ("on-demand", "resident")
PROMPT_TEXT = "Describe this picture in one sentence."


# -- inputs ----------------------------------------------------------------------

def _jpeg(seed: int, width: int = 640, height: int = 480) -> bytes:
    """A photo-sized JPEG (a gradient with seeded noise): decoding and resizing
    it costs what a camera picture of that size costs."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    pixels = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def _image_request(seed: int):
    """A chat request with one image and a question, one token wanted, greedy."""
    from vramd.server.openai_api import parse_request
    uri = "data:image/jpeg;base64," + base64.b64encode(_jpeg(seed)).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                      {"type": "text", "text": PROMPT_TEXT}]}],
            "max_tokens": 1, "temperature": 0}
    return parse_request("chat", json.dumps(body).encode(), set())


def _text_request():
    from vramd.server.openai_api import parse_request
    body = {"messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": 1, "temperature": 0}
    return parse_request("chat", json.dumps(body).encode(), set())


# -- one request -------------------------------------------------------------------

def _first_token(engine, req) -> dict:
    """Run `req` as the daemon's generation job does, stopping at the first
    sampled token; the times from the request's start."""
    first: list[float] = []

    def emit(piece) -> bool:
        first.append(time.perf_counter())
        return False   # cancel: the first token is all that is timed

    t0 = time.perf_counter()
    ids, embeds = engine.prompt(req.prompt_input())
    t1 = time.perf_counter()
    engine.generate(ids, req.sampling(), emit, embeds)
    return {"first_token_s": first[0] - t0, "prompt_s": t1 - t0, "prefill_s": first[0] - t1,
            "prompt_tokens": len(ids), "image_tokens": len(embeds),
            "finite": all(bool(np.isfinite(row).all()) for row in embeds.values())}


def _timed_phases(engine, encoder, req) -> dict:
    """An image request with the encoder's upload waited for, so its phases time apart."""
    encoder.wait_for_restore = True
    try:
        r = _first_token(engine, req)
    finally:
        encoder.wait_for_restore = False
    p = encoder.last_phases
    return {**r, "restore_s": p["restore_s"], "encode_s": p["encode_s"], "release_s": p["release_s"],
            "restore_bytes": p["restore_bytes"], "evicted_weights": p["evicted_weights"]}


# -- one mode ------------------------------------------------------------------------

def _text_path(engine, encoder, residency) -> dict:
    """What a text request leaves on the device (the breakdown right after it)."""
    _first_token(engine, _text_request())
    breakdown = residency.breakdown()
    return {"breakdown": breakdown, "device_bytes": sum(v["device"] for v in breakdown.values()),
            "encoder_device_bytes": breakdown["encoder"]["device"],
            "encoder_act_device_bytes": encoder.act.info()["device"]}


def _spread_ms(values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    return {"median": statistics.median(ms), "p90": percentile(ms, 90), "min": min(ms), "max": max(ms)}


def measure_mode(mode: str, engine, encoder, residency, reps: int, log) -> dict:
    encoder.resident = mode == "resident"
    seed = 1000 * (MODES.index(mode) + 1)
    log(f"{mode}: a warm-up image request, then a text request")
    _first_token(engine, _image_request(seed))            # warm-up (resident: the encoder stays from here)
    text = _text_path(engine, encoder, residency)
    log(f"{mode}: the text path holds {text['device_bytes']} bytes on the device, "
        f"{text['encoder_device_bytes']} of them the encoder's")
    rows = []
    for i in range(reps):
        phased = _timed_phases(engine, encoder, _image_request(seed + 2 * i + 1))
        peak = engine.stats["image_peak_bytes"]        # the most this process held while encoding
        served = _first_token(engine, _image_request(seed + 2 * i + 2))
        rows.append({"phased": phased, "served": served, "peak": max(peak, engine.stats["image_peak_bytes"])})
        log(f"  {mode}: restore {phased['restore_s'] * 1e3:.2f} ms, encode {phased['encode_s'] * 1e3:.2f} ms, "
            f"release {phased['release_s'] * 1e3:.2f} ms; first token {served['first_token_s'] * 1e3:.1f} ms")
    ph = [r["phased"] for r in rows]
    sv = [r["served"] for r in rows]
    return {
        "restore_ms": _spread_ms([r["restore_s"] for r in ph]),
        "encode_ms": _spread_ms([r["encode_s"] for r in ph]),
        "release_ms": _spread_ms([r["release_s"] for r in ph]),
        "first_token_ms": _spread_ms([r["first_token_s"] for r in sv]),
        "prompt_ms": _spread_ms([r["prompt_s"] for r in sv]),     # image decode + encoder session
        "prefill_ms": _spread_ms([r["prefill_s"] for r in sv]),   # prefill + first sample
        "first_token_phased_ms": _spread_ms([r["first_token_s"] for r in ph]),
        "restore_bytes": [r["restore_bytes"] for r in ph],
        "evicted_weights": any(r["evicted_weights"] for r in ph),
        "prompt_tokens": sv[0]["prompt_tokens"], "image_tokens": sv[0]["image_tokens"],
        "embeddings_finite": all(r["finite"] for r in ph + sv),
        "image_peak_bytes": max(r["peak"] for r in rows),
        "text_path": text,
    }


# -- the run -------------------------------------------------------------------------

def _backbone_shape(name: str):
    """7b / 8b: the presets of vramd/bench/models.py; small: a two-layer llama
    128 wide, because on lavapipe prefilling an image's positions through
    bench decode's 64 MB "small" model takes seconds per request."""
    from vramd.bench.models import LlamaShape
    if name == "small":
        return LlamaShape(n_embd=128, n_ff=384, n_head=4, n_head_kv=2, n_layer=2, n_vocab=1024)
    return LlamaShape.preset(name)


def run(shape: str, backbone: str, wtype: str, reps: int, ctx: int, log=lambda s: None) -> dict:
    from vramd.bench.models import write_model
    from vramd.bench.vision_models import VisionShape, write_llava_mmproj
    from vramd.engine.arch import spec_for
    from vramd.engine.runner import Engine
    from vramd.engine.scratch import scratch_layout
    from vramd.engine.vision import VisionEncoder
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf

    lm_shape = _backbone_shape(backbone)
    vision = VisionShape.preset(shape, n_embd_text=lm_shape.n_embd)   # the projector feeds the backbone
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-encode-", dir=base) as tmp:
        t0 = time.perf_counter()
        lm_path = str(write_model(Path(tmp) / "lm.gguf", lm_shape, wtype=wtype, fill="zeros"))
        mm_path = str(write_llava_mmproj(Path(tmp) / "mmproj.gguf", vision))
        log(f"files written in {time.perf_counter() - t0:.1f} s")
        mf = validate_gguf(lm_path)
        cfg = spec_for(mf)
        with Device() as dev, Residency(dev) as res:
            t0 = time.perf_counter()
            lm = loader.load(lm_path, res, ctx, mf=mf, scratch=scratch_layout(cfg))
            encoder = VisionEncoder(mm_path, res, name="bench/mmproj")
            log(f"loaded in {time.perf_counter() - t0:.1f} s on {dev.name}")
            try:
                res.restore(["weights", "state"])
                engine = Engine(lm, res, ctx, encoder=encoder)
                try:
                    encoder_bytes = encoder.region.info()["bytes"]
                    link = res.link_probe(encoder_bytes, max(reps, 3))
                    log(f"link H2D {link['h2d_gbps']:.2f} GB/s over {encoder_bytes} bytes")
                    modes = {m: measure_mode(m, engine, encoder, res, reps, log) for m in MODES}
                finally:
                    engine.close()
                device = dev.name
                out = _report(shape, backbone, wtype, reps, ctx, vision, encoder, lm_shape, mf, link, modes)
            finally:
                encoder.close()
    out["device"] = device
    return out


def _report(shape, backbone, wtype, reps, ctx, vision, encoder, lm_shape, mf, link, modes) -> dict:
    encoder_bytes = encoder.region.info()["bytes"]
    link_ms = encoder_bytes / (link["h2d_gbps"] * 1e9) * 1e3
    for m in modes.values():
        # Resident, the restore copies nothing: no ratio to the link.
        m["restore_over_link"] = m["restore_ms"]["median"] / link_ms if any(m["restore_bytes"]) else None
    cfg = encoder.cfg
    return {
        "encoder": {"shape": shape, "image_size": cfg.image_size, "patch_size": cfg.patch_size,
                    "n_embd": cfg.n_embd, "n_head": cfg.n_head, "n_ff": cfg.n_ff, "n_layer": cfg.n_layer,
                    "n_layer_run": cfg.n_layer_run, "n_embd_text": encoder.info.n_embd_text,
                    "weight_type": vision.weight_type, "image_tokens": encoder.n_tokens,
                    "file_bytes": vision.file_bytes(), "bytes": encoder_bytes,
                    "act_bytes": encoder.act.info()["bytes"]},
        "backbone": {"shape": backbone, "type": wtype, "n_layer": lm_shape.n_layer, "n_embd": lm_shape.n_embd,
                     "weight_bytes": sum(t.nbytes for t in mf.tensors)},
        "reps": reps, "ctx": ctx,
        "link": {"h2d_gbps": link["h2d_gbps"], "h2d_best_gbps": link["h2d_best_gbps"], "bytes": encoder_bytes,
                 "encoder_bytes_over_link_ms": link_ms},
        "modes": modes,
        "text_path_freed_bytes": (modes["resident"]["text_path"]["device_bytes"]
                                  - modes["on-demand"]["text_path"]["device_bytes"]),
    }


# -- the command ----------------------------------------------------------------------

def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"


def _print_text(r: dict) -> None:
    e, b, link, od, rs = r["encoder"], r["backbone"], r["link"], r["modes"]["on-demand"], r["modes"]["resident"]
    click.echo(f"encoder {e['shape']}: {e['n_layer']} layers ({e['n_layer_run']} run) x {e['n_embd']}, "
               f"{e['image_size']} px / {e['patch_size']}, {e['image_tokens']} image tokens, "
               f"{_size(e['bytes'])} (+ {_size(e['act_bytes'])} activations); backbone {b['shape']} "
               f"{b['type']} ({_size(b['weight_bytes'])}) on {r['device']}")
    click.echo(f"link H2D {link['h2d_gbps']:.2f} GB/s: encoder bytes / link = "
               f"{link['encoder_bytes_over_link_ms']:.2f} ms")
    click.echo(f"{'median (p90) ms':<30}{'on-demand':>20}{'resident':>20}")
    for key, label in (("restore_ms", "restore"), ("encode_ms", "encode"), ("release_ms", "release"),
                       ("first_token_ms", "first token (image request)"), ("prefill_ms", "  of which prefill")):
        cells = "".join(f"{m[key]['median']:>11.2f} ({m[key]['p90']:.2f})".rjust(20) for m in (od, rs))
        click.echo(f"{label:<30}{cells}")
    click.echo(f"{'restore / (bytes / link)':<30}{od['restore_over_link']:>20.2f}{'-':>20}")
    click.echo(f"{'text path: encoder on device':<30}{od['text_path']['encoder_device_bytes']:>20,}"
               f"{rs['text_path']['encoder_device_bytes']:>20,}")
    click.echo(f"{'text path: all on device':<30}{od['text_path']['device_bytes']:>20,}"
               f"{rs['text_path']['device_bytes']:>20,}")
    click.echo(f"VRAM freed on the text path by on-demand: {_size(r['text_path_freed_bytes'])}")


@click.command(name="encode")
@click.option("--shape", type=click.Choice(["vit-l", "small"]), default="vit-l", show_default=True,
              help="Synthetic encoder: vit-l is CLIP ViT-L/14 at 336 px with LLaVA's projector (~0.6 GB F16); "
                   "small runs on lavapipe in seconds.")
@click.option("--backbone", type=click.Choice(["7b", "8b", "small"]), default=None,
              help="Synthetic llama backbone (weights zero) [default: 7b for vit-l (LLaVA-1.5-7B's), "
                   "small for small].")
@click.option("--type", "wtype", type=click.Choice(["F16", "Q8_0", "Q4_0", "Q4_K", "F32"]), default="F16",
              show_default=True, help="Weight type of the backbone.")
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Image requests timed per mode (each twice: phases apart, then as served).")
@click.option("--ctx", type=click.IntRange(min=16), default=None,
              help="Context [default: 1024 for vit-l, 128 for small].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of text.")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the result as JSON to this file.")
def command(shape, backbone, wtype, reps, ctx, as_json, json_out):
    """An image request's encoder restore, encode, release and first token, on demand and resident."""
    backbone = backbone or ("7b" if shape == "vit-l" else "small")
    ctx = ctx or (1024 if shape == "vit-l" else 128)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if as_json else click.echo
    r = run(shape, backbone, wtype, reps, ctx, log)
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=2))
    else:
        _print_text(r)


if __name__ == "__main__":
    command()

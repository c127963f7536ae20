"""`vramd bench decode`: batch-1 decode and prefill speed, next to the memory-bandwidth roofline.

The model is a GGUF file (`--model`) or a synthetic llama of a named shape
(`--shape 8b`, weights zero in a sparse file: the speed of a matrix-vector
product does not depend on the values; `--shape qwen35-27b|qwen35moe-35b-a3b|
gptoss-20b` the 2026 models', vramd/bench/arch_models.py, MoE ones through
vramd/bench/moe.py's report).  In one process: load, restore,
prefill `--prompt` tokens (timed), then decode `--tokens` tokens one at a
time, greedy (each timed).  The roofline of one decode step is the bytes it
must read — every weight once, plus the K and V rows attended to — divided
by the device's memory bandwidth, and the report gives the measured rate as
a fraction of it.  The bandwidth is `--bandwidth` (GB/s), else the spec
sheet's for a device named in KNOWN_BANDWIDTH (the H200: 4800); on any other
device there is no roofline (null in the JSON) rather than another GPU's.

Decode replays one recorded step per token (vramd/engine/model.py).  With
`--profile`, after the timed tokens, `--profile-steps` more tokens are decoded
with a GPU timestamp after every dispatch (vramd/gpu/timing.py): the report
adds the GPU time per kernel and shape summed over a step (median over the
steps), the weight bytes each matvec reads and so its GB/s, and the GPU time
of a whole step against the wall time of one (the rest is host work and
submission).  The profiled tokens are not in the decode rate.

With `--profile-prefill`, at the end the first prefill chunk (min(--prompt,
the model's chunk size) tokens at positions 0.., which rewrites those K/V rows
with the same values) runs `--profile-steps` more times with a timestamp after
every dispatch of its one command buffer (Ops.timer): the report adds the same
table for a chunk (`prefill_profile`), with each matmul's TFLOP/s (2 x rows x
cols x tokens over its time) where the label gives the shape.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from vramd.bench.arch_models import PRESETS, scale_options, synthetic


# Device name (a substring of Vulkan's) -> memory bandwidth in GB/s, from the vendor's spec sheet.
KNOWN_BANDWIDTH = {"H200": 4800.0}


def device_bandwidth(device_name: str, given: float | None) -> tuple[float | None, str]:
    """(GB/s, where it comes from) for the roofline: --bandwidth, the spec sheet, or none."""
    if given is not None:
        return given, "--bandwidth"
    for key, gbps in KNOWN_BANDWIDTH.items():
        if key in device_name:
            return gbps, f"the {key}'s spec sheet"
    return None, "unknown for this device: pass --bandwidth GB/s"


def run(model: str | None, shape: str, wtype: str, prompt: int, tokens: int, ctx: int, bandwidth: float | None,
        profile_steps: int = 0, prefill_steps: int = 0) -> dict:
    from vramd.bench.models import LlamaShape, write_model
    from vramd.engine.model import TransformerModel
    from vramd.engine.arch import spec_for
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.gpu.timing import Timestamps, summarize
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-decode-", dir=base) as tmp:
        path = model or str(write_model(Path(tmp) / "model.gguf", LlamaShape.preset(shape) if shape != "small"
                                        else LlamaShape.for_bytes(64 << 20), wtype=wtype, fill="zeros"))
        mf = validate_gguf(path)
        cfg = spec_for(mf)   # a dense model (MoE models go through vramd.bench.moe)
        with Device() as dev, Residency(dev) as res:
            t0 = time.monotonic()
            lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(cfg))
            load_s = time.monotonic() - t0
            t0 = time.monotonic()
            res.restore(["weights", "state"])
            restore_s = time.monotonic() - t0
            m = TransformerModel(lm, res, ctx, lm.scratch, spec=cfg)
            try:
                rng = np.random.default_rng(0)
                ids = [int(x) for x in rng.integers(3, cfg.n_vocab, prompt)]
                m.forward(ids[:16], 0)    # warm-up: pipelines compiled, scratch and the chunk batch allocated
                # (16 > model.REPLAY_TOKENS: the prefill path, not a replayed step, is what gets warm)
                t0 = time.monotonic()
                logits = m.forward(ids, 0)
                prefill_s = time.monotonic() - t0
                steps = []
                pos = len(ids)
                for _ in range(tokens):
                    tok = int(np.argmax(logits))
                    t0 = time.monotonic()
                    logits = m.forward([tok], pos)
                    steps.append(time.monotonic() - t0)
                    pos += 1
                profile = None
                if profile_steps and hasattr(m, "profile"):
                    timer = Timestamps(dev)
                    try:
                        m.profile(timer)
                        timed, walls = [], []
                        for _ in range(profile_steps):
                            tok = int(np.argmax(logits))
                            t0 = time.monotonic()
                            logits = m.forward([tok], pos)
                            walls.append(time.monotonic() - t0)
                            timed.append(timer.read())
                            pos += 1
                        m.profile(None)
                        profile = summarize(timed)
                        profile["wall_ms_per_step"] = statistics.median(walls) * 1000
                        profile["truncated"] = timer.truncated
                        profile["by_kernel"] = _by_kernel(profile["kernels"])
                    finally:
                        timer.close()
                prefill_profile = _profile_prefill(m, dev, ids, prefill_steps) if prefill_steps else None
            finally:
                m.close()
            device = dev.name
    weight_bytes = sum(t.nbytes for t in mf.tensors)
    mid_pos = prompt + tokens / 2
    # K and V rows (f16) of every attention layer up to its window; a DeltaNet layer (qwen35)
    # reads and writes its f32 state [hv, s, s] instead
    net = getattr(cfg, "deltanet", None)
    bytes_per_token = weight_bytes + sum(
        2 * 4 * net.hv * net.s * net.s if layer.recurrent else
        2 * cfg.kv_width * 2 * (min(mid_pos, layer.window) if layer.window else mid_pos) for layer in cfg.layers)
    step = statistics.median(steps)
    decode_tps = 1.0 / step
    bandwidth, bandwidth_from = device_bandwidth(device, bandwidth)
    roofline_tps = bandwidth * 1e9 / bytes_per_token if bandwidth else None
    types = sorted({t.type.name for t in mf.tensors})
    return {
        "device": device, "model": os.path.basename(path) if model else f"synthetic {shape} {wtype}",
        "types": types, "weight_bytes": weight_bytes, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
        "prompt_tokens": prompt, "decode_tokens": tokens, "ctx": ctx,
        "load_s": load_s, "restore_s": restore_s,
        "prefill_tps": prompt / prefill_s, "decode_tps": decode_tps, "decode_ms_p50": step * 1000,
        "decode_ms_p99": sorted(steps)[min(len(steps) - 1, int(0.99 * len(steps)))] * 1000,
        "bytes_per_token": bytes_per_token, "bandwidth_gbps": bandwidth, "bandwidth_from": bandwidth_from,
        "roofline_tps": roofline_tps, "roofline_ratio": decode_tps / roofline_tps if roofline_tps else None,
        **({"profile": profile} if profile is not None else {}),
        **({"prefill_profile": prefill_profile} if prefill_profile is not None else {}),
    }


def _profile_prefill(m, dev, ids: list[int], steps: int) -> dict:
    """The per-dispatch GPU time of the first prefill chunk of `ids`, over `steps` runs."""
    from vramd.engine.model import REPLAY_TOKENS
    from vramd.gpu.timing import Timestamps, summarize
    n = min(len(ids), m.batch)
    if n <= REPLAY_TOKENS or not m.replays_decode:
        # a replayed step is the decode profile's; host-routed layers split a chunk into several batches
        raise click.UsageError(f"--profile-prefill needs more than {REPLAY_TOKENS} prompt tokens and a model "
                               f"whose chunk is one command buffer (no host-routed layers)")
    timer = Timestamps(dev)
    timed, walls = [], []
    try:
        m.ops.timer = timer
        for _ in range(steps):
            before = timer.resets
            t0 = time.monotonic()
            m.forward(ids[:n], 0)
            walls.append(time.monotonic() - t0)
            if timer.resets - before != 1:   # each batch resets the pool: only the last would be read
                raise click.ClickException(f"--profile-prefill: the chunk ran as {timer.resets - before} command "
                                       f"buffers; the profile times a chunk recorded as one")
            timed.append(timer.read())
        truncated = timer.truncated
    finally:
        m.ops.timer = None
        timer.close()
    prof = summarize(timed)
    for k in prof["kernels"]:
        k["tflops"] = _tflops(k["kernel"], n, k["us"], k["dispatches"])
    prof.update(tokens=n, wall_ms_per_chunk=statistics.median(walls) * 1000, truncated=truncated,
                by_kernel=_by_kernel(prof["kernels"]))
    prof["gpu_ms_per_chunk"] = prof.pop("gpu_ms_per_step")
    return prof


def _tflops(label: str, n_tokens: int, us: float, dispatches: int = 1) -> float | None:
    """TFLOP/s of `dispatches` matmul_* dispatches labelled "kernel ROWSxCOLS" (Ops.matvec) over
    n_tokens that took `us` together, else None."""
    parts = label.split()
    # only matmul_*: the chunk's n tokens (a matvec here is the output head's one row)
    dims = parts[1].split("x") if len(parts) == 2 and parts[0].startswith("matmul") else []
    if len(dims) != 2 or not all(d.isdigit() for d in dims) or us <= 0:
        return None
    return 2 * int(dims[0]) * int(dims[1]) * n_tokens * dispatches / (us * 1e6)


def _by_kernel(kernels: list[dict]) -> list[dict]:
    """summarize()'s rows (labelled "kernel shape") summed per kernel name."""
    out: dict[str, dict] = {}
    for k in kernels:
        d = out.setdefault(k["kernel"].split()[0], {"kernel": k["kernel"].split()[0], "us": 0.0, "bytes": 0,
                                                     "dispatches": 0, "share": 0.0})
        d["us"] += k["us"]
        d["bytes"] += k["bytes"]
        d["dispatches"] += k["dispatches"]
        d["share"] += k["share"]
    for d in out.values():
        d["gbps"] = d["bytes"] / (d["us"] * 1e3) if d["bytes"] and d["us"] > 0 else None
    return sorted(out.values(), key=lambda d: -d["us"])


@click.command(name="decode")
@click.option("--model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A GGUF model; default: a synthetic llama of --shape.")
@click.option("--shape", type=click.Choice(["8b", "7b", "small", "moe30b", *PRESETS]), default="8b",
              show_default=True,
              help="Synthetic model shape; moe30b: qwen3moe with Qwen3-30B-A3B's shape (48 layers, 128 experts, "
                   "top-8, hidden 2048); qwen35-27b, qwen35moe-35b-a3b, gptoss-20b: the 2026 models' "
                   "(vramd/bench/arch_models.py).")
@click.option("--n-cpu-moe", "n_cpu_moe", default="0", show_default=True,
              help="MoE models: comma-separated --n-cpu-moe values to measure, e.g. 0,8,16.")
@click.option("--moe-layers", type=click.IntRange(min=1), default=None,
              help="moe30b: fewer layers than the shape's (a shorter run).")
@scale_options
@click.option("--type", "wtype", type=click.Choice(["F16", "Q8_0", "Q4_0", "Q4_K", "F32", "MXFP4"]), default="F16",
              show_default=True, help="Weight type of the synthetic model (MXFP4: gptoss-20b's experts, Q8_0 "
                                      "the rest; Q4_K on a qwen35 shape: output.weight Q6_K).")
@click.option("--prompt", type=click.IntRange(min=8), default=512, show_default=True, help="Prefill tokens.")
@click.option("--tokens", type=click.IntRange(min=1), default=32, show_default=True, help="Decoded tokens.")
@click.option("--ctx", type=click.IntRange(min=16), default=1024, show_default=True)
@click.option("--bandwidth", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Device memory bandwidth in GB/s for the roofline [the spec sheet's for a known device "
                   "(H200: 4800), else no roofline].")
@click.option("--profile", is_flag=True, help="Then time every kernel of a decode step on the GPU.")
@click.option("--profile-steps", type=click.IntRange(min=1), default=8, show_default=True,
              help="Decode steps timed per kernel with --profile (after the timed tokens).")
@click.option("--profile-prefill", is_flag=True,
              help="Then time every kernel of one prefill chunk on the GPU (--profile-steps runs).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of text.")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the result as JSON to this file (the text still goes to stdout).")
def command(model, shape, n_cpu_moe, moe_layers, layers, vocab, experts, wtype, prompt, tokens, ctx, bandwidth,
            profile, profile_steps, profile_prefill, as_json, json_out):
    """Batch-1 decode and prefill tokens/s, and the fraction of the bandwidth roofline."""
    if model is None and shape in PRESETS:
        if moe_layers is not None:
            raise click.UsageError(f"--moe-layers is moe30b's; {shape} takes --layers")
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="vramd-decode-", dir=base) as tmp:
            path = synthetic(tmp, shape, wtype, layers, vocab, experts)
            return command.callback(path, shape, n_cpu_moe, None, None, None, None, wtype, prompt, tokens, ctx,
                                    bandwidth, profile, profile_steps, profile_prefill, as_json, json_out)
    synthetic(".", shape if model is None else "a --model file", wtype, layers, vocab, experts)  # refuses them
    if wtype == "MXFP4" and model is None:
        raise click.UsageError("--type MXFP4 is gptoss-20b's (its experts)")
    if shape == "moe30b" or (model and _is_moe(model)):
        return moe_command(model, n_cpu_moe, moe_layers, wtype, prompt, tokens, ctx, as_json, json_out)
    extra = profile_steps if profile else 0
    if profile_prefill and prompt <= 8:
        raise click.UsageError("--profile-prefill needs --prompt above 8 (up to 8 tokens replay the decode step)")
    if prompt + tokens + extra > ctx:
        raise click.UsageError("--prompt + --tokens (+ --profile-steps with --profile) must fit in --ctx")
    r = run(model, shape, wtype, prompt, tokens, ctx, bandwidth, extra, profile_steps if profile_prefill else 0)
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"{r['model']} ({', '.join(r['types'])}, {r['weight_bytes'] / 2**30:.2f} GiB) on {r['device']}")
    click.echo(f"  prefill {r['prompt_tokens']} tokens: {r['prefill_tps']:.0f} tok/s")
    if r["roofline_tps"]:
        roofline = (f"roofline {r['roofline_tps']:.0f} tok/s at {r['bandwidth_gbps']:.0f} GB/s "
                    f"({r['bandwidth_from']}) -> {100 * r['roofline_ratio']:.1f} %")
    else:
        roofline = f"no roofline: the bandwidth is {r['bandwidth_from']}"
    click.echo(f"  decode: {r['decode_tps']:.1f} tok/s ({r['decode_ms_p50']:.2f} ms/token); {roofline}")
    p = r.get("profile")
    if p:
        click.echo(f"  profile ({p['steps']} steps): GPU {p['gpu_ms_per_step']:.3f} ms of "
                   f"{p['wall_ms_per_step']:.3f} ms per step")
        for k in p["kernels"]:
            gbps = f"{k['gbps']:8.1f} GB/s" if k["gbps"] else " " * 13
            click.echo(f"    {k['kernel']:<34} {k['dispatches']:5d} x  {k['us']:10.1f} us  {gbps}  "
                       f"{100 * k['share']:5.1f} %")
    p = r.get("prefill_profile")
    if p:
        click.echo(f"  prefill profile ({p['tokens']} tokens a chunk, {p['steps']} runs): GPU "
                   f"{p['gpu_ms_per_chunk']:.3f} ms of {p['wall_ms_per_chunk']:.3f} ms per chunk")
        for k in p["kernels"]:
            tf = f"{k['tflops']:7.2f} TFLOP/s" if k["tflops"] else " " * 14
            click.echo(f"    {k['kernel']:<34} {k['dispatches']:5d} x  {k['us']:10.1f} us  {tf}  "
                       f"{100 * k['share']:5.1f} %")


def _is_moe(path: str) -> bool:
    from vramd.engine.arch import spec_for
    from vramd.model.gguf_check import validate_gguf
    return spec_for(validate_gguf(path)).moe is not None


def moe_command(model, n_cpu_moe, moe_layers, wtype, prompt, tokens, ctx, as_json, json_out):
    """Decode speed and VRAM of a mixture-of-experts model for each --n-cpu-moe value."""
    from vramd.bench import moe
    from vramd.model.placement import parse_n_cpu_moe
    values = [parse_n_cpu_moe(v) for v in str(n_cpu_moe).split(",")]
    if "auto" in values:
        raise click.UsageError("--n-cpu-moe auto is not a measurement point: give numbers")
    if prompt + tokens + 4 > ctx:
        raise click.UsageError("--prompt + --tokens must fit in --ctx")
    r = moe.run(model, wtype, values, prompt, tokens, ctx, moe_layers)
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"{r['model']}: {r['n_layer']} layers, {r['n_expert']} experts (top-{r['n_used']}), "
               f"{r['weight_bytes'] / 2**30:.2f} GiB, on {r['device']}; host experts on "
               f"{r['host_threads']} CPU threads")
    for row in r["placements"]:
        click.echo(f"  --n-cpu-moe {row['n_cpu_moe']:<5g} VRAM {row['device_bytes'] / 2**30:7.2f} GiB  host experts "
                   f"{row['host_expert_bytes'] / 2**30:7.2f} GiB  decode {row['decode_tps']:7.2f} tok/s  "
                   f"prefill {row['prefill_tps']:7.1f} tok/s  GPU-routed layers {row['gpu_routed_layers']}"
                   + (" (decode replayed)" if row["decode_replayed"] else ""))


if __name__ == "__main__":
    command()

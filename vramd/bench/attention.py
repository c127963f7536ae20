"""`vramd bench attention`: the prefill attention kernels alone, by GPU timestamps.

Times Ops.attention over a prefill of each of `--tokens` tokens from position
0, in chunks of `--chunk` tokens (as the engine runs it: each chunk's queries
over the cache rows up to its last position), on an 8B llama's heads by
default (32 q heads, 8 KV heads, head_dim 128): the portable flash kernel
(Ops.flash: attention_flash or attention_flash_k32) and,
where the device runs it (vramd/engine/attention_cm.py), the tensor-core
attention_flash_cm_d<D>.  Each figure is the median over `--reps` passes of
the summed GPU time of a pass's dispatches (vramd/gpu/timing.py), after one
untimed pass; TFLOP/s counts 4 * head_dim flops per (q head, query, key it
sees).  Both kernels run on the same random q and caches, and the largest
difference of their outputs (the last chunk) is reported as a check.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import click
import numpy as np


def _flops(n: int, n_heads: int, hd: int, window: int) -> float:
    seen = np.arange(1, n + 1, dtype=np.float64)
    if window:
        seen = np.minimum(seen, window)
    return 4.0 * hd * n_heads * float(seen.sum())


def run(tokens, chunk: int, n_heads: int, n_kv: int, hd: int, reps: int, window: int = 0,
        softcap: float = 0.0) -> dict:
    from vramd.engine.ops import Ops, view
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.gpu.timing import Timestamps

    rng = np.random.default_rng(0)
    n_max, width = max(tokens), n_kv * hd
    rows, check = [], {}
    with Device() as dev, Residency(dev) as res:
        ops = Ops(res)
        cm = ops.flash_cm
        timer = Timestamps(dev)
        r = res.region("weights", "attnbench", {"q": 4 * n_max * n_heads * hd, "k": 2 * n_max * width,
                                                "v": 2 * n_max * width, "pos": 4 * n_max,
                                                "o0": 4 * n_max * n_heads * hd, "o1": 4 * n_max * n_heads * hd})
        r.restore()
        try:
            t = r.tensors
            t["q"].write(rng.standard_normal(n_max * n_heads * hd).astype(np.float32))
            t["k"].write(rng.standard_normal(n_max * width).astype(np.float16))
            t["v"].write(rng.standard_normal(n_max * width).astype(np.float16))
            t["pos"].write(np.arange(n_max, dtype=np.int32))
            qrow = 4 * n_heads * hd
            scale = 1.0 / np.sqrt(hd)
            kernels = [(ops.flash or "attention", False)] + ([("attention_flash_cm", True)] if cm else [])
            for n in tokens:
                outs = {}
                for name, on in kernels:
                    ops.flash_cm = on
                    out = t[f"o{int(on)}"]
                    ops.timer = timer
                    try:
                        with ops.batch():
                            for _ in range(reps + 1):
                                for c0 in range(0, n, chunk):
                                    m = min(chunk, n - c0)
                                    ops.attention(view(t["q"], c0 * qrow, m * qrow), t["k"], t["v"],
                                                  view(t["pos"], 4 * c0, 4 * m), view(out, c0 * qrow, m * qrow),
                                                  m, n_heads, n_kv, hd, c0 + m, scale, window=window,
                                                  softcap=softcap)
                        ops.sync()
                        ns = [x for _l, _b, x in timer.read()]
                    finally:
                        ops.timer = None
                    per = -(-n // chunk)
                    passes = [sum(ns[i:i + per]) for i in range(per, len(ns), per)]
                    s = statistics.median(passes) / 1e9
                    rows.append({"tokens": n, "kernel": name, "ms": s * 1e3,
                                 "tflops": _flops(n, n_heads, hd, window) / s / 1e12})
                    click.echo(f"n={n:<6} {name:<20} {s * 1e3:9.3f} ms {rows[-1]['tflops']:7.2f} TFLOP/s", err=True)
                    outs[on] = out.read(np.float32, 0, 4 * n * n_heads * hd)
                if cm:
                    check[n] = float(np.max(np.abs(outs[True] - outs[False])))
        finally:
            ops.flash_cm = cm
            r.destroy()
            timer.close()
            ops.close()
        device = dev.name
    return {"device": device, "flash_cm": cm, "chunk": chunk, "heads": [n_heads, n_kv, hd], "window": window,
            "softcap": softcap, "reps": reps, "max_abs_diff": check, "results": rows}


@click.command("attention")
@click.option("--tokens", default="512,2000,4096,8000", show_default=True, help="Prefill lengths, comma-separated.")
@click.option("--chunk", default=2048, show_default=True, help="Tokens a dispatch (the engine's prefill chunk).")
@click.option("--heads", default="32,8,128", show_default=True, help="q heads, KV heads, head_dim.")
@click.option("--window", default=0, show_default=True, help="Sliding window (0: full causal).")
@click.option("--softcap", default=0.0, show_default=True, help="Score soft-capping (0: none).")
@click.option("--reps", default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of text.")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the result as JSON to this file.")
def command(tokens, chunk, heads, window, softcap, reps, as_json, json_out):
    """Prefill attention kernels alone (portable and tensor-core): GPU ms and TFLOP/s."""
    try:
        tl = [int(x) for x in tokens.split(",")]
        n_heads, n_kv, hd = (int(x) for x in heads.split(","))
    except ValueError:
        raise click.UsageError(f"--tokens {tokens!r} / --heads {heads!r}: comma-separated numbers") from None
    if min(tl) < 2 or chunk < 2 or n_kv < 1 or n_heads % n_kv or hd % 2 or hd > 256 or reps < 1:
        raise click.UsageError("--tokens, --chunk: 2 or more; --heads: q heads a multiple of KV heads, "
                               "head_dim even and at most 256; --reps: 1 or more")
    r = run(tl, chunk, n_heads, n_kv, hd, reps, window, softcap)
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=1) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=1))
        return
    click.echo(f"{r['device']} (tensor-core attention: {r['flash_cm']}), heads {heads}, chunk {chunk}, "
               f"median of {reps}")
    for x in r["results"]:
        click.echo(f"  n={x['tokens']:<6} {x['kernel']:<20} {x['ms']:9.3f} ms {x['tflops']:7.2f} TFLOP/s")
    for n, d in r["max_abs_diff"].items():
        click.echo(f"  check n={n}: max |cm - portable| {d:.2e}")

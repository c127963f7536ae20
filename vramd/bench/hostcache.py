"""`vramd bench hostcache`: what the host prompt cache's save and restore cost against the prefill they save.

On a GGUF file (`--model`) or the synthetic "small" llama (64 MiB of zero weights,
vramd/bench/models.py), loaded as `vramd serve` loads it: per length of `--lengths`, the
prompt is prefilled from position 0 (`--reps` timed forward passes after one warm-up), then
vramd/server/hostcache.py's HostCache saves the sequence (its K/V rows of every layer to host
memory) and restores it (`--reps` each, timed).  A restore serves the prompt instead of its
prefill: the report says how many times quicker it is, and the bytes one sequence takes.
Results and the command go to docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from vramd.bench.prefill import parse_lengths, prompt_ids


def measure(path: str, lengths: list[int], reps: int) -> dict:
    from vramd.engine.arch import spec_for
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import buffer_cap, chunk_tokens, scratch_layout
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf
    from vramd.server.hostcache import HostCache
    mf = validate_gguf(path)
    spec = spec_for(mf)
    ctx = max(lengths) + 16
    ids = prompt_ids(spec.n_vocab, max(lengths))
    rows = []
    with Device() as dev, Residency(dev) as res:
        cap = buffer_cap(res.limits)
        tokens = chunk_tokens(spec, None, cap)
        lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(spec, tokens, cap=cap))
        res.restore(["weights", "state"])
        m = TransformerModel(lm, res, ctx, lm.scratch, tokens, spec=spec)
        engine = SimpleNamespace(model=m, cached=[])
        try:
            if not HostCache.usable(engine):
                raise click.UsageError(f"{path}: a recurrent model (the host cache keeps no entries for it)")
            for n in lengths:
                m.forward(ids[:n], 0)
                prefill, save, restore = [], [], []
                for _ in range(reps):
                    t0 = time.monotonic()
                    m.forward(ids[:n], 0)
                    prefill.append(time.monotonic() - t0)
                cache = HostCache(1 << 40)
                for _ in range(reps):
                    cache.entries.clear()
                    t0 = time.monotonic()
                    cache._save(engine, list(ids[:n]), keep=None)
                    save.append(time.monotonic() - t0)
                key = next(iter(cache.entries))
                for _ in range(reps):
                    t0 = time.monotonic()
                    cache._restore(engine, key, n)
                    restore.append(time.monotonic() - t0)
                p, s, r = (statistics.median(x) for x in (prefill, save, restore))
                rows.append({"tokens": n, "prefill_s": p, "save_s": s, "restore_s": r, "bytes": cache.bytes(),
                             "restore_vs_prefill": p / r})
        finally:
            m.close()
        device = dev.name
    return {"device": device, "model": path, "rows": rows}


@click.command()
@click.option("--model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A GGUF model (not recurrent); default: the synthetic small llama (zero weights).")
@click.option("--lengths", default="128,512,2000", show_default=True, help="Prompt lengths, comma-separated.")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(model, lengths, reps, as_json):
    """The host prompt cache's save/restore against the prefill it saves."""
    from vramd.bench.models import LlamaShape, write_model
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-hostcache-", dir=base) as tmp:
        path = model or str(write_model(Path(tmp) / "model.gguf", LlamaShape.for_bytes(64 << 20), fill="zeros"))
        out = measure(path, parse_lengths(lengths), reps)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"device {out['device']}")
    click.echo(f"{'tokens':>7} {'prefill ms':>11} {'save ms':>8} {'restore ms':>11} {'MiB':>7} {'restore/prefill':>16}")
    for r in out["rows"]:
        click.echo(f"{r['tokens']:>7} {r['prefill_s'] * 1e3:>11.1f} {r['save_s'] * 1e3:>8.1f} "
                   f"{r['restore_s'] * 1e3:>11.1f} {r['bytes'] / 2**20:>7.2f} {r['restore_vs_prefill']:>15.1f}x")

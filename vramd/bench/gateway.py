"""`vramd bench gateway`: what `vramd gateway` adds per request and per streamed token, on loopback.

One daemon (`vramd serve`, a small synthetic llama model) and one gateway
(`vramd gateway`), each its own process, in a fresh arena.  The same requests
go to the daemon directly and through the gateway, interleaved (direct,
gateway, direct, ...) so that drift in the daemon's speed falls on both:

- per request: a non-streamed completion of one token; the added latency is
  each gateway request's time less the direct one next to it;
- per streamed token: a streamed completion of --tokens tokens, greedy (the
  same tokens both ways); the added time per token is the pair's difference in
  total time divided by the tokens, and the first chunk's added delay is shown
  beside it.

Goal: p50 added per request <= 1 ms.
"""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from vramd.bench.handover import percentile
from vramd.bench.switch import Served
from vramd.errors import VramdError


def start_gateway(arena: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "vramd.cli", "gateway", "--arena", str(arena), "--port", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    # --log-level warning hides the "serving" line: find the port from the process's listening socket.
    import psutil
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VramdError(f"gateway benchmark: the gateway exited:\n{''.join(lines)}")
        conns = [c for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        if conns:
            return proc, f"127.0.0.1:{conns[0].laddr.port}"
        time.sleep(0.05)
    proc.kill()
    raise VramdError("gateway benchmark: the gateway did not listen within 60 s")


def post(hostport: str, body: dict, stream: bool) -> tuple[float, float | None, int]:
    """(seconds to the whole reply, seconds to the first chunk, chunks) of one request."""
    host, port = hostport.rsplit(":", 1)
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise VramdError(f"gateway benchmark: {hostport} answered {resp.status}: {resp.read()[:300]!r}")
        first, chunks = None, 0
        if not stream:
            resp.read()
        else:
            while line := resp.readline():
                if line.startswith(b"data: {"):
                    chunks += 1
                    first = first or time.perf_counter() - t0
        return time.perf_counter() - t0, first, chunks
    finally:
        conn.close()


def summary(xs: list[float], scale: float = 1e3) -> dict:
    return {"p50": round(statistics.median(xs) * scale, 3), "p99": round(percentile(xs, 99) * scale, 3),
            "mean": round(statistics.fmean(xs) * scale, 3)}


def measure(requests: int, streams: int, tokens: int) -> dict:
    from vramd.bench.models import LlamaShape, write_model
    with tempfile.TemporaryDirectory(prefix="vramd-bench-gateway-") as tmp:
        model = write_model(Path(tmp) / "m.gguf", LlamaShape(n_embd=128, n_ff=256, n_head=4, n_head_kv=4,
                                                              n_layer=2, n_vocab=512), wtype="F16", fill="random",
                            name="bench-gateway")
        arena = Path(tmp) / "arena"
        d = Served(arena, model, "m", ctx=tokens + 64, residency="cache")
        gw = None
        try:
            d.wait_ready()
            endpoint = d.ask("status")["endpoint"].removeprefix("http://")
            gw, via = start_gateway(arena)
            one = {"model": "m", "prompt": "the", "max_tokens": 1, "temperature": 0}
            many = {"model": "m", "prompt": "the", "max_tokens": tokens, "temperature": 0, "stream": True,
                    "stop": []}
            for target in (endpoint, via):   # warm both paths (the first request takes the GPU)
                post(target, one, False)
            direct, gated, added = [], [], []
            for _ in range(requests):
                t_d = post(endpoint, one, False)[0]
                t_g = post(via, one, False)[0]
                direct.append(t_d), gated.append(t_g), added.append(t_g - t_d)
            per_token, first_added, n_chunks = [], [], set()
            for _ in range(streams):
                td, fd, cd = post(endpoint, many, True)
                tg, fg, cg = post(via, many, True)
                n_chunks |= {cd, cg}
                per_token.append((tg - td) / max(1, cg))
                first_added.append(fg - fd)
            return {"requests": requests, "streams": streams, "tokens": tokens, "chunks": sorted(n_chunks),
                    "request_direct_ms": summary(direct), "request_gateway_ms": summary(gated),
                    "request_added_ms": summary(added), "stream_added_per_token_ms": summary(per_token),
                    "stream_first_chunk_added_ms": summary(first_added)}
        finally:
            if gw is not None and gw.poll() is None:
                gw.terminate()
                gw.wait(30)
            d.stop()


@click.command()
@click.option("--requests", type=click.IntRange(min=10), default=400, show_default=True,
              help="Non-streamed one-token requests each way.")
@click.option("--streams", type=click.IntRange(min=2), default=40, show_default=True,
              help="Streamed requests each way.")
@click.option("--tokens", type=click.IntRange(min=2, max=4096), default=64, show_default=True,
              help="Tokens per streamed request.")
@click.option("--json", "as_json", is_flag=True)
def command(requests, streams, tokens, as_json):
    """Added latency of the gateway: per request and per streamed token (p50/p99, loopback)."""
    r = measure(requests, streams, tokens)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    for key, label in (("request_direct_ms", "request, direct"), ("request_gateway_ms", "request, gateway"),
                       ("request_added_ms", "added per request"),
                       ("stream_added_per_token_ms", "added per streamed token"),
                       ("stream_first_chunk_added_ms", "added to the first chunk")):
        s = r[key]
        click.echo(f"{label:<26} p50 {s['p50']:8.3f} ms   p99 {s['p99']:8.3f} ms   mean {s['mean']:8.3f} ms")
    verdict = "met" if r["request_added_ms"]["p50"] <= 1.0 else "MISSED"
    click.echo(f"goal: <= 1 ms added per request (p50): {verdict}  "
               f"({requests} requests and {streams} streams of {tokens} tokens each way, interleaved)")

"""`vramd bench parallel`: decode throughput of k concurrent streams, vramd vs llama.cpp (issue 16).

The model is a GGUF file (`--model`) or a synthetic one of `--shape`/`--type` (zero weights in a
sparse file, made as `vramd bench prefill` makes them: prefill.model_file).  For each stream
count k of `--streams`, both servers run side by side on the same file:

  vramd      `vramd serve --parallel k --ctx C` (switch.Served: its own arena, quantum 0); C, a
             sequence's positions, is prompt + tokens + 16;
  llama.cpp  `llama-server -ngl 99 -fa on -np k -c k*C` (its -c is shared by the slots, so each
             gets C), the binary of llama_binary.llama_server_binary() unless `--peer` names one.

Each round sends k concurrent streamed POST /v1/completions (one thread each, raw HTTP) with
distinct prompts of `--prompt` random token ids (both servers take a list of ids, so both
engines see the same tokens; a new set each round, so no prefix cache is hit), max_tokens
`--tokens`, ignore_eos, temperature 0, and the sampler pinned by a logit bias to the plain "a"
token where the vocabulary has one (zero weights pick lone byte tokens otherwise, whose invalid
UTF-8 llama-server holds back: one SSE chunk per token only with valid text).  Every streamed
token is timestamped as it arrives (a chunk without a finish_reason is a token).  One untimed
warm-up round per server (the k-sequence step recorded), then `--reps` rounds, the engines
alternating which goes first so drift hits both.

Per round and engine:
  aggregate_tps  decode tokens/s over the window where all k streams decode: from the latest
                 first token to the earliest last token, the tokens of all streams that arrive
                 in it over its length (None when the streams did not overlap: a server that
                 serves them one after another);
  overall_tps    all completion tokens / the round's wall time (first request sent to last
                 stream ended: prefill and queueing included);
  itl_p50_ms / itl_p90_ms  inter-token gaps of every stream pooled;  ttft_p50_ms  median time
                 from a stream's request to its first token.
The report is the median over the rounds of each, and vramd / llama.cpp of the aggregate and
overall rates (> 1: vramd is faster).  `--json` prints everything.  docs/benchmarks.md records
results and commands.

`stream_completion` (one timestamped streamed request) is shared with `vramd bench pause`.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import click

from vramd.bench.handover import percentile
from vramd.errors import UsageError

ENGINES = ("vramd", "llama.cpp")
PEER_FLAGS = ("-ngl", "99", "-fa", "on")


def parse_streams(text: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(not 1 <= k <= 64 for k in out):
        raise UsageError(f"--streams {text!r}: stream counts 1..64, comma-separated (e.g. 1,4,8,16)")
    return out


def stream_completion(url: str, body: dict, timeout: float = 3600, count: list | None = None) -> dict:
    """POST body (streamed) to url (…/v1/completions): {"sent": monotonic time of the request,
    "times": [monotonic time each token arrived], "text", "finish"}; an error chunk or status raised.
    count: [n], n kept equal to the tokens so far (another thread watches it)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    times: list[float] = []
    text: list[str] = []
    finish = None
    try:
        sent = time.monotonic()
        conn.request("POST", u.path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.monotonic()
            if not line.startswith(b"data: "):
                continue   # blank separators, keep-alive comments
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or ""
                text.append(piece)
                # A token's chunk has no finish_reason; a finish chunk with text carries the last token.
                if choice.get("finish_reason") is None or piece:
                    times.append(now)
                    if count is not None:
                        count[0] = len(times)
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
    finally:
        conn.close()
    return {"sent": sent, "times": times, "text": "".join(text), "finish": finish}


def concurrent_round(url: str, prompts: list[list[int]], tokens: int, extra: dict) -> dict:
    """len(prompts) streams at once; the round's figures (module header)."""
    k = len(prompts)
    results: list[dict | BaseException | None] = [None] * k
    go = threading.Barrier(k + 1)

    def one(i: int) -> None:
        go.wait()
        try:
            results[i] = stream_completion(url, {"prompt": prompts[i], "max_tokens": tokens, "temperature": 0,
                                                 "ignore_eos": True, **extra})
        except BaseException as e:   # raised below, in the caller's thread
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    go.wait()
    begin = time.monotonic()
    for t in threads:
        t.join()
    end = time.monotonic()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return figures(results, begin, end)


def figures(streams: list[dict], begin: float, end: float) -> dict:
    counts = [len(s["times"]) for s in streams]
    if min(counts) == 0:
        raise RuntimeError(f"a stream got no token (tokens per stream: {counts})")
    w0 = max(s["times"][0] for s in streams)
    w1 = min(s["times"][-1] for s in streams)
    in_window = sum(1 for s in streams for t in s["times"] if w0 < t <= w1)
    gaps = [(b - a) * 1000 for s in streams for a, b in zip(s["times"], s["times"][1:])]
    return {"tokens": sum(counts), "per_stream": counts, "wall_s": end - begin,
            "window_s": max(w1 - w0, 0.0), "window_tokens": in_window,
            "aggregate_tps": in_window / (w1 - w0) if w1 > w0 and in_window else None,
            "overall_tps": sum(counts) / (end - begin),
            "itl_p50_ms": statistics.median(gaps) if gaps else None,
            "itl_p90_ms": percentile(gaps, 90) if gaps else None,
            "ttft_p50_ms": statistics.median((s["times"][0] - s["sent"]) * 1000 for s in streams),
            "finishes": sorted({s["finish"] for s in streams}, key=str)}


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r[key] is not None]
    return statistics.median(vals) if len(vals) == len(runs) else None   # one round without: none


def summary(runs: list[dict]) -> dict:
    return {**{key: _median(runs, key) for key in ("aggregate_tps", "overall_tps", "itl_p50_ms", "itl_p90_ms",
                                                   "ttft_p50_ms")}, "runs": runs}


class _Vramd:
    def __init__(self, tmp: Path, path: str, k: int, ctx: int):
        from vramd.bench.switch import Served
        self.server = Served(tmp / f"arena-{k}", Path(path), "bench", ctx, "cache", ("--parallel", str(k)))
        try:
            self.server.wait_ready()
            status = self.server.ask("status")
        except BaseException:
            self.close()
            raise
        self.url = status["endpoint"] + "/v1/completions"
        self.device = status["device"]["name"]
        self.flags = ["--parallel", str(k), "--ctx", str(ctx)]

    def close(self) -> None:
        self.server.stop()


class _Llama:
    def __init__(self, tmp: Path, binary: str, path: str, k: int, ctx: int, threads: int | None):
        from vramd.bench.llama_server import LlamaServerProcess
        self.flags = [*PEER_FLAGS, "-np", str(k), "-c", str(k * ctx)] + (["-t", str(threads)] if threads else [])
        self.server = LlamaServerProcess(binary, path, self.flags, log=tmp / f"llama-server-{k}.log",
                                         start_timeout=600)
        self.url = f"http://127.0.0.1:{self.server.port}/v1/completions"

    def close(self) -> None:
        self.server.close()


def run(binary: str, model: str | None, shape: str, wtype: str, streams: list[int], prompt: int, tokens: int,
        reps: int, peer_threads: int | None) -> dict:
    from vramd.bench.llama_server import pinned_token
    from vramd.bench.prefill import model_file, prompt_ids
    from vramd.engine.arch import spec_for
    from vramd.model.gguf_check import validate_gguf
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    ctx = prompt + tokens + 16
    rows, device, flags = [], None, {}
    with tempfile.TemporaryDirectory(prefix="vramd-parallel-", dir=base) as tmp:
        tmp = Path(tmp)
        path = model_file(str(tmp), model, shape, wtype)
        mf = validate_gguf(path)
        n_vocab = spec_for(mf).n_vocab
        try:
            extra = {"logit_bias": {str(pinned_token(path)): 100}}
        except (ValueError, KeyError):   # no "a" token: unpinned (a model's own text is valid UTF-8)
            extra = {}
        for k in streams:
            def prompts(r: int) -> list[list[int]]:
                return [prompt_ids(n_vocab, prompt, seed=1 + 1000 * k + 64 * r + i) for i in range(k)]
            servers = {}
            try:
                servers["vramd"] = _Vramd(tmp, path, k, ctx)
                servers["llama.cpp"] = _Llama(tmp, binary, path, k, ctx, peer_threads)
                device = servers["vramd"].device
                for name, s in servers.items():   # warm-up: the k-sequence step recorded, pipelines built
                    concurrent_round(s.url, prompts(0), min(tokens, 8), extra)
                runs = {name: [] for name in ENGINES}
                for r in range(reps):
                    for name in (ENGINES if r % 2 == 0 else ENGINES[::-1]):
                        runs[name].append(concurrent_round(servers[name].url, prompts(r + 1), tokens, extra))
                flags = {name: s.flags for name, s in servers.items()}
            finally:
                for s in servers.values():
                    s.close()
            row = {"streams": k, **{name: summary(runs[name]) for name in ENGINES}, "flags": flags}
            for key in ("aggregate_tps", "overall_tps"):
                v, p = row["vramd"][key], row["llama.cpp"][key]
                row[f"ratio_{key.removesuffix('_tps')}"] = v / p if v and p else None
            rows.append(row)
        types = sorted({t.type.name for t in mf.tensors})
    return {"device": device, "model": os.path.basename(model) if model else f"synthetic {shape} {wtype}",
            "types": types, "weight_bytes": sum(t.nbytes for t in mf.tensors), "prompt_tokens": prompt,
            "tokens": tokens, "reps": reps, "ctx_per_stream": ctx, "peer": binary, "pinned": bool(extra),
            "rows": rows}


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


@click.command(name="parallel")
@click.option("--peer", default=None, help="llama-server to compare with: a path or a command [the oracle's: "
              "$VRAMD_LLAMA_SERVER, the native build, llama-server-vulkan (vramd/bench/llama_binary.py)].")
@click.option("--model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A GGUF model; default: a synthetic llama of --shape and --type (zero weights).")
@click.option("--shape", type=click.Choice(["8b", "7b", "small"]), default=None, help="Synthetic model shape [8b].")
@click.option("--type", "wtype", type=click.Choice(["F16", "Q8_0", "Q4_K", "Q4_0"]), default=None,
              help="Weight type of the synthetic model [Q4_K].")
@click.option("--streams", default="1,4,8,16", show_default=True, help="Concurrent stream counts, each a run.")
@click.option("--prompt", type=click.IntRange(min=1), default=128, show_default=True, help="Prompt tokens a stream.")
@click.option("--tokens", type=click.IntRange(min=2), default=128, show_default=True,
              help="Tokens each stream generates (ignore_eos).")
@click.option("--reps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed rounds per count and engine (after one warm-up); the median is reported.")
@click.option("--peer-threads", type=click.IntRange(min=1), default=None, help="llama-server -t [its default].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of text.")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the result as JSON to this file.")
def command(peer, model, shape, wtype, streams, prompt, tokens, reps, peer_threads, as_json, json_out):
    """Aggregate decode tokens/s of k concurrent streams, vramd --parallel k vs llama-server -np k."""
    from vramd.bench.llama_binary import llama_server_binary
    from vramd.bench.llama_server import find_binary
    if model and (shape or wtype):
        raise UsageError("give --model or --shape/--type (a synthetic model), not both")
    ks = parse_streams(streams)
    binary = find_binary(peer) if peer else llama_server_binary().path
    r = run(binary, model, shape or "8b", wtype or "Q4_K", ks, prompt, tokens, reps, peer_threads)
    if json_out:
        Path(json_out).write_text(json.dumps(r, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"{r['model']} ({', '.join(r['types'])}, {r['weight_bytes'] / 2**30:.2f} GiB) on {r['device']}: "
               f"{prompt}-token prompts, {tokens} tokens a stream, median of {reps}; llama.cpp {r['peer']}")
    click.echo(f"  {'streams':>7}  {'engine':>9}  {'aggregate':>9}  {'overall':>8}  {'itl p50':>7}  {'itl p90':>7}  "
               f"{'ttft p50':>8}  {'ratio':>6}")
    for row in r["rows"]:
        for name in ENGINES:
            e = row[name]
            ratio = _fmt(row["ratio_aggregate"], ".3f") if name == "vramd" else ""
            click.echo(f"  {row['streams']:>7}  {name:>9}  {_fmt(e['aggregate_tps'], '9.1f'):>9}  "
                       f"{_fmt(e['overall_tps'], '8.1f'):>8}  {_fmt(e['itl_p50_ms'], '7.2f'):>7}  "
                       f"{_fmt(e['itl_p90_ms'], '7.2f'):>7}  {_fmt(e['ttft_p50_ms'], '8.1f'):>8}  {ratio:>6}")


if __name__ == "__main__":
    command()

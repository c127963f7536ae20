"""The daemon's counters and their Prometheus text rendering (`/metrics`).

Names are prefixed `vramd_`; every series carries the daemon's `name`; byte
gauges a `kind` label (weights, state, encoder, scratch).  Written by the
loop, HTTP and control threads, read by a scrape: a lock keeps a scrape
consistent.  Rendered by hand (text format 0.0.4: HELP and TYPE lines,
histograms as cumulative `_bucket{le}`, `_sum`, `_count`); the tests read it
with prometheus_client's parser.

Requests are counted when they start (`vramd_requests_total{plane}`: "api"
for HTTP, "control" for the control socket), errors when they end, by HTTP
status or by the control reply's exit code.  Token counts come from the
engine's own counters (what /vramd/status shows) at scrape time.
"""

from __future__ import annotations

import threading

SWITCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A request: milliseconds (a short one on a warm model) to minutes (a long generation behind a wait).
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STATES = ("cold", "warming", "warm", "cooling", "parked")
PLANES = ("api", "control")
TOKENS = (("prompt_tokens", "Prompt tokens of the requests computed (reused ones included)."),
          ("generated_tokens", "Tokens generated."),
          ("reused_tokens", "Prompt tokens taken from the KV cache instead of computed."))


class Histogram:
    """Cumulative buckets, a sum and a count (callers hold the Metrics lock)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.total = 0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, metric: str, label: str, help_: str) -> list[str]:
        lines = [f"# HELP {metric} {help_}", f"# TYPE {metric} histogram"]
        lines += [f'{metric}_bucket{{{label},le="{b}"}} {n}' for b, n in zip(self.buckets, self.counts)]
        return lines + [f'{metric}_bucket{{{label},le="+Inf"}} {self.total}',
                        f"{metric}_sum{{{label}}} {self.sum:.6f}", f"{metric}_count{{{label}}} {self.total}"]


def _one(metric: str, kind: str, help_: str, label: str, value) -> list[str]:
    return [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}", f"{metric}{{{label}}} {value}"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.switch = Histogram(SWITCH_BUCKETS)
        self.request_seconds = Histogram(REQUEST_BUCKETS)
        self.first_token_seconds = Histogram(REQUEST_BUCKETS)
        self.restore_failures = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.requests = dict.fromkeys(PLANES, 0)
        self.errors: dict[tuple[str, str], int] = {}
        self.evictions = 0
        self.evicted_bytes = 0

    def observe_switch(self, seconds: float, h2d: int) -> None:
        with self._lock:
            self.switch.observe(seconds)
            self.bytes_h2d += h2d

    def observe_release(self, d2h: int) -> None:
        with self._lock:
            self.bytes_d2h += d2h

    def observe_eviction(self, nbytes: int) -> None:
        with self._lock:
            self.evictions += 1
            self.evicted_bytes += nbytes

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def request_started(self, plane: str) -> None:
        with self._lock:
            self.requests[plane] += 1

    def request_failed(self, plane: str, status) -> None:
        """An HTTP status >= 400, or a control reply's exit code."""
        with self._lock:
            key = (plane, str(status))
            self.errors[key] = self.errors.get(key, 0) + 1

    def observe_request(self, seconds: float) -> None:
        """An API generation request, arrival to last byte."""
        with self._lock:
            self.request_seconds.observe(seconds)

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.first_token_seconds.observe(seconds)

    def render(self, name: str, state: str, holds_token: bool, yields: int, breakdown: dict,
               tokens: dict | None = None, queued: int = 0, inflight: int = 0) -> str:
        label = f'name="{_escape(name)}"'
        tokens = tokens or {}
        with self._lock:
            lines = [
                "# HELP vramd_state 1 for the daemon's current state.",
                "# TYPE vramd_state gauge",
                *(f'vramd_state{{{label},state="{s}"}} {int(s == state)}' for s in STATES),
                *_one("vramd_token_held", "gauge", "1 while this daemon holds the GPU token.", label,
                      int(holds_token)),
                *_one("vramd_switches_total", "counter", "Times this daemon went warm.", label, self.switch.total),
                *_one("vramd_yields_total", "counter",
                      "Times this daemon went cold because a peer or an operator asked.", label, yields),
                *_one("vramd_restore_failures_total", "counter",
                      "Restores that failed (e.g. out of device memory).", label, self.restore_failures),
                "# HELP vramd_requests_total Requests received, counted when they start: plane api (HTTP) "
                "or control (the control socket).",
                "# TYPE vramd_requests_total counter",
                *(f'vramd_requests_total{{{label},plane="{p}"}} {self.requests[p]}' for p in PLANES),
                "# HELP vramd_request_errors_total Requests that failed: by HTTP status (plane api) or by the "
                "reply's exit code (plane control).",
                "# TYPE vramd_request_errors_total counter",
                *(f'vramd_request_errors_total{{{label},plane="{p}",status="{st}"}} {n}'
                  for (p, st), n in sorted(self.errors.items())),
                *_one("vramd_queued_requests", "gauge",
                      "Requests waiting for the daemon's loop (not yet started).", label, queued),
                *_one("vramd_inflight_requests", "gauge",
                      "Generation requests received and not yet answered (queued ones included).", label, inflight),
            ]
            for key, help_ in TOKENS:
                lines += _one(f"vramd_{key}_total", "counter", help_, label, int(tokens.get(key, 0)))
            lines += self.request_seconds.render("vramd_request_seconds", label,
                                                 "API generation requests, from arrival to the reply's last byte.")
            lines += self.first_token_seconds.render("vramd_time_to_first_token_seconds", label,
                                                     "API generation requests, from arrival to the first token.")
            lines += [
                *_one("vramd_evictions_total", "counter",
                      "Times a peer's need made this daemon release parked buffers.", label, self.evictions),
                *_one("vramd_evicted_bytes_total", "counter", "Device bytes released for peers' needs.", label,
                      self.evicted_bytes),
                *self.switch.render("vramd_switch_seconds", label, "From asking for the token to resident and ready."),
                "# HELP vramd_bytes_moved_total Bytes moved between host and device.",
                "# TYPE vramd_bytes_moved_total counter",
                f'vramd_bytes_moved_total{{{label},direction="h2d"}} {self.bytes_h2d}',
                f'vramd_bytes_moved_total{{{label},direction="d2h"}} {self.bytes_d2h}',
            ]
        for where in ("device", "host"):
            lines += [f"# HELP vramd_{where}_bytes Bytes held in {where} memory, by region kind.",
                      f"# TYPE vramd_{where}_bytes gauge"]
            for kind, v in breakdown.items():
                lines.append(f'vramd_{where}_bytes{{{label},kind="{kind}"}} {v[where]}')
        return "\n".join(lines) + "\n"


def render_device_memory(name: str, report: dict | None) -> str:
    """Device memory as the machine sees it (vramd/gpu/memview.py), from the daemon's look for this scrape.
    Outside-arena and foreign bytes are always present, 0 when not known (no look yet, or a driver
    that does not say): an alert on them must not read a missing series as "fine"."""
    label = f'name="{_escape(name)}",source="{_escape(report["source"]) if report else "none"}"'
    report = report or {}
    lines = []
    if report.get("free") is not None:
        lines += _one("vramd_device_free_bytes", "gauge",
                      "Device memory this daemon may still allocate, at its last look.", label, report["free"])
    lines += _one("vramd_device_outside_arena_bytes", "gauge",
                  "Device memory held by processes that are not vramd members, at the last look (0: not known).",
                  label, report.get("outside_arena") or 0)
    lines += _one("vramd_device_foreign_bytes", "gauge",
                  "Device memory held outside the arena beyond the least seen there, while this daemon holds the "
                  "token (a GPU user that ignores the token); 0 while it does not, or when not known.",
                  label, report.get("foreign") or 0)
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

"""The daemon's counters and their Prometheus text rendering (`/metrics`).

Names are prefixed `vramd_`; byte gauges carry a `kind` label (weights,
state, encoder, scratch).  Written by the loop thread, read by HTTP threads:
a lock keeps a scrape consistent.
"""

from __future__ import annotations

import threading

SWITCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STATES = ("cold", "warming", "warm", "cooling", "parked")


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.switch_counts = [0] * len(SWITCH_BUCKETS)
        self.switch_sum = 0.0
        self.switch_total = 0
        self.restore_failures = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.requests = 0
        self.evictions = 0
        self.evicted_bytes = 0

    def observe_switch(self, seconds: float, h2d: int) -> None:
        with self._lock:
            self.switch_total += 1
            self.switch_sum += seconds
            self.bytes_h2d += h2d
            for i, bound in enumerate(SWITCH_BUCKETS):
                if seconds <= bound:
                    self.switch_counts[i] += 1

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

    def render(self, name: str, state: str, holds_token: bool, yields: int, breakdown: dict) -> str:
        label = f'name="{_escape(name)}"'
        with self._lock:
            lines = [
                "# HELP vramd_state 1 for the daemon's current state.",
                "# TYPE vramd_state gauge",
                *(f'vramd_state{{{label},state="{s}"}} {int(s == state)}' for s in STATES),
                "# HELP vramd_token_held 1 while this daemon holds the GPU token.",
                "# TYPE vramd_token_held gauge",
                f"vramd_token_held{{{label}}} {int(holds_token)}",
                "# HELP vramd_switches_total Times this daemon went warm.",
                "# TYPE vramd_switches_total counter",
                f"vramd_switches_total{{{label}}} {self.switch_total}",
                "# HELP vramd_yields_total Times this daemon went cold because a peer or an operator asked.",
                "# TYPE vramd_yields_total counter",
                f"vramd_yields_total{{{label}}} {yields}",
                "# HELP vramd_restore_failures_total Restores that failed (e.g. out of device memory).",
                "# TYPE vramd_restore_failures_total counter",
                f"vramd_restore_failures_total{{{label}}} {self.restore_failures}",
                "# HELP vramd_requests_total Requests served (control and API).",
                "# TYPE vramd_requests_total counter",
                f"vramd_requests_total{{{label}}} {self.requests}",
                "# HELP vramd_evictions_total Times a peer's need made this daemon release parked buffers.",
                "# TYPE vramd_evictions_total counter",
                f"vramd_evictions_total{{{label}}} {self.evictions}",
                "# HELP vramd_evicted_bytes_total Device bytes released for peers' needs.",
                "# TYPE vramd_evicted_bytes_total counter",
                f"vramd_evicted_bytes_total{{{label}}} {self.evicted_bytes}",
                "# HELP vramd_switch_seconds From asking for the token to resident and ready.",
                "# TYPE vramd_switch_seconds histogram",
            ]
            for bound, n in zip(SWITCH_BUCKETS, self.switch_counts):
                lines.append(f'vramd_switch_seconds_bucket{{{label},le="{bound}"}} {n}')
            lines += [
                f'vramd_switch_seconds_bucket{{{label},le="+Inf"}} {self.switch_total}',
                f"vramd_switch_seconds_sum{{{label}}} {self.switch_sum:.6f}",
                f"vramd_switch_seconds_count{{{label}}} {self.switch_total}",
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
    """Device memory as the machine sees it (vramd/gpu/memview.py), from the daemon's look for this scrape."""
    if not report:
        return ""
    label = f'name="{_escape(name)}",source="{_escape(report["source"])}"'
    lines = ["# HELP vramd_device_free_bytes Device memory this daemon may still allocate, at its last look.",
             "# TYPE vramd_device_free_bytes gauge",
             f"vramd_device_free_bytes{{{label}}} {report['free']}"]
    if report.get("outside_arena") is not None:
        lines += ["# HELP vramd_device_outside_arena_bytes Device memory held by processes that are not vramd "
                  "members, at the last look.",
                  "# TYPE vramd_device_outside_arena_bytes gauge",
                  f"vramd_device_outside_arena_bytes{{{label}}} {report['outside_arena']}"]
    if report.get("foreign") is not None:
        lines += ["# HELP vramd_device_foreign_bytes Device memory held outside the arena beyond the least seen "
                  "there, while this daemon holds the token (a GPU user that ignores the token); 0 while it does not.",
                  "# TYPE vramd_device_foreign_bytes gauge",
                  f"vramd_device_foreign_bytes{{{label}}} {report['foreign']}"]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

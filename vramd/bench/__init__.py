"""Benchmarks, one module per benchmark.

Each module exposes `command`, a click command; `vramd bench NAME` runs
`vramd.bench.NAME.command`.  Results and the commands that produced them are
recorded in docs/benchmarks.md.
"""

NAMES = ("attention", "constrained", "cpu", "decode", "encode", "gateway", "handover", "hostcache", "matmul", "parallel",
         "pause", "prefill", "residency", "slots", "soak", "switch")

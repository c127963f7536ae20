"""`vramd bench handover`: the protocol alone, ring -> holder releases -> waiter holds.

Two vramd participants (separate processes, no GPU work in their release and
restore) ping-pong the token of a fresh arena; each request is timed from
the start of `ensure_warm()` (ticket, ring) to holding the token, with the
member records, the warden thread and every check a real daemon pays.  In
the same run two minimal C processes (handover_floor.c: ring, flock,
inotify, nothing else) do the same hand-over: the floor set by the kernel.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import click

from vramd.errors import VramdError

# Pause between serving and asking again, so the partner is settled in its
# serve when the ring comes and we time the hand-over, not its bookkeeping.
GAP_S = 0.002


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarize(latencies_s: list[float]) -> dict:
    ms = [v * 1000 for v in latencies_s]
    return {"p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 99),
            "mean_ms": statistics.fmean(ms), "max_ms": max(ms), "n": len(ms)}


# -- the vramd side -----------------------------------------------------------

def peer_main(arena_path: str, first: bool, rounds: int) -> None:
    """One participant: serve, then request, `rounds` times (or request first)."""
    from vramd.arena.arbiter import Participant
    from vramd.arena.layout import Arena

    p = Participant(Arena.open(arena_path), "first" if first else "second", quantum=0.0, max_hold=0.0)
    p.start()
    latencies = []

    def serve():
        if not p.wait_yield_due(60) or not p.idle():
            raise SystemExit("partner never rang")

    def request():
        t0 = time.monotonic()
        p.ensure_warm(60)
        latencies.append(time.monotonic() - t0)

    if first:
        p.ensure_warm()
    print("ready", flush=True)
    for _ in range(rounds):
        if first:
            serve()
            time.sleep(GAP_S)
            request()
        else:
            request()
            serve()
            time.sleep(GAP_S)
    p.close()
    print(json.dumps(latencies), flush=True)


def run_pair(argv_first: list[str], argv_second: list[str], parse) -> list[float]:
    """Start `first`, wait for it to hold the token, start `second`, collect both."""
    a = subprocess.Popen(argv_first, stdout=subprocess.PIPE, text=True)
    try:
        if a.stdout.readline().strip() != "ready":
            raise VramdError("handover benchmark: the first peer did not start")
        b = subprocess.Popen(argv_second, stdout=subprocess.PIPE, text=True)
        out_b, _ = b.communicate(timeout=600)
        out_a, _ = a.communicate(timeout=60)
    finally:
        for proc in (a,):
            if proc.poll() is None:
                proc.kill()
    if a.returncode or b.returncode:
        raise VramdError(f"handover benchmark: a peer failed (exit {a.returncode}, {b.returncode})")
    return parse(out_a) + parse(out_b)


def measure_vramd(arena: Path, rounds: int) -> list[float]:
    def argv(first):
        return [sys.executable, "-c",
                "import sys; from vramd.bench.handover import peer_main; "
                f"peer_main({str(arena)!r}, {first}, {rounds})"]
    return run_pair(argv(True), argv(False), lambda out: json.loads(out.strip().splitlines()[-1]))


# -- the C floor -------------------------------------------------------------------

def build_floor(workdir: Path) -> Path:
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        raise VramdError(f"handover benchmark: no C compiler ({cc}) for the floor; install gcc")
    src = resources.files("vramd.bench").joinpath("handover_floor.c")
    exe = workdir / "handover_floor"
    with resources.as_file(src) as path:
        subprocess.run([cc, "-O2", "-o", str(exe), str(path)], check=True)
    return exe


def measure_floor(arena: Path, rounds: int, exe: Path) -> list[float]:
    gap_us = str(int(GAP_S * 1e6))
    return run_pair([str(exe), str(arena), str(rounds), "first", gap_us],
                    [str(exe), str(arena), str(rounds), "second", gap_us],
                    lambda out: [int(x) / 1e9 for x in out.split() if x.isdigit()])


def fresh_arena(workdir: Path, name: str) -> Path:
    from vramd.arena.layout import Arena
    return Arena.open(workdir / name).path


def run(rounds: int) -> dict:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-bench-", dir=base) as tmp:
        workdir = Path(tmp)
        exe = build_floor(workdir)
        per_peer = max(1, rounds // 2)
        vramd_lat = measure_vramd(fresh_arena(workdir, "vramd"), per_peer)
        floor_lat = measure_floor(fresh_arena(workdir, "floor"), per_peer, exe)
    v, f = summarize(vramd_lat), summarize(floor_lat)
    return {
        "rounds": v["n"],
        "p50_ms": v["p50_ms"], "p99_ms": v["p99_ms"], "mean_ms": v["mean_ms"], "max_ms": v["max_ms"],
        "floor_rounds": f["n"],
        "floor_p50_ms": f["p50_ms"], "floor_p99_ms": f["p99_ms"], "floor_max_ms": f["max_ms"],
        "p50_over_floor": v["p50_ms"] / f["p50_ms"] if f["p50_ms"] else None,
        "cpus": os.cpu_count(),
    }


@click.command(name="handover")
@click.option("--rounds", type=click.IntRange(min=2), default=1000, show_default=True,
              help="Hand-overs to time (each side, vramd and the C floor).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def command(rounds, as_json):
    """Time ring -> holder releases -> waiter holds, vramd against a C floor."""
    r = run(rounds)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"hand-overs: {r['rounds']} vramd, {r['floor_rounds']} C floor ({r['cpus']} CPUs)")
    click.echo(f"  vramd    p50 {r['p50_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms   max {r['max_ms']:.3f} ms")
    click.echo(f"  C floor  p50 {r['floor_p50_ms']:.3f} ms   p99 {r['floor_p99_ms']:.3f} ms   "
               f"max {r['floor_max_ms']:.3f} ms")
    click.echo(f"  vramd p50 / floor p50 = {r['p50_over_floor']:.2f}")


if __name__ == "__main__":
    command()

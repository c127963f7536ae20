"""`vramd bench switch`: two real daemons, B's ring while A is warm -> B resident and ready.

Two `vramd serve` processes on synthetic models of --gib GiB each share a
fresh arena.  Each round wakes A (so A is warm), then wakes B and takes B's
own measure of the switch: from the start of its ensure_warm (ticket, ring)
through A's release to B's weights uploaded and its record published.  In
the same run, before the daemons start, the raw host->device link rate is
measured with one large vkCmdCopyBuffer from pinned memory, and each switch
is set against B's bytes / that rate.  Goal: p50 <= 1.1 x bytes/link + 20 ms.

The models are GGUF files whose tensor data is a hole (a sparse file of
zeros): the header is real, nothing is written or read from a disk, and the
loader still reads every byte into the host shadow.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from vramd.bench.handover import percentile
from vramd.errors import VramdError

def write_sparse_model(path: Path, nbytes: int, seed: int, fill: str = "zeros") -> Path:
    """A llama GGUF of about `nbytes` of F16 weights whose data is a hole (zeros), or with
    fill "random" seeded weights (`vramd bench pause`'s small pair whose text means something)."""
    from vramd.bench.models import LlamaShape, write_model
    return write_model(path, LlamaShape.for_bytes(nbytes), wtype="F16", fill=fill, seed=seed, name=f"bench-{seed}")


def link_rate(nbytes: int) -> dict:
    """The raw host<->device rate of this device, through the residency core's probe."""
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency
    with Device() as dev, Residency(dev) as res:
        return res.link_probe(nbytes)


class Served:
    """A `vramd serve` process on a free port (`extra`: more serve flags, e.g. --parallel); shared
    with `vramd bench parallel` and `vramd bench pause`."""

    def __init__(self, arena: Path, model: Path, name: str, ctx: int, residency: str, extra: tuple = ()):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vramd.cli", "serve", str(model), "--name", name, "--arena", str(arena),
             "--port", "0", "--ctx", str(ctx), "--quantum", "0", "--residency", residency, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.socket = arena / "control" / f"{name}.sock"
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not any(" serving " in x for x in self.log):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise VramdError(f"benchmark: daemon {self.name} ({self.proc.args[4]}) did not start:\n"
                                 f"{''.join(self.log)}")
            time.sleep(0.05)

    def ask(self, cmd: str) -> dict:
        from vramd.server.control import request
        return request(self.socket, cmd, wait=600, timeout=600)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def measure(arena: Path, a_path: Path, b_path: Path, rounds: int, ctx: int, residency: str) -> dict:
    a = Served(arena, a_path, "A", ctx, residency)
    try:
        a.wait_ready()
        b = Served(arena, b_path, "B", ctx, residency)
        try:
            b.wait_ready()
            switches, walls, moved = [], [], []
            for _ in range(rounds):
                a.ask("wake")
                t0 = time.monotonic()
                reply = b.ask("wake")
                walls.append((time.monotonic() - t0) * 1000)
                switches.append(reply["switch_ms"])
                moved.append(reply["moved_bytes"])
            device = b.ask("status")["device"]["name"]
        finally:
            b.stop()
    finally:
        a.stop()
    return {"switches": switches, "walls": walls, "moved": moved, "device": device}


def summarize(m: dict, link: dict, residency: str) -> dict:
    switches = m["switches"]
    b_bytes = statistics.median(m["moved"])
    ideal_ms = b_bytes / (link["h2d_gbps"] * 1e9) * 1000
    p50 = statistics.median(switches)
    return {
        "residency": residency, "rounds": len(switches), "b_bytes": int(b_bytes),
        "p50_ms": p50, "p99_ms": percentile(switches, 99), "min_ms": min(switches), "max_ms": max(switches),
        "wall_p50_ms": statistics.median(m["walls"]),
        "ideal_ms": ideal_ms, "goal_ms": 1.1 * ideal_ms + 20 if b_bytes else 5.0,
        "p50_over_ideal": p50 / ideal_ms if ideal_ms else None,
        "switch_gbps": b_bytes / (p50 / 1000) / 1e9 if p50 and b_bytes else None,
    }


def run(gib: float, rounds: int, ctx: int, probe_gib: float, modes: list[str]) -> dict:
    nbytes = int(gib * 2**30)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    results = {}
    with tempfile.TemporaryDirectory(prefix="vramd-switch-", dir=base) as tmp:
        tmp = Path(tmp)
        a_path = write_sparse_model(tmp / "a.gguf", nbytes, 1)
        b_path = write_sparse_model(tmp / "b.gguf", nbytes, 2)
        link = link_rate(int(min(probe_gib, max(gib, 0.0625)) * 2**30))
        for mode in modes:
            m = measure(tmp / f"arena-{mode}", a_path, b_path, rounds, ctx, mode)
            results[mode] = summarize(m, link, mode)
            device = m["device"]
    out = {"gib": gib, "device": device, "link_h2d_gbps": link["h2d_gbps"], "link_d2h_gbps": link["d2h_gbps"],
           "modes": results}
    # The first mode's figures also at the top level, for scripts that read one.
    out.update({k: v for k, v in results[modes[0]].items() if k != "residency"})
    return out


@click.command(name="switch")
@click.option("--gib", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Size of each of the two synthetic models.")
@click.option("--rounds", type=click.IntRange(min=1), default=10, show_default=True, help="Switches to time.")
@click.option("--ctx", type=click.IntRange(min=1), default=512, show_default=True, help="KV cache context.")
@click.option("--probe-gib", type=click.FloatRange(min=0.01), default=4.0, show_default=True,
              help="Size of the raw link-rate probe (at most --gib).")
@click.option("--residency", type=click.Choice(["exclusive", "cache", "both"]), default="exclusive",
              show_default=True, help="exclusive: every switch uploads B; cache: both models fit and stay "
              "parked, a switch moves nothing; both: one after the other, side by side.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def command(gib, rounds, ctx, probe_gib, residency, as_json):
    """Time a switch between two daemons against bytes / raw link rate."""
    modes = ["exclusive", "cache"] if residency == "both" else [residency]
    r = run(gib, rounds, ctx, probe_gib, modes)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    click.echo(f"switch A -> B on {r['device']}, 2 x {gib:g} GiB models, {rounds} switches, "
               f"raw link {r['link_h2d_gbps']:.1f} GB/s host->device")
    for mode, m in r["modes"].items():
        ratio = f"x{m['p50_over_ideal']:.2f} of ideal {m['ideal_ms']:.1f} ms, " if m["ideal_ms"] else ""
        click.echo(f"  {mode:9s} moved {m['b_bytes'] / 2**30:6.2f} GiB  p50 {m['p50_ms']:8.1f} ms  "
                   f"p99 {m['p99_ms']:8.1f} ms  ({ratio}goal {m['goal_ms']:.1f} ms)")


if __name__ == "__main__":
    command()

"""`vramd bench residency`: how close release/restore come to the host link.

Measures, in one run on one device:
  - the raw link rate: one vkCmdCopyBuffer of --link-gib between pinned host
    memory (the kind the shadows use) and device memory, each way;
  - restore: the pipelined upload of a --gib weights region from its shadow,
    submit to completion;
  - release of those weights (the call; and until the memory is back with
    the driver, reported apart as release_drain_ms);
  - state eviction: device -> shadow copy of a --state-gib state region and
    its release;
and prints medians over --reps repetitions, with ratios to the link.
Goals (issue 3, on the H200): restore >= 90 % of link H2D, release <= 20 ms,
eviction >= 90 % of link D2H.  docs/benchmarks.md records the figures.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import click
import numpy as np

GiB = 1 << 30
MiB = 1 << 20
TENSOR = 64 * MiB  # a typical large tensor; the core packs them into blocks


def _tensors(prefix: str, nbytes: int) -> dict:
    out, i = {}, 0
    nbytes = max(4096, nbytes // 4096 * 4096)  # whole words for the fill pattern
    while nbytes > 0:
        n = min(TENSOR, nbytes)
        out[f"{prefix}.{i}"] = n
        nbytes -= n
        i += 1
    return out


def _fill(region, seed: int) -> None:
    # A distinct non-zero word per tensor: cheap to write (memset speed)
    # and enough to catch a block copied to the wrong place.
    for i, t in enumerate(region.tensors.values()):
        t.host().view(np.uint64)[:] = np.uint64(0x9E3779B97F4A7C15 * (i + 1 + seed) % (1 << 64))


def _spot_check(region, seed: int) -> bool:
    names = list(region.tensors)
    for i in (0, len(names) - 1):
        t = region.tensors[names[i]]
        want = np.uint64(0x9E3779B97F4A7C15 * (i + 1 + seed) % (1 << 64))
        got = t.read(np.uint64, offset=t.nbytes - MiB, nbytes=MiB)
        if not (got == want).all():
            return False
    return True


def clamp_link(link_gib: float, dev, log) -> float:
    """The raw link copy holds its bytes on the device and in a pinned host buffer at once:
    at most a quarter of the device heap (the default 4 GiB does not fit a 2 GiB device)."""
    heap = max((h["size"] for h in dev.heaps if h["device_local"]), default=0) or max(h["size"] for h in dev.heaps)
    most = heap / 4 / GiB
    if link_gib > most:
        log(f"--link-gib {link_gib:g} is more than a quarter of the device heap ({heap / GiB:.2f} GiB): "
            f"clamped to {most:.3f}")
        return most
    return link_gib


def run(gib: float, state_gib: float, link_gib: float, block_mib: int, reps: int, device=None,
        log=lambda s: None, alloc_threads: int = 0, queue: str = "transfer", serial: bool = False,
        ramp: bool = True, dedicated: bool = True) -> dict:
    from vramd.gpu.device import Device
    from vramd.gpu.residency import Residency, lib

    dev = Device(device, transfer_queue=(queue == "transfer"))
    flags = ((lib.VRAMD_CTX_SERIAL_RESTORE if serial else 0) | (0 if ramp else lib.VRAMD_CTX_NO_RAMP)
             | (0 if dedicated else lib.VRAMD_CTX_NOT_DEDICATED))
    res = Residency(dev, block_bytes=block_mib * MiB, alloc_threads=alloc_threads, flags=flags)
    try:
        log(f"device: {dev.name}; transfer queue: {'dedicated' if dev.dedicated_transfer else 'shared'}; "
            f"extensions: {', '.join(sorted(dev.extensions))}; shadows "
            f"{'imported host memory' if res.limits['shadow_imported'] else 'host-visible cached memory'}")
        link_gib = clamp_link(link_gib, dev, log)
        link = res.link_probe(int(link_gib * GiB), reps)
        log(f"link: H2D {link['h2d_gbps']:.1f} GB/s, D2H {link['d2h_gbps']:.1f} GB/s (median of {reps})")

        t = time.perf_counter()
        weights = res.region("weights", "bench.weights", _tensors("w", int(gib * GiB)))
        state = res.region("state", "bench.state", _tensors("s", int(state_gib * GiB)))
        shadow_s = time.perf_counter() - t
        t = time.perf_counter()
        _fill(weights, 0)
        _fill(state, 1000)
        log(f"shadows: {weights.info()['bytes'] / GiB:.2f} + {state.info()['bytes'] / GiB:.2f} GiB, "
            f"allocated and pinned in {shadow_s:.2f} s, filled in {time.perf_counter() - t:.2f} s")

        # Warm-up: first-touch costs of the driver stay out of the numbers.
        res.restore(["weights", "state"])
        res.sync()
        res.release(["weights", "state"])
        res.drain()

        rows = []
        for _ in range(reps):
            r = {}
            t0 = time.perf_counter()
            res.restore(["weights"])
            r["restore_submit_s"] = time.perf_counter() - t0
            res.sync()
            r["restore_s"] = time.perf_counter() - t0
            st = res.stats()
            r["restore_bytes"] = st["restore_bytes"]
            r["alloc_ms"] = st["restore_alloc_ns"] / 1e6
            r["alloc_wait_ms"] = st["restore_alloc_wait_ns"] / 1e6
            r["stall_ms"] = st["restore_stall_ns"] / 1e6

            t0 = time.perf_counter()
            res.release(["weights"])
            r["release_ms"] = (time.perf_counter() - t0) * 1e3
            # A handover: the weights' memory is still going back to the
            # driver while the next restore (here: the state) comes in.
            t1 = time.perf_counter()
            res.restore(["state"])
            res.sync()
            r["handover_restore_s"] = time.perf_counter() - t1
            r["handover_bytes"] = res.stats()["restore_bytes"]
            res.drain()
            r["release_drain_ms"] = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            res.release(["state"])
            r["evict_s"] = time.perf_counter() - t0
            st = res.stats()
            r["evict_bytes"] = st["evict_bytes"]
            r["evict_copy_ms"] = st["evict_copy_ns"] / 1e6
            res.drain()
            rows.append(r)
            log("  restore %.1f GB/s (alloc %.0f ms summed, waited %.0f ms; stall %.0f ms), release %.2f ms "
                "(drain %.0f ms), evict %.1f GB/s" % (r["restore_bytes"] / r["restore_s"] / 1e9, r["alloc_ms"],
                                                      r["alloc_wait_ms"], r["stall_ms"],
                                     r["release_ms"], r["release_drain_ms"], r["evict_bytes"] / r["evict_s"] / 1e9))

        res.restore(["weights", "state"])
        ok = _spot_check(weights, 0) and _spot_check(state, 1000)
        res.release(["weights", "state"])
        res.drain()

        med = lambda key: statistics.median(row[key] for row in rows)  # noqa: E731
        out = {
            "device": dev.name,
            "gib": gib, "state_gib": state_gib, "link_gib": link_gib, "block_mib": block_mib, "reps": reps,
            "dedicated_transfer_queue": dev.dedicated_transfer,
            "shadow": "imported" if res.limits["shadow_imported"] else "host-visible-cached",
            "restore_gbps": statistics.median(row["restore_bytes"] / row["restore_s"] / 1e9 for row in rows),
            "link_h2d_gbps": link["h2d_gbps"],
            "evict_gbps": statistics.median(row["evict_bytes"] / row["evict_s"] / 1e9 for row in rows),
            "link_d2h_gbps": link["d2h_gbps"],
            "release_ms": med("release_ms"),
            "release_drain_ms": med("release_drain_ms"),
            "handover_restore_gbps": statistics.median(row["handover_bytes"] / row["handover_restore_s"] / 1e9
                                                       for row in rows),
            "queue": queue, "serial": serial, "ramp": ramp, "dedicated": dedicated,
            "alloc_threads": alloc_threads or 1,
            "restore_alloc_ms": med("alloc_ms"),
            "restore_alloc_wait_ms": med("alloc_wait_ms"),
            "restore_stall_ms": med("stall_ms"),
            "restore_ms": med("restore_s") * 1e3,
            "evict_copy_ms": med("evict_copy_ms"),
            "link_h2d_best_gbps": link["h2d_best_gbps"],
            "link_d2h_best_gbps": link["d2h_best_gbps"],
            "bit_exact": ok,
        }
        out["restore_ratio"] = out["restore_gbps"] / out["link_h2d_gbps"]
        out["evict_ratio"] = out["evict_gbps"] / out["link_d2h_gbps"]
        return out
    finally:
        res.close()
        dev.close()


@click.command(name="residency")
@click.option("--gib", type=float, default=16.0, show_default=True, help="weights to restore")
@click.option("--state-gib", type=float, default=None, help="state to evict [default: min(gib, 4)]")
@click.option("--link-gib", type=float, default=4.0, show_default=True, help="size of the raw link copy")
@click.option("--block-mib", type=int, default=256, show_default=True, help="suballocation block target")
@click.option("--alloc-threads", type=int, default=0, help="allocator threads [default: the core's, 1]")
@click.option("--queue", type=click.Choice(["transfer", "compute"]), default="transfer", show_default=True,
              help="queue for the copies (transfer: the dedicated copy engine where there is one)")
@click.option("--serial", is_flag=True, help="diagnosis: allocate every block before the first copy")
@click.option("--no-ramp", is_flag=True, help="diagnosis: full-size first blocks")
@click.option("--not-dedicated", is_flag=True, help="diagnosis: plain (not dedicated) device allocations")
@click.option("--reps", type=int, default=5, show_default=True, help="repetitions (medians are reported)")
@click.option("--device", "device", default=None, help="device index or UUID [default: first discrete GPU]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def command(gib, state_gib, link_gib, block_mib, alloc_threads, queue, serial, no_ramp, not_dedicated, reps, device,
            as_json):
    """Restore / release / eviction rates against the raw host link."""
    from vramd.errors import UsageError

    if gib <= 0 or reps < 1 or block_mib < 1 or link_gib <= 0:
        raise UsageError("--gib, --link-gib, --block-mib and --reps must be positive")
    state_gib = min(gib, 4.0) if state_gib is None else state_gib
    log = (lambda s: print(s, file=sys.stderr)) if as_json else print
    out = run(gib, state_gib, link_gib, block_mib, reps, device, log, alloc_threads, queue, serial, not no_ramp,
              not not_dedicated)
    if as_json:
        print(json.dumps(out))
        return
    print(f"restore  {out['restore_gbps']:6.1f} GB/s   link H2D {out['link_h2d_gbps']:6.1f} GB/s   "
          f"ratio {out['restore_ratio']:.1%}")
    print(f"evict    {out['evict_gbps']:6.1f} GB/s   link D2H {out['link_d2h_gbps']:6.1f} GB/s   "
          f"ratio {out['evict_ratio']:.1%}")
    print(f"release  {out['release_ms']:6.2f} ms     (memory back with the driver after "
          f"{out['release_drain_ms']:.0f} ms)")
    print(f"bit-exact after the cycles: {out['bit_exact']}")


if __name__ == "__main__":
    command()

"""GPU time per dispatch, from timestamp queries (`vramd bench decode --profile`).

Owns: `Timestamps`, a query pool that a `Batch` (vramd/gpu/kernels.py) writes
into while it records: one timestamp at the start and one after each
dispatch, so consecutive differences are the GPU time of each dispatch (the
timestamp is taken at the bottom of the pipe: when everything before it has
finished, the barrier after the previous dispatch included).  The pool is
reset inside the recording, so a replayed recording (a decode graph) is
timed afresh on every submit.

    t = Timestamps(device)
    batch.timer = t            # before batch.begin() / ops.record(batch)
    ... record, submit, residency.sync() ...
    for label, nbytes, ns in t.read(): ...

Each dispatch is labelled by the recorder (`Batch.dispatch(..., label=,
nbytes=)`): Ops passes the kernel's name and, for matvec, the weight bytes
the dispatch reads, so `summarize` can give GB/s per kernel.

Ticks become nanoseconds through the device's timestampPeriod; the compute
queue family's timestampValidBits masks the raw values (lavapipe: 64 bits,
period 1 ns; it supports timestamps on compute queues like NVIDIA does).
"""
from __future__ import annotations

import statistics

from vramd.errors import DeviceError


class Timestamps:
    def __init__(self, device, capacity: int = 4096):
        vk, ffi = self.vk, self.ffi = device.vk, device.ffi
        self.dev = device.device
        props = vk.vkGetPhysicalDeviceProperties(device.physical)
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(device.physical)
        self.valid_bits = int(families[device.compute_family].timestampValidBits)
        self.period_ns = float(props.limits.timestampPeriod)
        if self.valid_bits == 0 or self.period_ns <= 0:
            raise DeviceError(f"Vulkan device {device.name} has no timestamps on its compute queue "
                              f"(timestampValidBits {self.valid_bits}, "
                              f"timestampComputeAndGraphics {bool(props.limits.timestampComputeAndGraphics)})")
        self.capacity = int(capacity)
        self.pool = vk.vkCreateQueryPool(self.dev, vk.VkQueryPoolCreateInfo(
            queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=self.capacity), None)
        self.labels: list[tuple[str, int]] = []   # per dispatch recorded: (label, bytes read)
        self.count = 0                             # timestamps recorded
        self.truncated = False                     # more dispatches than the pool holds
        self.resets = 0                            # recordings begun into it (a reader can check it saw one)
        self._data = ffi.new("uint64_t[]", self.capacity)

    def reset(self, cmd) -> None:
        """Recorded first in a command buffer: clears the pool, forgets labels."""
        self.vk.lib.vkCmdResetQueryPool(cmd, self.pool, 0, self.capacity)
        self.labels, self.count, self.truncated = [], 0, False
        self.resets += 1

    def stamp(self, cmd, label: str | None = None, nbytes: int = 0) -> None:
        """A timestamp once everything recorded before it is done; `label`
        names the dispatch just recorded (None: the starting stamp)."""
        if self.count >= self.capacity:
            self.truncated = True
            return
        self.vk.lib.vkCmdWriteTimestamp(cmd, self.vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self.pool, self.count)
        self.count += 1
        if label is not None:
            self.labels.append((label, int(nbytes)))

    def read(self) -> list[tuple[str, int, float]]:
        """(label, bytes, nanoseconds) per dispatch of the last completed
        submit (waits for the results)."""
        vk = self.vk
        n = self.count
        if n < 2:
            return []
        flags = vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT
        r = vk.lib.vkGetQueryPoolResults(self.dev, self.pool, 0, n, 8 * n, self._data, 8, flags)
        if r != vk.VK_SUCCESS:
            raise DeviceError(f"vkGetQueryPoolResults failed ({r})")
        mask = (1 << self.valid_bits) - 1 if self.valid_bits < 64 else (1 << 64) - 1
        ticks = [int(self._data[i]) & mask for i in range(n)]
        out = []
        for i, (label, nbytes) in enumerate(self.labels[:n - 1]):
            dt = (ticks[i + 1] - ticks[i]) & mask
            out.append((label, nbytes, dt * self.period_ns))
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.vk.vkDestroyQueryPool(self.dev, self.pool, None)
            self.pool = None


def summarize(steps: list[list[tuple[str, int, float]]]) -> dict:
    """Per label over timed steps: the median over steps of the summed time
    (us) and of the dispatch count, the bytes per step, GB/s at that
    median, and the share of the median step.  Sorted by time, largest
    first."""
    if not steps:
        return {"steps": 0, "kernels": [], "gpu_ms_per_step": 0.0}
    labels = []
    for s in steps:
        for label, _b, _t in s:
            if label not in labels:
                labels.append(label)
    per: dict[str, dict] = {}
    for label in labels:
        times = [sum(t for lb, _b, t in s if lb == label) for s in steps]
        counts = [sum(1 for lb, _b, _t in s if lb == label) for s in steps]
        nbytes = [sum(b for lb, b, _t in s if lb == label) for s in steps]
        per[label] = {"us": statistics.median(times) / 1e3, "dispatches": int(statistics.median(counts)),
                      "bytes": int(statistics.median(nbytes))}
    totals = [sum(t for _l, _b, t in s) for s in steps]
    total_us = statistics.median(totals) / 1e3
    kernels = []
    for label, d in sorted(per.items(), key=lambda kv: -kv[1]["us"]):
        d = {"kernel": label, **d}
        d["gbps"] = d["bytes"] / (d["us"] * 1e3) if d["bytes"] and d["us"] > 0 else None
        d["share"] = d["us"] / total_us if total_us > 0 else 0.0
        kernels.append(d)
    return {"steps": len(steps), "gpu_ms_per_step": total_us / 1e3, "kernels": kernels}

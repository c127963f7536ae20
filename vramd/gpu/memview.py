"""Device memory as the whole machine sees it: what is free, what others hold.

The residency core counts our own bytes and the arena's records count the
members'; neither knows a process that is not a vramd member (a training
job, a game, a llama.cpp that ignores the token).  Before a restore the
daemon asks `sample()` how much it may still allocate, and refuses with a
clear reason (HTTP 503, Retry-After) rather than failing half-way; while it
holds the token, `ForeignWatch` turns memory held outside the arena into a
report (status, metrics, a rate-limited log line).

Where the numbers come from (`MemoryView.source`):

- `driver`: VK_EXT_memory_budget (NVIDIA, AMD, Intel, recent Mesa).
  heapBudget - heapUsage is what this process can still allocate, and the
  driver counts every process on the GPU in it.  What others hold is
  size - free - our own device bytes, those our core is still freeing
  included (the same formula whether a driver reports heapUsage per
  process, as the spec says, or for the whole GPU).
- `host`: a device whose memory is host memory (lavapipe, a CPU device,
  without the extension: Debian 12's Mesa 22.3).  Its "VRAM" is this
  process's RAM, so a foreign process takes it only through memory both
  share: the machine's (MemAvailable) and the memory cgroup(s) we run in
  (limit - usage + reclaimable page cache, at each level up the tree).  Inside
  a limited cgroup, what others hold there is the cgroup's anonymous memory
  minus ours.  (Newer lavapipe's own budget extension reports the machine's
  available memory the same way; it cannot see cgroups.)
- `own`: neither; the core's own accounting against the heap size, and
  others are invisible.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("vramd.memview")

MiB = 1 << 20
# Memory outside the arena may move by this much without being called a foreign user.
# Why 256 MiB: the driver counts its own allocations for our process (pipelines,
# descriptor pools, a peer's context) that no region accounts for; on the H200
# these moved ~130 MiB over a test while no foreign user held anything.
FOREIGN_SLACK = 256 * MiB
# A foreign user that stays is logged again at most this often.
LOG_EVERY = 60.0
_UNLIMITED = 1 << 60


@dataclass
class MemoryView:
    source: str                 # "driver", "host" or "own"
    heap: int                   # the heap device blocks come from
    size: int                   # its size
    free: int                   # bytes this process may still allocate there
    others: int | None          # bytes other processes hold in the same memory; None: invisible
    bound: str = ""             # what bounds `free`, in words (for messages)

    def to_json(self) -> dict:
        return asdict(self)


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def sample(device, residency) -> MemoryView:
    """Free device memory and others' use, from the best source the device has."""
    heap = residency.limits["device_heap"]
    size = next(h["size"] for h in device.heaps if h["index"] == heap)
    # Ours: what our regions hold, and what we released that the core is still
    # handing back to the driver (the driver still counts it; it is not someone else's).
    own_device = sum(v["device"] for v in residency.breakdown().values()) + \
        residency.stats()["reclaim_pending_bytes"]
    if device.memory_budget:
        b = next(e for e in device.budget() if e["heap"] == heap)
        free = max(0, b["budget"] - b["usage"])
        return MemoryView("driver", heap, size, free, max(0, size - free - own_device),
                          "the driver's budget (VK_EXT_memory_budget)")
    own_heap = residency.heap_usage().get(heap, 0)   # shadows imported into the heap count too (lavapipe)
    heap_free = max(0, size - own_heap)
    if device.type == "cpu":
        avail, others, bound = host_memory()
        if avail < heap_free:
            return MemoryView("host", heap, size, avail, others, f"device memory is host memory here: {bound}")
        return MemoryView("host", heap, size, heap_free, others, f"the heap of {mib(size)}")
    return MemoryView("own", heap, size, heap_free, None, f"the heap of {mib(size)} (our own accounting)")


# -- host memory: the machine's and our memory cgroups' -------------------------------

def _kib_field(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    return int(text) if text.isdigit() else None


@dataclass
class CgroupMemory:
    path: str           # the cgroup, as /proc/self/cgroup names it
    limit: int          # bytes (_UNLIMITED: none)
    usage: int          # bytes charged, page cache included
    reclaimable: int    # inactive file pages: the kernel drops them before it refuses
    anon: int           # anonymous memory of every process in it


def memory_cgroups() -> list[CgroupMemory]:
    """Our memory cgroup and its ancestors (innermost first), v1 or v2."""
    mounts = []   # (version, root, mount point)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) < 5 or len(rfields) < 3:
                    continue
                if rfields[0] == "cgroup2":
                    mounts.append(("v2", fields[3], fields[4]))
                elif rfields[0] == "cgroup" and "memory" in rfields[2].split(","):
                    mounts.append(("v1", fields[3], fields[4]))
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    paths = {}
    for hid, controllers, path in (x for x in own if len(x) == 3):
        if hid == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    version = "v1" if "v1" in paths and any(m[0] == "v1" for m in mounts) else "v2"
    if version not in paths:
        return []
    path = paths[version]
    for v, root, point in mounts:
        if v != version or not (path == root or path.startswith(root.rstrip("/") + "/")):
            continue
        rel = path[len(root.rstrip("/")):].strip("/")
        out = []
        while True:
            d = Path(point) / rel if rel else Path(point)
            cg = _read_cgroup(version, d, "/" + rel)
            if cg is not None:
                out.append(cg)
            if not rel:
                return out
            rel = rel.rpartition("/")[0]
    return []


def _read_cgroup(version: str, d: Path, name: str) -> CgroupMemory | None:
    if version == "v1":
        limit, usage = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
        st = _stat(d / "memory.stat")
        reclaim = st.get("total_inactive_file", st.get("inactive_file", 0))
        anon = st.get("total_rss", st.get("rss", 0))
    else:
        limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        st = _stat(d / "memory.stat")
        reclaim, anon = st.get("inactive_file", 0), st.get("anon", 0)
    if limit is None or usage is None:
        return None
    return CgroupMemory(name, limit if limit < _UNLIMITED else _UNLIMITED, usage, reclaim, anon)


def host_memory() -> tuple[int, int | None, str]:
    """(bytes this process may still take, bytes others hold in its innermost
    limited cgroup or None, the bound in words)."""
    avail = _kib_field("/proc/meminfo", "MemAvailable") or 0
    bound = f"the machine has {mib(avail)} available"
    others = None
    own_anon = (_kib_field("/proc/self/status", "RssAnon") or 0) + (_kib_field("/proc/self/status", "RssShmem") or 0)
    for cg in memory_cgroups():
        if cg.limit >= _UNLIMITED:
            continue
        left = max(0, cg.limit - cg.usage + cg.reclaimable)
        if others is None:
            others = max(0, cg.anon - own_anon)
        if left < avail:
            avail = left
            bound = f"memory cgroup {cg.path}: {mib(cg.usage)} of its {mib(cg.limit)} limit in use"
    return avail, others, bound


# -- the watchdog ------------------------------------------------------------------

class ForeignWatch:
    """Memory held outside the arena while we hold the token: a GPU user ignoring it.

    While we hold the token, every other member is parked (its device bytes
    are in its record), cold, or still freeing what it released (its
    `freeing_bytes`: the caller counts those as the arena's); anything else
    others hold is outside the arena.  The baseline is the least memory seen
    outside the arena in any sample taken while holding (a running minimum):
    driver reservations and anything that was there before us, but never a
    transient that was on its way out when it was sampled.  Memory outside the
    arena beyond the baseline by more than FOREIGN_SLACK is reported as
    `foreign` and logged, at most once per LOG_EVERY seconds while it lasts.
    Memory outside the arena from the start shows as `outside_arena` without
    being flagged.  The report ends (`foreign` 0) when the memory goes, or
    when we no longer hold the token.
    """

    def __init__(self, name: str):
        self.name = name
        self.baseline: int | None = None
        self.last: dict | None = None
        self.flagged_since: float | None = None
        self._logged = 0.0

    def observe(self, view: MemoryView, members_others: int, holding: bool) -> dict:
        now = time.time()
        outside = None if view.others is None else max(0, view.others - members_others)
        report = {**view.to_json(), "members_others": members_others, "outside_arena": outside,
                  "sampled_at": now, "holding_token": holding, "foreign": None, "foreign_since": None}
        if holding and outside is not None:
            self.baseline = outside if self.baseline is None else min(self.baseline, outside)
            foreign = outside - self.baseline
            report["foreign"] = foreign
            if foreign > FOREIGN_SLACK:
                if self.flagged_since is None:
                    self.flagged_since = now
                if now - self._logged >= LOG_EVERY:
                    self._logged = now
                    log.warning("%s: %s of device memory is held outside the arena while we hold the token "
                                "(a GPU user that ignores it; %s free)", self.name, mib(foreign), mib(view.free))
            elif self.flagged_since is not None:
                log.info("%s: the foreign device memory is gone (%s outside the arena now)", self.name, mib(outside))
                self.flagged_since = None
                self._logged = 0.0
            report["foreign_since"] = self.flagged_since
        else:
            if self.flagged_since is not None:
                # Memory others hold while we are cold breaks no rule: the report
                # is about the time we held the token, and that time is over.
                log.info("%s: cold now; the foreign device memory report ends", self.name)
                self.flagged_since = None
                self._logged = 0.0
            if outside is not None and self.baseline is not None:
                report["foreign"] = 0   # nothing reported (not the last hold's figure, kept for ever)
        report["baseline"] = self.baseline
        self.last = report
        return report

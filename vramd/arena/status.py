"""One arena's status as plain data: who holds the token, who waits, what each member holds.

Read-only apart from removing records of dead members.  The holder comes from
the kernel (/proc/locks, /proc/<pid>/fdinfo), not from what members say, so a
holder that is not a vramd member (llama.cpp, a script) is named too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from vramd.arena import doorbell, proclocks
from vramd.arena.layout import Arena, existing_arenas, system_arena
from vramd.arena.members import KINDS, Registry
from vramd.arena.queue import Queue


def process_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, a debugger): alive, holding what it holds, answering nothing."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


# States in which a member says it holds the GPU (the token); two at once is split brain.
CLAIMING = ("warm", "cooling")


def flag_claims(report: dict) -> dict:
    """Mark the members that claim the GPU and whether more than one does (after any live
    states were filled in): two claims mean two processes compute, on two token inodes."""
    claims = [m["name"] for m in report["members"] if m["state"] in CLAIMING]
    report["claims_gpu"] = claims
    report["split_brain"] = len(claims) > 1
    return report


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


def arena_status(arena: Arena) -> dict:
    try:
        key = proclocks.file_key(os.stat(arena.token_path, follow_symlinks=False))
        holders = proclocks.flock_holders(key)
        blocked = proclocks.flock_waiters(key)
    except FileNotFoundError:
        holders, blocked = [], []
    members = Registry(arena.members_dir).list(clean=os.access(arena.members_dir, os.W_OK))
    try:
        queued = [pid for _n, pid in Queue(arena.queue_dir).live()]
    except Exception:
        queued = []
    by_pid = {m.pid: m for m in members}
    holder_pid = holders[0] if holders else None
    now = time.time()
    rows = []
    for m in members:
        rows.append({
            "name": m.name,
            "pid": m.pid,
            "model": m.model,
            "endpoint": m.endpoint,
            "state": m.state,
            "holds_token": m.pid in holders,
            "device_bytes": {k: m.breakdown[k]["device"] for k in KINDS},
            "host_bytes": {k: m.breakdown[k]["host"] for k in KINDS},
            "device_total": m.device_bytes(),
            "host_total": m.host_bytes(),
            "since": m.since,
            "for_s": round(max(0.0, now - m.since), 3),
            "switches": m.switches,
            "yields": m.yields,
            "bytes_h2d": m.bytes_h2d,
            "bytes_d2h": m.bytes_d2h,
            "last_switch_ms": m.last_switch_ms,
            "pinned": m.pinned,
            "priority": m.priority,
            "last_used": m.last_used,
            "control": m.control,   # the CLI asks a daemon there for its live status
            "stopped": process_stopped(m.pid),
            "failpoints": m.failpoints,
        })
    budgets = [m.budget for m in members if m.budget > 0]
    used = sum(m.device_bytes() for m in members)
    evictable = [m for m in members if m.pid not in holders and m.device_bytes() > 0 and not m.pinned]
    waiting = []
    for pid in dict.fromkeys(queued + blocked):
        waiting.append({"pid": pid, "name": by_pid[pid].name if pid in by_pid else process_name(pid),
                        "member": pid in by_pid})
    return flag_claims({
        "arena": str(arena.path),
        "shared": arena.shared,
        "holder_pid": holder_pid,
        "holder_is_member": holder_pid in by_pid if holder_pid is not None else False,
        "holder_name": (by_pid[holder_pid].name if holder_pid in by_pid else process_name(holder_pid))
        if holder_pid is not None else None,
        "waiting": waiting,
        "rings": sorted(doorbell.scan(arena.doorbell_dir, clean=False).rings),
        "members": rows,
        "budget_bytes": min(budgets) if budgets else None,
        "device_bytes_used": used,
        "free_bytes": (min(budgets) - used) if budgets else None,
        "eviction_order": [m.name for m in sorted(evictable, key=lambda m: m.eviction_key())],
    })


def discover_arenas(base: Path | None = None) -> list[Path]:
    """Every arena under the per-user base (one per device), then the system arena if there is one."""
    found = existing_arenas(base)
    system = system_arena()
    if (system / "token.lock").exists() and system not in found:
        found.append(system)
    return found


def drop_empty(reports: list[dict]) -> tuple[list[dict], list[str]]:
    """Of several arenas, the ones to show: an empty one (no member, no holder, nobody waiting)
    is left out when another has someone (the units run in /run/vramd, the per-user one was only
    ever made by a test).  Returns (shown, the paths left out)."""
    def empty(r):
        return not r["members"] and r["holder_pid"] is None and not r["waiting"]
    if len(reports) < 2 or all(empty(r) for r in reports):
        return reports, []
    return [r for r in reports if not empty(r)], [r["arena"] for r in reports if empty(r)]


def member_totals(report: dict) -> dict:
    """The header's totals from the rows as they are now (after the daemons' live answers), so
    that `vram N used` is the sum of the VRAM column."""
    used = sum(m["device_total"] for m in report["members"])
    report["device_bytes_used"] = used
    if report.get("budget_bytes"):
        report["free_bytes"] = report["budget_bytes"] - used
    return report

"""Who holds, and who waits for, a flock: read from /proc/locks and /proc/*/fdinfo.

flock records no owner in the file itself, so `status` asks the kernel.
/proc/locks lists each lock once, with the pid that *took* it and the file as
`major:minor:inode`; blocked requests follow as `->` lines.  That pid can lie:
a lock belongs to the open file description, so a child that inherited the
fd keeps it after the taker died, and /proc/locks still names the dead taker.
The processes that really hold it are those with an fd whose
/proc/<pid>/fdinfo carries a matching `lock:` line (readable for our own
processes, or all of them as root).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PROC_LOCKS = "/proc/locks"


@dataclass(frozen=True)
class LockEntry:
    pid: int
    kind: str        # FLOCK, POSIX, OFDLCK, ...
    mode: str        # READ or WRITE
    waiting: bool    # a blocked request (`->` line), not a granted lock
    dev_major: int
    dev_minor: int
    inode: int


def file_key(st: os.stat_result) -> tuple[int, int, int]:
    """(major, minor, inode) as /proc/locks prints them."""
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def parse_line(line: str) -> LockEntry | None:
    """Parse one /proc/locks or fdinfo `lock:` line; None if it is not one."""
    parts = line.split()
    if not parts:
        return None
    if parts[0] == "lock:":
        parts = parts[1:]
    if not parts or not parts[0].endswith(":"):
        return None
    parts = parts[1:]
    waiting = bool(parts) and parts[0] == "->"
    if waiting:
        parts = parts[1:]
    if len(parts) < 5:
        return None
    kind, _advisory, mode, pid, dev = parts[:5]
    try:
        major, minor, inode = dev.split(":")
        return LockEntry(int(pid), kind, mode, waiting, int(major, 16), int(minor, 16), int(inode))
    except ValueError:
        return None


def locks_on(key: tuple[int, int, int], text: str | None = None) -> list[LockEntry]:
    """Every /proc/locks entry (granted and waiting) on the file `key`."""
    if text is None:
        try:
            with open(PROC_LOCKS) as f:
                text = f.read()
        except OSError:
            return []
    out = []
    for line in text.splitlines():
        entry = parse_line(line)
        if entry and (entry.dev_major, entry.dev_minor, entry.inode) == key:
            out.append(entry)
    return out


def flock_taker(key: tuple[int, int, int]) -> int | None:
    """The pid /proc/locks names for the granted flock on `key` (may be stale)."""
    for e in locks_on(key):
        if e.kind == "FLOCK" and not e.waiting:
            return e.pid
    return None


def flock_waiters(key: tuple[int, int, int]) -> list[int]:
    """Pids blocked in flock() on `key`, in the order the kernel lists them."""
    return [e.pid for e in locks_on(key) if e.kind == "FLOCK" and e.waiting]


def pid_holds(pid: int, key: tuple[int, int, int]) -> bool | None:
    """Does `pid` have an fd carrying a granted flock on `key`?  None: cannot tell."""
    base = f"/proc/{pid}/fdinfo"
    try:
        fds = os.listdir(base)
    except FileNotFoundError:
        return False
    except PermissionError:
        return None
    for fd in fds:
        try:
            with open(f"{base}/{fd}") as f:
                info = f.read()
        except OSError:
            continue
        for line in info.splitlines():
            if line.startswith("lock:"):
                e = parse_line(line)
                if e and e.kind == "FLOCK" and not e.waiting and \
                        (e.dev_major, e.dev_minor, e.inode) == key:
                    return True
    return False


def flock_holders(key: tuple[int, int, int]) -> list[int]:
    """The live processes that hold the flock on `key` (usually one).

    Tries the pid /proc/locks names first; when that process is gone or no
    longer holds it (an inherited fd), scans every readable fdinfo.
    """
    taker = flock_taker(key)
    if taker is None:
        return []
    if pid_holds(taker, key):
        return [taker]
    holders = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != taker and pid_holds(int(name), key):
            holders.append(int(name))
    # Nothing readable says otherwise: trust /proc/locks.
    return holders or ([taker] if pid_holds(taker, key) is None else [])


def pid_stopped(pid: int) -> bool:
    """Is `pid` stopped (SIGSTOP, a tracer: state T or t in /proc/<pid>/stat)?  A stopped
    waiter keeps its flocks and tickets but will not take its turn until it is continued."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may hold anything.
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state in (b"T", b"t")

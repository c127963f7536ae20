"""Tickets: first come, first served for the token, on top of a flock that promises no order.

The kernel grants a released flock to whichever process asks first, and the
process that just released it usually asks first (it barged in 48-50 of 50
tries here).  So vramd waiters queue before they touch the token:

- `take()` issues a ticket `queue/<number>-<pid>` numbered one past the
  highest present, under a short flock on `queue/.issue.lock`, so numbers
  follow arrival order.  The ticket file is created under a temporary name,
  flocked LOCK_EX by its owner, then renamed into place: a visible ticket is
  always locked while its owner lives, and the kernel unlocks it when the
  owner dies, so liveness is a non-blocking LOCK_SH away and pid reuse cannot
  fool it.
- `wait_turn()` blocks with LOCK_SH on the nearest live ticket ahead (a queue
  lock in files: each waiter sleeps on its predecessor, the kernel wakes it).
  It wakes when that predecessor got the token or died, rescans, and returns
  once no live ticket is ahead.  Dead tickets on the way are removed.  A
  ticket whose owner has been stopped for STOPPED_GRACE s (SIGSTOP: alive,
  its ticket locked, but it will not take its turn) is skipped; we look
  every STOPPED_CHECK s while we wait on it.  A frozen waiter at the head
  must not make everyone behind it wait while the GPU is free; one stopped
  for a moment keeps its place (no barging past a slow waiter).
- `done()` unlinks the ticket *before* closing it, so a successor woken by the
  close never sees it again.

A holder that yields and wants the token back takes a new ticket, behind the
waiters: no barging.  Peers that know only flock (llama.cpp) skip the queue;
the arbiter handles them with /proc/locks.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vramd.arena.layout import describe_open_error, require_regular
from vramd.arena.proclocks import pid_stopped
from vramd.arena.token import flock_wait
from vramd.errors import ArenaError

ISSUE_LOCK = ".issue.lock"
_OPEN_RO = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NUMBER_DIGITS = 16
STOPPED_CHECK = 0.1   # how often a waiter looks whether the ticket it waits on belongs to a stopped process
STOPPED_GRACE = 1.0   # stopped this long, a waiter has lost its turn (it keeps its ticket)


@dataclass
class Ticket:
    number: int
    pid: int
    path: Path
    fd: int | None = None

    @property
    def name(self) -> str:
        return self.path.name


def parse_ticket(name: str) -> tuple[int, int] | None:
    """`<number>-<pid>` -> (number, pid); None for anything else."""
    number, sep, pid = name.partition("-")
    if not sep or not number.isdigit() or not pid.isdigit() or len(number) > _NUMBER_DIGITS + 2:
        return None
    return int(number), int(pid)


class Queue:
    def __init__(self, queue_dir: Path):
        self.dir = Path(queue_dir)

    # -- listing -----------------------------------------------------------

    def _entries(self) -> list[tuple[int, int, str]]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            raise ArenaError(f"{self.dir}: queue directory is missing") from None
        except PermissionError:
            raise ArenaError(f"{self.dir}: permission denied (not in the arena's group?)") from None
        out = []
        for name in names:
            parsed = parse_ticket(name)
            if parsed:
                out.append((parsed[0], parsed[1], name))
        out.sort()
        return out

    def _probe(self, name: str) -> bool | None:
        """True: live ticket.  False: stale (removed now).  None: gone, or not a ticket."""
        path = self.dir / name
        try:
            fd = os.open(path, _OPEN_RO)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return None  # a planted symlink is nobody's ticket
            return True  # unreadable: assume a live foreign-uid waiter, never remove
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None  # a planted FIFO or directory is nobody's ticket
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            # Unlocked: its owner is dead.  Remove it if it is still this inode.
            try:
                held, now = os.fstat(fd), os.lstat(path)
                if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                    os.unlink(path)
            except OSError:
                pass
            return False
        finally:
            os.close(fd)

    def live(self, exclude: Ticket | None = None) -> list[tuple[int, int]]:
        """(number, pid) of every live ticket, oldest first; stale ones are removed."""
        out = []
        for number, pid, name in self._entries():
            if exclude is not None and name == exclude.name:
                continue
            if self._probe(name):
                out.append((number, pid))
        return out

    # -- a waiter's life ---------------------------------------------------

    def take(self, pid: int | None = None) -> Ticket:
        """Join the end of the queue."""
        pid = os.getpid() if pid is None else pid
        issue_fd = self._open_issue_lock()
        try:
            fcntl.flock(issue_fd, fcntl.LOCK_EX)
            entries = self._entries()
            number = (entries[-1][0] + 1) if entries else 1
            tmp = self.dir / f".tmp-{pid}-{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, f"{pid}\n".encode())
                path = self.dir / f"{number:0{_NUMBER_DIGITS}d}-{pid}"
                os.rename(tmp, path)
            except BaseException:
                os.close(fd)
                _unlink_quietly(tmp)
                raise
            return Ticket(number, pid, path, fd)
        except OSError as e:
            raise ArenaError(f"{self.dir}: cannot take a ticket: {describe_open_error(e)}") from None
        finally:
            os.close(issue_fd)

    def _open_issue_lock(self) -> int:
        path = self.dir / ISSUE_LOCK
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o660)
        except OSError as e:
            raise ArenaError(f"{path}: {describe_open_error(e)}") from None
        try:
            require_regular(fd, path, "ticket issue lock")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def wait_turn(self, ticket: Ticket, timeout: float | None = None,
                  cancel: Callable[[], bool] | None = None) -> bool:
        """Block until `ticket` is the oldest live one; False after `timeout` s or on `cancel()`."""
        deadline = None if timeout is None or not math.isfinite(timeout) else time.monotonic() + timeout
        frozen = _Frozen()
        while True:
            ahead = [(name, pid) for number, pid, name in self._entries() if number < ticket.number]
            predecessor = None
            for name, pid in reversed(ahead):
                if self._probe(name) and not frozen(pid):
                    predecessor = name
                    break
            if predecessor is None:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or (cancel is not None and cancel()):
                return False
            path = self.dir / predecessor
            pred_pid = parse_ticket(predecessor)[1]
            stopped = frozen.watch(pred_pid)
            try:
                fd = flock_wait(lambda: _open_ticket(path), fcntl.LOCK_SH, left,
                                lambda: (cancel is not None and cancel()) or stopped())
            except FileNotFoundError:
                continue  # it got the token meanwhile
            except OSError:
                # Another uid's ticket we may not open: look again shortly.
                time.sleep(0.05)
                continue
            if fd is None:
                if frozen(pred_pid):
                    continue   # it has been stopped too long: rescan, it is skipped now
                return False
            os.close(fd)

    def done(self, ticket: Ticket) -> None:
        """Leave the queue: unlink first, then close (which wakes the successor)."""
        _unlink_quietly(ticket.path)
        fd, ticket.fd = ticket.fd, None
        if fd is not None:
            os.close(fd)


class _Frozen:
    """Which waiters have been stopped for STOPPED_GRACE s (over one wait_turn)."""

    def __init__(self):
        self._since: dict[int, float] = {}

    def __call__(self, pid: int) -> bool:
        now = time.monotonic()
        if not pid_stopped(pid):
            self._since.pop(pid, None)
            return False
        return now - self._since.setdefault(pid, now) >= STOPPED_GRACE

    def watch(self, pid: int) -> Callable[[], bool]:
        """A wait's cancel test for `pid`, looked at every STOPPED_CHECK s."""
        next_look = [0.0]

        def stopped() -> bool:
            now = time.monotonic()
            if now < next_look[0]:
                return False
            next_look[0] = now + STOPPED_CHECK
            return self(pid)
        return stopped


def _open_ticket(path: Path) -> int:
    """Open a ticket to wait on it: never through a symlink, never a FIFO or directory."""
    fd = os.open(path, _OPEN_RO)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "not a ticket", str(path))  # look again: it is nobody's
    return fd


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

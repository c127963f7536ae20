"""The token: an exclusive flock on <arena>/token.lock, held exactly while resident.

The kernel is the arbiter: it grants the lock to one open file description and
drops it when the last fd on that description closes, so a SIGKILLed holder
frees the GPU within a millisecond.  Rules kept here:

- open O_CLOEXEC, so a child the holder execs never inherits the lock;
- open O_NOFOLLOW|O_NONBLOCK and require a regular file, so a planted symlink
  or FIFO gives an error, not a lock on someone else's file or a hang;
- never unlink the token; after each acquire, check that the inode we locked
  is still the one at the path (someone may have replaced the file, and two
  processes would then "hold" different inodes: split brain);
- a fresh open file description per acquisition, so a wait abandoned at its
  timeout can never release a lock taken by a later acquisition;
- a wait given up at its timeout is parked and adopted by the next wait on the
  same file, so timeouts cost no threads or fds beyond one per file.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
import time
from typing import Callable
from pathlib import Path

from vramd.arena import proclocks
from vramd.arena.layout import describe_open_error, require_regular
from vramd.errors import ArenaError, TokenError

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_lock_file(path: Path, what: str) -> int:
    """Open an existing arena lock file for flock (read access is enough)."""
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except FileNotFoundError:
        raise ArenaError(f"{path}: {what} is missing") from None
    except OSError as e:
        raise TokenError(f"{path}: {describe_open_error(e)}") from None
    try:
        require_regular(fd, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


# Poll period of a bounded or cancellable wait (the flock itself is blocking,
# in a helper thread; this is only how often we look at the clock and `cancel`).
_WAIT_SLICE = 0.05


class _Waiter:
    """One blocking flock in a helper thread, on its own fd."""

    def __init__(self, fd: int, op: int, key: tuple):
        self.fd, self.op, self.key = fd, op, key
        self.got = threading.Event()
        self.abandoned = False
        self.failure: list[BaseException] = []
        threading.Thread(target=self._wait, name="vramd-flock-wait", daemon=True).start()

    def _wait(self) -> None:
        try:
            fcntl.flock(self.fd, self.op)
        except BaseException as e:  # pragma: no cover - flock on a valid fd
            self.failure.append(e)
        with _parked_lock:
            if self.abandoned or self.failure:
                if _parked.get(self.key) is self:
                    del _parked[self.key]
                os.close(self.fd)
                return
            self.got.set()


# Waits given up at their timeout, by (device, inode, op): the next wait on the same file
# adopts the helper still blocked there instead of starting another.  Before, every timed-out
# wait left a thread and an fd blocked until the holder released (150 timeouts: +150 each;
# under RLIMIT_NOFILE 48, "Too many open files").  Now at most one per file and op.
_parked: dict[tuple, _Waiter] = {}
_parked_lock = threading.Lock()


def parked_waits() -> int:
    """How many given-up waits are still blocked (a bounded number: tests look)."""
    with _parked_lock:
        return len(_parked)


def flock_wait(open_fd, op: int, timeout: float | None, cancel: Callable[[], bool] | None = None) -> int | None:
    """Take `op` (LOCK_EX or LOCK_SH) on a freshly opened fd; wait at most `timeout` s.

    Returns the locked fd, or None on timeout or when `cancel()` turns true.
    flock(2) has no timeout, so a bounded wait blocks in a helper thread
    (flock releases the GIL).  If we give up first, the helper is parked: the
    next wait on the same file and op adopts it (its fd has never held the
    lock, so it is as fresh as a new one); if nobody does by the time the lock
    comes, the helper closes its fd, dropping the lock again.  That fd is the
    helper's, never the caller's, until it is handed over with the lock.
    """
    if timeout is not None and not math.isfinite(timeout):
        timeout = None  # "forever" (inf, 1e300): Event.wait cannot take it, and need not
    fd = open_fd()
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        pass
    except BaseException:
        os.close(fd)
        raise
    if timeout is None and cancel is None:
        try:
            fcntl.flock(fd, op)
        except BaseException:
            os.close(fd)
            raise
        return fd
    if timeout is not None and timeout <= 0:
        os.close(fd)
        return None
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    key = (st.st_dev, st.st_ino, op)
    with _parked_lock:
        w = _parked.pop(key, None)
        if w is not None:
            w.abandoned = False   # adopted: its lock, when it comes, is ours
    if w is not None:
        os.close(fd)
    else:
        w = _Waiter(fd, op, key)

    def give_up() -> bool:
        """Park the wait unless the lock came meanwhile (then keep it)."""
        with _parked_lock:
            if w.got.is_set():
                return False
            w.abandoned = True
            _parked.setdefault(key, w)
            return True

    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, deadline - time.monotonic())
            if w.got.wait(max(0.0, left)):
                return w.fd
            if w.failure:
                raise w.failure[0]
            if (cancel is not None and cancel()) or (deadline is not None and time.monotonic() >= deadline):
                return w.fd if not give_up() else None
    except BaseException:
        if not give_up():
            os.close(w.fd)  # the lock came just now: drop it, we are leaving with an error
        raise


class Token:
    """One process's handle on the arena token."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None
        self.acquired_at: float | None = None  # time.monotonic() of the last acquire
        # check() may run on another thread (the daemon's guard) than release(): without
        # this, a released fd's number reused by another file would look like a replaced token.
        self._fd_lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        return open_lock_file(self.path, "token file")

    def acquire(self, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> bool:
        """Block until we hold the token (or `timeout` s pass, or `cancel()`: False)."""
        if self._fd is not None:
            return True
        fd = flock_wait(self._open, fcntl.LOCK_EX, timeout, cancel)
        if fd is None:
            return False
        self._adopt(fd)
        return True

    def try_acquire(self) -> bool:
        """Take the token if nobody holds it; never blocks."""
        return self.acquire(timeout=0)

    def _adopt(self, fd: int) -> None:
        try:
            check_same_inode(fd, self.path)
        except BaseException:
            os.close(fd)  # drop the lock on the orphaned inode
            raise
        self._fd = fd
        self.acquired_at = time.monotonic()

    def release(self) -> None:
        """Drop the token.  A no-op when not held."""
        with self._fd_lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def key(self) -> tuple[int, int, int]:
        """(major, minor, inode) of the token as /proc/locks names it."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:   # the arena wiped under us: a 503 that names it, not a bare errno
            raise ArenaError(f"{self.path}: token file is missing") from None
        return proclocks.file_key(st)

    def holders(self) -> list[int]:
        return proclocks.flock_holders(self.key())

    def waiters(self) -> list[int]:
        return proclocks.flock_waiters(self.key())

    def check(self) -> None:
        """Verify, while holding, that the token at the path is still ours."""
        with self._fd_lock:
            if self._fd is not None:
                check_same_inode(self._fd, self.path)


def check_same_inode(fd: int, path: Path) -> None:
    """Split-brain guard: the locked inode must still be the one at `path`."""
    held = os.fstat(fd)
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        now = None
    if held.st_nlink < 1 or now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        raise TokenError(f"{path}: the token file was replaced or unlinked while we waited for it; "
                         "another process may believe it holds the GPU. Only `vramd` may create it: "
                         "stop whatever removed it, then restart the participants")


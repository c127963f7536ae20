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
  timeout can never release a lock taken by a later acquisition.
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


def flock_wait(open_fd, op: int, timeout: float | None, cancel: Callable[[], bool] | None = None) -> int | None:
    """Take `op` (LOCK_EX or LOCK_SH) on a freshly opened fd; wait at most `timeout` s.

    Returns the locked fd, or None on timeout or when `cancel()` turns true.
    flock(2) has no timeout, so a bounded wait blocks in a helper thread
    (flock releases the GIL); if we give up first, or anything goes wrong
    while we wait, the thread closes its fd as soon as the lock comes,
    dropping it again.  That fd is its own, never the caller's.
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

    got = threading.Event()
    guard = threading.Lock()
    abandoned = False
    failure: list[BaseException] = []

    def wait():
        try:
            fcntl.flock(fd, op)
        except BaseException as e:  # pragma: no cover - flock on a valid fd
            failure.append(e)
        with guard:
            if abandoned or failure:
                os.close(fd)
                return
            got.set()

    def give_up() -> bool:
        """Mark the wait abandoned unless the lock came meanwhile (then keep it)."""
        nonlocal abandoned
        with guard:
            if got.is_set():
                return False
            abandoned = True
            return True

    threading.Thread(target=wait, name="vramd-flock-wait", daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, deadline - time.monotonic())
            if got.wait(max(0.0, left)):
                return fd
            if failure:
                raise failure[0]
            if (cancel is not None and cancel()) or (deadline is not None and time.monotonic() >= deadline):
                return fd if not give_up() else None
    except BaseException:
        if not give_up():
            os.close(fd)  # the lock came just now: drop it, we are leaving with an error
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
        return proclocks.file_key(os.stat(self.path, follow_symlinks=False))

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


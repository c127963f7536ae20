"""The doorbell: `doorbell/<pid>` files that ask the token holder to yield.

Ringing is create/write/close of `doorbell/<pid>` (an IN_CLOSE_WRITE), exactly
what llama.cpp's arbiter and a shell script (`echo 1 > doorbell/$$`) do.  The
holder watches the directory with inotify.  inotify is lossy in ways that
matter here, so the watcher:

- rescans the directory after adding the watch (a ring written just before
  it produced no event) and after IN_Q_OVERFLOW (events were dropped);
- treats the directory as a set of pending rings, never counts events
  (identical events coalesce);
- ignores its own pid and names that are not live pids (inotify says nothing
  about who rang, so anyone who can write the directory can ring any name);
- cleans ring files left by dead processes, using the process's start time so
  that a reused pid does not revive an old ring.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import psutil
from inotify_simple import INotify, flags

from vramd.arena.layout import describe_open_error
from vramd.errors import ArenaError

# Longest decimal pid Linux can hand out (pid_max <= 2^22).
_MAX_PID_DIGITS = 7
_WATCH_MASK = flags.CLOSE_WRITE | flags.MOVED_TO | flags.DELETE_SELF | flags.ONLYDIR | flags.DONT_FOLLOW


def ring(doorbell_dir: Path, pid: int | None = None) -> Path:
    """Ring as `pid` (default: this process): create, write and close doorbell/<pid>.

    The name is ours, so something else planted under it (a symlink, FIFO,
    directory, a hard link to another file, or a file of another user) is
    removed once and the ring retried.  The file is checked before it is
    truncated, so a planted hard link never costs its target its contents.
    In a sticky doorbell/ another user's file can be removed only by the
    directory's owner (a system arena's doorbell/ belongs to the daemons'
    user): anyone else gets an ArenaError naming the file's owner.
    """
    pid = os.getpid() if pid is None else pid
    path = Path(doorbell_dir) / str(pid)
    for attempt in (1, 2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o660)
        except FileNotFoundError:
            raise ArenaError(f"{doorbell_dir}: doorbell directory is missing") from None
        except OSError as e:
            # EACCES/EPERM: another user's file we may not write (or, with
            # fs.protected_regular, may not even open O_CREAT).
            if attempt == 1 and e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM) \
                    and _remove_planted(path):
                continue
            owner = _foreign_owner(path)
            if owner is not None:
                raise ArenaError(f"{path}: cannot ring: the ring file belongs to uid {owner} and cannot be removed "
                                 "(a sticky doorbell/ not owned by this user)") from None
            raise ArenaError(f"{path}: cannot ring: {describe_open_error(e)}") from None
        try:
            st = os.fstat(fd)
            ours = stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()
            if ours:
                os.ftruncate(fd, 0)
                os.write(fd, b"1")
        finally:
            os.close(fd)
        if ours:
            return path
        if attempt == 1 and _remove_planted(path):
            continue
        raise ArenaError(f"{path}: cannot ring: the ring file is not a regular file of ours "
                         f"(a hard link, or uid {st.st_uid}'s) and cannot be removed")
    raise AssertionError("unreachable")


def _foreign_owner(path: Path) -> int | None:
    """The uid owning `path` if that is another user, else None."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return None
    return uid if uid != os.geteuid() else None


def _remove_planted(path: Path) -> bool:
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
        return True
    except OSError:
        return False


def parse_pid(name: str) -> int | None:
    """A ring's name as a pid, or None: plain digits, no sign, no leading zero."""
    if not name or len(name) > _MAX_PID_DIGITS or not name.isascii() or not name.isdigit():
        return None
    if name[0] == "0":
        return None
    return int(name)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


def ring_is_stale(path: Path, pid: int) -> bool:
    """A ring file whose process is gone, or older than the process now using its pid."""
    try:
        proc = psutil.Process(pid)
        started = proc.create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
    try:
        mtime = os.lstat(path).st_mtime
    except FileNotFoundError:
        return False
    # create_time has ~10 ms resolution (clock ticks): allow for it.
    return mtime < started - 0.05


@dataclass
class RingScan:
    """One look at doorbell/: live rings by pid (with mtime) and what was cleaned."""

    rings: dict[int, float] = field(default_factory=dict)
    cleaned: list[str] = field(default_factory=list)


def scan(doorbell_dir: Path, *, clean: bool = True) -> RingScan:
    """List the live rings; unlink ring files of dead processes (when we may)."""
    out = RingScan()
    try:
        names = os.listdir(doorbell_dir)
    except (FileNotFoundError, PermissionError):
        return out  # a ring-only group member may not list it
    for name in names:
        pid = parse_pid(name)
        path = Path(doorbell_dir) / name
        if pid is None:
            # Junk (nothing rings under a name that is no pid): removed, or every later scan
            # lists it again (100k planted names made each switch 28 -> 666 ms).  unlink
            # never follows a symlink; a directory stays (rmdir is not ours to do).
            if clean:
                _unlink_into(path, out.cleaned)
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # a planted FIFO/dir/symlink rings for nobody
        if ring_is_stale(path, pid):
            if clean:
                _unlink_into(path, out.cleaned)
            continue
        out.rings[pid] = st.st_mtime
    return out


def _unlink_into(path: Path, cleaned: list[str]) -> None:
    """Remove a stale or junk name if we may (and say so in `cleaned`)."""
    try:
        os.unlink(path)
        cleaned.append(path.name)
    except OSError:
        pass


def remove_ring(doorbell_dir: Path, pid: int | None = None) -> bool:
    """Withdraw our own ring (once we hold the token it asks for nothing).

    False when a file under our pid is there and may not be removed (another
    user's, in a sticky doorbell/ we do not own): it rings for nobody, since
    a holder ignores its own pid and others find it forged.  Never raises for
    that: a caller on an error path must still publish and release.
    """
    try:
        os.unlink(Path(doorbell_dir) / str(os.getpid() if pid is None else pid))
    except FileNotFoundError:
        pass
    except PermissionError:
        return False
    return True


# An unproven ring (see RingGate) from one pid, or from one ring-file owner
# (a uid other than root's and the holder's), is acted on at most once per
# this many seconds; how often a deferred ring is looked at again meanwhile.
UNPROVEN_RING_INTERVAL = 1.0
PROOF_POLL = 0.05


def ring_owner(path: Path, pid: int) -> tuple[int | None, bool]:
    """(uid owning doorbell/<pid>, was it written by pid's own user or root?).

    The file's owner is whoever created it; a ring naming another user's
    process is forged (a ringer spreading its flood over names not its own).
    A pid whose owner cannot be seen (/proc mounted `hidepid`, another
    user's process) is not plausible either: only a proof can admit its ring.
    (None, False) when there is no regular file under that name.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return None, False
    if not stat.S_ISREG(st.st_mode):
        return None, False
    if st.st_uid == 0:
        return 0, True
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return st.st_uid, False  # hidepid: the process is hidden from us, so nothing vouches for the ring
    return st.st_uid, st.st_uid == owner


def ring_owner_plausible(path: Path, pid: int) -> bool:
    """Was doorbell/<pid> written by pid's own user (or root)?  (See ring_owner.)"""
    return ring_owner(path, pid)[1]


class RingGate:
    """Which rings to act on: a rate limit on the doorbell, per ringer and per ringing user.

    A ring from a pid the kernel shows waiting for the token (blocked in
    flock on it, holding a live ticket, or holding the token when we are
    cold) is *proven* and always acted on.  Any other ring (a script's
    `echo 1 > doorbell/$$`, `vramd ring`, a flood) is *unproven*: acted on at
    most once per `interval` seconds per ringing pid, and at most once per
    `interval` per owner of the ring file (its uid), unless that uid is root
    or the holder's own (either could stop the holder anyway, by a signal):
    a user cannot multiply its rings by ringing as each of its processes.
    Further rings meanwhile are deferred, not dropped: acted on when the
    interval of their pid and their uid ends (if the pid rang again after the
    last ring of it acted on) or as soon as they are proven.  A flooding pid
    never delays another user's ring.  An unproven ring whose file belongs to
    a user other than the pid's (or root), or whose pid's owner cannot be
    seen (hidepid), is forged and ignored.

    `admit()` is called by one thread at a time (the warden, or the holder
    right after it went warm); a lock keeps that true.
    """

    def __init__(self, doorbell_dir: Path, interval: float = UNPROVEN_RING_INTERVAL):
        self.dir = Path(doorbell_dir)
        self.interval = interval
        self._lock = threading.Lock()
        self._acted: dict[int, tuple[float, float]] = {}   # pid -> (monotonic, wall) of the last unproven ring acted on
        self._uid_acted: dict[int, float] = {}              # uid -> monotonic of its last unproven ring acted on
        self._deferred: dict[int, int | None] = {}          # pid -> the uid its ring file had
        self._last_proof = 0.0
        self._exempt = {0, os.geteuid()}
        self.forged = 0       # counters, for tests and logs
        self.deferrals = 0

    def _pid_due(self, pid: int) -> float:
        acted = self._acted.get(pid)
        return acted[0] + self.interval if acted is not None else 0.0

    def _uid_due(self, uid: int | None) -> float:
        if uid is None or uid in self._exempt:
            return 0.0
        at = self._uid_acted.get(uid)
        return at + self.interval if at is not None else 0.0

    def _due(self, pid: int) -> float:
        return max(self._pid_due(pid), self._uid_due(self._deferred.get(pid)))

    def admit(self, rang: Iterable[int], waiting: Callable[[], set[int]]) -> set[int]:
        """The pids, among `rang` and those deferred earlier, whose ring to act on now.

        `waiting()` names the pids the kernel shows waiting for the token;
        it is asked only when some ring would otherwise be deferred.
        """
        with self._lock:
            now = time.monotonic()
            out: set[int] = set()
            proven: set[int] | None = None

            def is_proven(pid: int) -> bool:
                nonlocal proven
                if proven is None:
                    proven, self._last_proof = set(waiting()), now
                return pid in proven

            due_deferred = {pid for pid in self._deferred if self._due(pid) <= now}
            poll = bool(self._deferred) and now - self._last_proof >= PROOF_POLL
            for pid in set(rang) | due_deferred | (set(self._deferred) if poll else set()):
                path = self.dir / str(pid)
                if not pid_alive(pid):
                    self._deferred.pop(pid, None)
                    continue
                uid, plausible = ring_owner(path, pid)
                acted = self._acted.get(pid)
                if self._pid_due(pid) <= now:
                    if pid in self._deferred and acted is not None and not _rang_after(path, acted[1]):
                        self._deferred.pop(pid, None)  # nothing new since the ring we acted on
                        continue
                    if not plausible:
                        if not is_proven(pid):
                            self.forged += 1
                            self._deferred.pop(pid, None)
                            continue
                        self._act(pid, None, now, out)
                        continue
                    if self._uid_due(uid) <= now:
                        self._act(pid, uid, now, out)
                        continue
                # Acted on lately (this pid, or another ring of its user): only
                # a proof lets it through now.  A pid deferred already waits for
                # the next poll (a flood costs no proof per ring); a new one is
                # checked at once.
                if pid not in self._deferred or poll:
                    if is_proven(pid):
                        self._deferred.pop(pid, None)
                        out.add(pid)
                        continue
                if pid not in self._deferred:
                    self.deferrals += 1
                self._deferred[pid] = uid
            if len(self._acted) > 4096:
                self._acted = {p: t for p, t in self._acted.items()
                               if p in self._deferred or now - t[0] < self.interval}
            if len(self._uid_acted) > 4096:
                self._uid_acted = {u: t for u, t in self._uid_acted.items() if now - t < self.interval}
            return out

    def _act(self, pid: int, uid: int | None, now: float, out: set[int]) -> None:
        """Act on an unproven (or proven but implausible) ring: it counts against its pid, and its uid."""
        self._acted[pid] = (now, time.time())
        if uid is not None and uid not in self._exempt:
            self._uid_acted[uid] = now
        self._deferred.pop(pid, None)
        out.add(pid)

    def next_check(self) -> float | None:
        """Seconds until deferred rings need another look (None: nothing deferred)."""
        with self._lock:
            if not self._deferred:
                return None
            now = time.monotonic()
            due = min(self._due(p) for p in self._deferred) - now
            return max(0.0, min(PROOF_POLL, due))


def _rang_after(path: Path, wall: float) -> bool:
    """Was the ring file written again after wall time `wall`?"""
    try:
        return os.lstat(path).st_mtime > wall
    except OSError:
        return False


class Watcher:
    """inotify watch on doorbell/ that reports which live pids rang.

    `wait(timeout)` returns the set of pids that rang since the last call
    (None for "the queue overflowed or the watch started: rescan").  The
    caller decides what a ring means; this class only says who.
    """

    def __init__(self, doorbell_dir: Path, own_pid: int | None = None):
        self.dir = Path(doorbell_dir)
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self._inotify = INotify(nonblocking=True)
        try:
            self._wd = self._inotify.add_watch(str(self.dir), _WATCH_MASK)
        except OSError as e:
            self._inotify.close()
            raise ArenaError(f"{self.dir}: cannot watch the doorbell: {e.strerror}") from None
        # Wakes a thread blocked in wait() when close() is called.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._need_rescan = True  # rings written before add_watch made no event
        self.gone = False  # the directory was removed (IN_IGNORED / DELETE_SELF)

    def fileno(self) -> int:
        return self._inotify.fileno()

    def wait(self, timeout: float | None) -> set[int] | None:
        """Block up to `timeout` s for rings; return live foreign pids, or None to rescan."""
        if self._need_rescan:
            self._need_rescan = False
            return None
        events = self._read(timeout)
        rang: set[int] = set()
        for ev in events:
            if ev.mask & flags.Q_OVERFLOW:
                return None
            if ev.mask & (flags.IGNORED | flags.DELETE_SELF):
                self.gone = True
                continue
            pid = parse_pid(ev.name)
            if pid is not None and pid != self.own_pid:
                rang.add(pid)
        return {pid for pid in rang if pid_alive(pid)}

    def _read(self, timeout: float | None):
        poller = select.poll()
        poller.register(self._inotify.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        ready = poller.poll(ms)  # EINTR is retried by Python (PEP 475)
        if not ready:
            return []
        try:
            return list(self._inotify.read(timeout=0))
        except (BlockingIOError, ValueError, OSError):
            return []  # closed under us, or nothing after all

    def interrupt(self) -> None:
        """Wake a thread blocked in wait()."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        self.interrupt()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._inotify.close()


def wait_for_any_ring(doorbell_dir: Path, timeout: float) -> set[int]:
    """Test and CLI helper: block until some foreign live pid rings."""
    w = Watcher(doorbell_dir)
    try:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = w.wait(left)
            if got:
                return got
        return set()
    finally:
        w.close()

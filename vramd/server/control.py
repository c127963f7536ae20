"""The daemon's control socket: `<arena>/control/<name>.sock`, one JSON line each way.

Requests: {"cmd": "status" | "wake" | "yield" | "shutdown" | "verify", ...}
Replies:  {"ok": true, ...} or {"ok": false, "error": "...", "code": <exit code>}

Who may connect: the socket file is mode 0660 in a directory of the arena,
and every connection's SO_PEERCRED is checked: the same uid, root, or a
process in the control directory's group when that directory grants its
group access (a system arena is group-shared; a private 0700 arena shares
with nobody, whatever its group).  Others get a refusal and are logged.
The socket is bound in a fresh private directory, given its mode there, and
renamed into place, so nothing swapped in at its path gets the chmod.  The CLI's `status`, `yield` and `wake` are thin
clients of this (`request()` below).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from vramd.arena.layout import describe_open_error, require_regular
from vramd.errors import ArenaError, PeerError, Timeout, VramdError

log = logging.getLogger("vramd.control")

MAX_REQUEST = 64 * 1024
CLIENT_TIMEOUT = 30.0


def _lock_name(path: Path) -> int:
    """Hold <name>.lock (flock) for the daemon's life; refuse a name already held."""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o660)
    except OSError as e:
        raise PeerError(f"{path}: cannot open: {describe_open_error(e)}") from None
    try:
        require_regular(fd, path, "control name lock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ArenaError:
        os.close(fd)
        raise
    except BlockingIOError:
        os.close(fd)
        raise PeerError(f"{path.with_suffix('')}: another daemon with this name runs in this arena; "
                        "choose another --name") from None
    return fd
_UCRED = struct.Struct("3i")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def process_groups(pid: int) -> set[int]:
    """Supplementary and primary gids of `pid` (from /proc; empty if gone)."""
    groups: set[int] = set()
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Gid:"):
                    groups.update(int(g) for g in line.split()[1:3])
                elif line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return groups


def allowed(pid: int, uid: int, gid: int, arena_gid: int | None) -> bool:
    """Root, our own uid, or (when the directory is group-shared) its group."""
    if uid in (0, os.getuid()):
        return True
    if arena_gid is None:
        return False
    return gid == arena_gid or arena_gid in process_groups(pid)


class ControlServer:
    """Accepts connections on a thread; `handle(request) -> reply` does the work."""

    def __init__(self, path: Path, handle: Callable[[dict], dict]):
        self.path = Path(path)
        self.handle = handle
        parent = os.stat(self.path.parent)
        # The directory's group counts only if the directory lets its group in.
        self.arena_gid = parent.st_gid if parent.st_mode & stat.S_IRWXG else None
        # The name is ours for as long as we live: a flock on <name>.lock, so
        # two daemons starting with one name at once cannot both bind it.
        self._name_lock = _lock_name(self.path.with_suffix(".lock"))
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._remove_stale()
            self._inode = self._bind()
            self._sock.listen(16)
        except BaseException:
            self._sock.close()
            os.close(self._name_lock)
            raise
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="vramd-control", daemon=True)

    def _bind(self) -> int:
        """Bind in a private directory, chmod there, rename into place; the inode."""
        tmpdir = tempfile.mkdtemp(prefix=".b", dir=self.path.parent)  # 0700, ours
        tmp = os.path.join(tmpdir, "s")
        try:
            self._sock.bind(tmp)
            os.chmod(tmp, 0o660)
            inode = os.lstat(tmp).st_ino
            os.rename(tmp, self.path)
            return inode
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            os.rmdir(tmpdir)

    def _remove_stale(self) -> None:
        """A socket left by a SIGKILLed daemon of the same name blocks bind: remove it
        if nobody answers on it (a live daemon with our name was refused earlier)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise PeerError(f"{self.path}: exists and is not a socket (remove it)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            self.path.unlink(missing_ok=True)
            return
        finally:
            probe.close()
        raise PeerError(f"{self.path}: another daemon answers on this control socket")

    def start(self) -> "ControlServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        # The control plane must outlive a shortage: out of fds (EMFILE) or threads, it
        # refuses what it cannot serve and goes on (before, the thread died for good and
        # the member was unreachable).
        warned = False
        while not self._stop:
            sock = self._sock
            try:
                conn, _ = sock.accept()
            except OSError as e:
                if self._stop:
                    return  # closed
                if sock is not self._sock:
                    continue  # re-bound (ensure_bound): accept on the new one
                if not warned:
                    log.warning("control: accept failed (%s); retrying", e)
                    warned = True
                time.sleep(0.05)
                continue
            warned = False
            try:
                threading.Thread(target=self._one, args=(conn,), name="vramd-control-conn", daemon=True).start()
            except RuntimeError as e:   # can't start new thread
                log.warning("control: cannot serve a connection: %s", e)
                try:
                    _send(conn, {"ok": False, "error": f"the daemon cannot start a thread for this request ({e}); "
                                                      "try again", "code": 1})
                except OSError:
                    pass
                conn.close()

    def ensure_bound(self) -> bool:
        """Our socket is still at our path; if it was removed or replaced, bind a new one
        there (the guard calls this).  True if it re-bound."""
        try:
            if os.lstat(self.path).st_ino == self._inode:
                return False
        except FileNotFoundError:
            pass
        if self._stop or not self.path.parent.is_dir():
            return False
        new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = self._sock
        try:
            self._sock = new
            self._remove_stale()
            self._inode = self._bind()
            new.listen(16)
        except BaseException:
            self._sock = old
            new.close()
            raise
        log.warning("control: %s was removed or replaced: bound it again", self.path)
        try:
            old.shutdown(socket.SHUT_RDWR)   # wakes the accept() blocked on it
        except OSError:
            pass
        old.close()
        return True

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(CLIENT_TIMEOUT)  # a silent client must not keep a thread for ever
        with conn:
            pid, uid, gid = peer_credentials(conn)
            if not allowed(pid, uid, gid, self.arena_gid):
                log.warning("control: refused pid %d uid %d (not our uid, root or the arena's group)", pid, uid)
                _send(conn, {"ok": False, "error": "permission denied: not the daemon's user or the arena's group",
                             "code": PeerError.exit_code})
                return
            try:
                request = _recv(conn)
            except (ValueError, OSError, RecursionError) as e:
                _send(conn, {"ok": False, "error": f"bad request: {type(e).__name__}: {e}"[:300], "code": 2})
                return
            try:
                reply = self.handle(request)
            except VramdError as e:
                reply = {"ok": False, "error": str(e), "code": e.exit_code}
            except Exception as e:  # a bug: say so, keep serving
                log.exception("control request %r failed", request)
                reply = {"ok": False, "error": f"internal error: {e}", "code": 1}
            _send(conn, reply)

    def close(self) -> None:
        self._stop = True
        try:
            self._sock.close()
            try:
                if os.lstat(self.path).st_ino == self._inode:  # only our own socket
                    self.path.unlink()
            except FileNotFoundError:
                pass
        finally:
            os.close(self._name_lock)


def _recv(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError("request too large")
    request = json.loads(data.decode())
    if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
        raise ValueError('expected {"cmd": "..."}')
    return request


def _send(conn: socket.socket, reply: dict) -> None:
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass


def request(path: str | Path, cmd: str, *, wait: float = 30.0, **args) -> dict:
    """Client side: send one request, wait up to `wait` s for the reply; errors become VramdErrors."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(wait)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise PeerError(f"{path}: no daemon answers (is it running? see `vramd status`)") from None
        except PermissionError:
            raise PeerError(f"{path}: permission denied (not the daemon's user or the arena's group)") from None
        try:
            sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused (peer credentials) before it read us: its reply is still there to read
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        raise Timeout(f"{path}: no reply to {cmd!r} within {wait:g} s") from None
    finally:
        sock.close()
    if not data:
        raise PeerError(f"{path}: the daemon closed the connection without a reply")
    reply = json.loads(data)
    if not reply.get("ok"):
        err = VramdError(reply.get("error", "failed"))
        err.exit_code = int(reply.get("code", 1))
        raise err
    return reply

"""sd_notify: telling systemd that a daemon is ready, what it is doing, and that it lives.

This module owns the daemon's side of systemd's notification protocol
(sd_notify(3)), written against the protocol itself rather than libsystemd or
a Python binding: one datagram of newline-separated ``KEY=value`` lines, sent
over an ``AF_UNIX``/``SOCK_DGRAM`` socket to the address in ``$NOTIFY_SOCKET``
(a leading ``@`` names an abstract socket: it stands for a NUL byte).  It also
reads the watchdog settings systemd hands a service (``$WATCHDOG_USEC``,
``$WATCHDOG_PID``).

Outside systemd (no ``$NOTIFY_SOCKET``) every call does nothing at all and
returns False: no socket is created, nothing is logged.  Under systemd a
failed send never raises: a notification is advisory, and a daemon that
serves requests must not die because its service manager went away.  The
first failure is logged as a warning, later ones only at debug level, so a
watchdog ping every few seconds cannot flood the journal.

The unit that uses all of this is ``systemd/vramd@.service`` (Type=notify,
NotifyAccess=main, WatchdogSec=).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

log = logging.getLogger(__name__)

# A send that cannot complete within this time is dropped.  A datagram to a
# full receive queue blocks; PID 1 drains its queue quickly, so a stall means
# the manager is wedged, and the daemon's main loop (which also pings the
# watchdog) must not hang behind it.
SEND_TIMEOUT_S = 1.0

_lock = threading.Lock()  # HTTP and control threads may report STATUS= too
_sock: socket.socket | None = None
_sock_pid: int | None = None  # a socket inherited across fork() is not ours to reuse
_warned = False


def notify_address() -> bytes | None:
    """The socket address from $NOTIFY_SOCKET, or None when not under systemd.

    Only path sockets (``/...``) and abstract sockets (``@...``) are
    understood; other forms (systemd 253's ``vsock:``) are treated as absent,
    with a warning, rather than sent to a wrong place.
    """
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw:
        return None
    addr = os.fsencode(raw)
    if addr.startswith(b"@"):
        return b"\0" + addr[1:]
    if addr.startswith(b"/"):
        return addr
    _warn_once("NOTIFY_SOCKET=%r is neither a path nor an abstract socket name; not notifying", raw)
    return None


def sd_notify(*lines: str) -> bool:
    """Send the given ``KEY=value`` lines to systemd as one datagram.

    Returns True when the datagram was sent, False when not under systemd or
    when sending failed (logged once; never raised).
    """
    addr = notify_address()
    if addr is None:
        return False
    message = "\n".join(lines).encode("utf-8", "replace")
    global _sock, _sock_pid
    with _lock:
        try:
            if _sock is None or _sock_pid != os.getpid():
                # Unconnected: sendto() names the address every time, so one
                # socket serves even if $NOTIFY_SOCKET changes.  CLOEXEC: a
                # child the daemon runs must not inherit it.
                _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                _sock.settimeout(SEND_TIMEOUT_S)
                _sock_pid = os.getpid()
            _sock.sendto(message, addr)
            return True
        except OSError as e:
            # Recreate on the next call: whatever went wrong (the manager
            # restarted, a timeout left the socket in doubt) starts afresh.
            _close_locked()
            _warn_once("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), e)
            return False


def ready(status: str | None = None) -> bool:
    """READY=1: start-up is finished (Type=notify units become "active")."""
    return sd_notify("READY=1", *_status_line(status))


def status(text: str) -> bool:
    """STATUS=: one line that `systemctl status` shows next to "Status:"."""
    return sd_notify(*_status_line(text))


def stopping(status: str | None = None) -> bool:
    """STOPPING=1: the daemon is shutting down (sent when SIGTERM arrives)."""
    return sd_notify("STOPPING=1", *_status_line(status))


def watchdog() -> bool:
    """WATCHDOG=1: the main loop is alive; systemd restarts us if these stop."""
    return sd_notify("WATCHDOG=1")


def extend_timeout(seconds: float) -> bool:
    """EXTEND_TIMEOUT_USEC=: ask for `seconds` more before the start/stop timeout.

    For a start that is making progress but slowly (reading a large model
    from a cold disk, waiting for the GPU token).
    """
    return sd_notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")


def mainpid(pid: int | None = None) -> bool:
    """MAINPID=: name the service's main process (default: this one)."""
    return sd_notify(f"MAINPID={os.getpid() if pid is None else int(pid)}")


def watchdog_interval() -> float | None:
    """How often to call watchdog(), in seconds, or None when no watchdog is asked for.

    systemd sets $WATCHDOG_USEC to the unit's WatchdogSec=; $WATCHDOG_PID,
    when set, names the one process the watchdog watches (a child that
    inherited the environment is not it).  Pinging at half the timeout, as
    sd_watchdog_enabled(3) recommends, leaves room for one late ping.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None
        usec_value = int(usec)
    except ValueError:
        return None
    if usec_value <= 0:
        return None
    return usec_value / 2 / 1_000_000


def _status_line(text: str | None) -> list[str]:
    if text is None:
        return []
    # A newline would end the STATUS= line and start a new assignment: a
    # model name or error message must not be able to send READY=1 or
    # MAINPID= on its own.
    return ["STATUS=" + " ".join(str(text).splitlines())]


def _close_locked() -> None:
    global _sock, _sock_pid
    if _sock is not None:
        try:
            _sock.close()
        except OSError:
            pass
    _sock = None
    _sock_pid = None


def _warn_once(msg: str, *args: object) -> None:
    global _warned
    if _warned:
        log.debug(msg, *args)
    else:
        _warned = True
        log.warning(msg + " (further sd_notify failures are logged at debug level)", *args)


def reset() -> None:
    """Forget the cached socket and the logged-once flag (tests; after fork)."""
    global _warned
    with _lock:
        _close_locked()
        _warned = False

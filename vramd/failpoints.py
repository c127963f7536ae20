"""Named failpoints: fault injection at each step of going warm and going cold.

A failpoint is a named place in the code where a test can make the process
die (SIGKILL) or the step fail (an exception), to prove that whatever
happens there, the token is free or held by a live process, peers go on, a
restarted daemon rejoins, no file is orphaned and no state shadow is torn.

They are armed by one environment variable, read once when this module is
imported:

    VRAMD_FAILPOINTS="restore.mid=kill,release.mid=raise@2,encode.mid=log"

`NAME=ACTION[@N]`, comma-separated.  ACTION is `kill` (SIGKILL this process),
`raise` (the step fails: `InjectedFault`, a DeviceError, on the Python side; a
native call fails with "failpoint NAME: injected fault" on the C side), or
`log` (print "vramd: failpoint NAME reached" on stderr at every hit: what the
coverage test uses).  `@N` acts on the N-th hit only (default: the first), so
a test can pass the start-up's first upload and strike at the next switch.
An unknown name or action is a UsageError: a renamed step must not silently
drop a test's fault.

Unset (production), `failpoint(name)` is a function that tests one module
global and returns (tests/gpu/test_failpoints.py checks it looks up
nothing): measured ~75 ns a call on the 2-core dev machine against ~65 ns
for an empty Python call (`python -m timeit -s "from vramd.failpoints
import failpoint" "failpoint('warm.after_token')"`), passed a handful of
times per switch, whose cost is at least a millisecond; the native points
are one load and a predicted branch (native/src/failpoint.c).

Every failpoint is in POINTS below (and in docs/architecture.md, "Fault
injection"); tests/integration/test_failpoints.py checks that each one is
reached by a real switch, and drives each with both actions.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

from vramd.errors import InjectedFault, UsageError

ENV = "VRAMD_FAILPOINTS"
ACTIONS = ("kill", "raise", "log")

# name -> (side, where it fires).  Side "native" points live in the C
# residency core (native/src/failpoint.c has the same names).
POINTS: dict[str, tuple[str, str]] = {
    "warm.before_token": ("python", "going warm: queued and rang (ticket and ring file exist), flock not yet taken"),
    "warm.after_token": ("python", "going warm: token held, ring file still there, nothing restored"),
    "restore.mid": ("native", "going warm: half of the restore's blocks are uploading, the rest not yet allocated"),
    "warm.restored": ("python", "going warm: buffers restored, member record not yet 'warm'"),
    "evict.mid": ("native", "going cold: half of the state (KV) copies device->shadow recorded, nothing submitted"),
    "evict.copied": ("native", "going cold: state copied to its shadow (new generation), device copy not yet freed"),
    "release.mid": ("native", "going cold: between the regions of one release (some freed, the rest resident)"),
    "cold.before_unlock": ("python", "going cold: released, record published, token still held"),
    "encode.mid": ("python", "an image encode: encoder and activations on the device, its graph submitted, "
                             "not finished"),
}

_NATIVE_ACTION = {"kill": 1, "raise": 2, "log": 3}

# name -> (action, at); hits count per name.
_armed: dict[str, tuple[str, int]] = {}
_hits: dict[str, int] = {}
_native_arm: Callable[[str, int, int], None] | None = None


def parse(spec: str) -> dict[str, tuple[str, int]]:
    """`NAME=ACTION[@N],...` -> {name: (action, n)}; UsageError on anything unknown."""
    out: dict[str, tuple[str, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, eq, rest = item.partition("=")
        name = name.strip()
        action, at, n = rest.strip().partition("@")
        if not eq or name not in POINTS:
            raise UsageError(f"{ENV}: unknown failpoint {name!r} in {item!r} (known: {', '.join(POINTS)})")
        if action not in ACTIONS:
            raise UsageError(f"{ENV}: {item!r}: the action is one of {', '.join(ACTIONS)}")
        if at and not (n.isdigit() and int(n) >= 1):
            raise UsageError(f"{ENV}: {item!r}: @N needs a positive integer")
        out[name] = (action, int(n) if at else 1)
    return out


def arm(spec: str | dict) -> None:
    """Replace the armed set (a spec string, or parse()'s dict); '' disarms all.

    The environment variable is the way in for daemons; tests in one process
    call this directly."""
    global _armed
    points = parse(spec) if isinstance(spec, str) else dict(spec)
    _armed = {}
    _hits.clear()
    if _native_arm is not None:
        for name, (side, _) in POINTS.items():
            if side == "native":
                action, n = points.get(name, (None, 1))
                _native_arm(name, _NATIVE_ACTION.get(action, 0), n)
    _armed = {name: v for name, v in points.items() if POINTS[name][0] == "python"}
    _pending_native.clear()
    _pending_native.update({name: v for name, v in points.items() if POINTS[name][0] == "native"})


# Native points named before the native core was loaded: armed when it registers.
_pending_native: dict[str, tuple[str, int]] = {}


def register_native(arm_fn: Callable[[str, int, int], None]) -> None:
    """Called by vramd.gpu.residency when it loads the core: arms its points."""
    global _native_arm
    _native_arm = arm_fn
    for name, (action, n) in _pending_native.items():
        arm_fn(name, _NATIVE_ACTION[action], n)


def failpoint(name: str) -> None:
    """A named step; does nothing unless VRAMD_FAILPOINTS (or arm()) names it."""
    if _armed:
        _fire(name)


def _fire(name: str) -> None:
    hit = _armed.get(name)
    if hit is None:
        return
    action, at = hit
    n = _hits[name] = _hits.get(name, 0) + 1
    if action == "log":
        _say(f"vramd: failpoint {name} reached")
        return
    if n != at:
        return
    if action == "kill":
        _say(f"vramd: failpoint {name}: SIGKILL")
        os.kill(os.getpid(), signal.SIGKILL)
        signal.pause()  # not reached: the signal is delivered before kill() returns
    _say(f"vramd: failpoint {name}: injected fault")
    raise InjectedFault(f"failpoint {name}: injected fault")


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def armed() -> dict[str, tuple[str, int]]:
    """What is armed now (both sides), for logs and tests."""
    return {**_armed, **_pending_native}


def describe_armed() -> str:
    """What is armed, as `NAME=ACTION@N` items ('' when nothing is): for the
    warning `vramd serve` logs and the member record `vramd status` shows."""
    return ",".join(f"{name}={action}@{at}" for name, (action, at) in sorted(armed().items()))


arm(os.environ.get(ENV, ""))

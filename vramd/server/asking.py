"""Asking parked peers to evict: quickly with the token held, slowly without it.

Owns: the evict requests a member going warm sends its parked peers (Asking,
which vramd/server/room.py's Room is; the policy of whom to ask and for how
much is the Room's), how long each is waited for, with the token and without
it, and what came of each (`asked`, in the refusal's text).

The checks run with the
token held (the budget and the device must not change under them).  A peer
asked to evict answers in milliseconds when it is responsive (QUICK_ASK), and
in EVICT_WAIT s or never when it hangs or is stopped.  So each peer is asked
with the token still held, for QUICK_ASK s at most: the room a responsive
peer makes is then ours, and nobody else can take it before our restore (the
soak's three-way contention needs this: issue 19, 4c's first version asked
everybody without the token, and a third member took the room a peer had
just made, so the restore went on short and failed later in scratch).  A
peer that has not answered within QUICK_ASK makes us step aside: the checks
raise arbiter.StepAside whose work keeps waiting for that same request (it
runs in a thread of its own, so it survives the StepAside), bounded by
EVICT_WAIT and the requester's deadline and polling its cancel, then asks the
peers left, all without the token; holding it meanwhile would keep every
other member, `vramd exec` and flock-only peer off the GPU (4c).  The
Participant then queues again and calls prepare_restore again, which looks
afresh.  A stopped peer (ask_over_socket) fails at once: counted out, no
step aside.  A peer that did not answer (timed out, stopped, refused) is not
asked again in the same warm-up (`begin()` starts one); one that answered,
releasing, may be, in the first ROOM_CHECKS rounds of asking only
(askable()), so the asking ends: in a restore, or in the refusal
(OutOfDeviceMemory, a 503, naming who was asked) once the room is still
short with nobody left to ask.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from typing import Callable

from vramd.arena.arbiter import StepAside
from vramd.errors import PeerError, VramdError

log = logging.getLogger("vramd.daemon")

# A peer asked to evict answers within this long, and never past what is left of the asker's
# wait (at least ASK_WAIT_MIN), or is counted out: a hung peer costs its asker that much, and
# nobody else more than QUICK_ASK (the asker holds the token no longer); before, 120 s, token held.
EVICT_WAIT = 5.0
ASK_WAIT_MIN = 0.5
# A peer is asked with the token held for this long at most; one that has not answered by then
# is waited for without it (a StepAside).  A responsive peer's eviction answers far within it:
# in the soak (vramd.bench.soak, 20 switches, lavapipe, three daemons on 2 busy cores) 54 answers
# took 2.2 ms median, 8.4 ms at most (cache layout), 16 took 3.4 ms median, 8.9 ms at most
# (mixed): the "answered in" figure of each "released ... to make room" log line.  50x that
# margin still costs the others at most half a second of a hung peer, against EVICT_WAIT.
QUICK_ASK = 0.5
# How often the wait for a peer's answer, token dropped, looks at the requester's cancel.
ANSWER_POLL = 0.05
# After a step aside whose peers evicted, the driver's free figure may lag their frees this long:
# a device-memory check waits it out before it asks anyone else.
SETTLE = 0.3


def ask_over_socket(peer, cmd: str, wait: float = EVICT_WAIT, **args) -> dict:
    """The production `ask`: the peer's control socket (vramd/server/control.py).  A stopped
    peer (SIGSTOP) is not asked at all: it could not answer before `wait` runs out."""
    from vramd.arena.proclocks import pid_stopped
    from vramd.server.control import request
    if pid_stopped(peer.pid):
        raise PeerError(f"{peer.name} (pid {peer.pid}) is stopped; not asked")
    return request(peer.control, cmd, wait=wait, **args)


class Asking:
    """The asking half of Room: it keeps the warm-up's record of the peers asked (`asked`,
    `_answered`, `freed`, `rounds`, `steps`, `_settled`: Room.begin) and calls `ask_peer`
    (ask_over_socket's signature) from a thread of its own for the quick window."""

    def ask(self, peers: list, shortfall: int, left: Callable[[], int] | None = None, why: str = "") -> None:
        """Token held: ask `peers` in turn to release until `shortfall` is covered (`left()`:
        what is still short after each, else the shortfall less what they freed), each for
        QUICK_ASK s at most.  All answered (or failed at once): return, the caller looks again.
        One still silent after QUICK_ASK: raise the StepAside whose work, token dropped, waits
        for its answer and asks the rest (evict_peers)."""
        self.rounds += 1
        for i, peer in enumerate(peers):
            if shortfall <= 0:
                break
            asking = self._send(peer, shortfall)
            if not futures.wait([asking], timeout=self.quick_ask).done:   # still asking: slow
                self._step_aside(peer, asking, peers[i + 1:], shortfall, left, why)
            try:
                reply = asking.result()
            except (VramdError, OSError, ValueError) as e:   # stopped, refused, reset, garbled: counted out
                self._answer(peer, error=e)
                continue
            shortfall = self._answer(peer, reply, shortfall, left)
        if self.freed:
            self._settled = self.clock() + SETTLE

    def _send(self, peer, nbytes: int) -> Future:
        """The evict request to `peer`, sent from a thread of its own (EVICT_WAIT bounds it), so
        that a wait for its answer can go on after the token is dropped."""
        asking: Future = Future()
        self.asked[peer.pid] = f"{peer.name} did not answer"

        def send():
            try:
                asking.set_result(self._timed(peer, EVICT_WAIT, nbytes))
            except BaseException as e:
                asking.set_exception(e)
        threading.Thread(target=send, name=f"vramd-evict-{peer.pid}", daemon=True).start()
        return asking

    def _timed(self, peer, wait: float, nbytes: int) -> dict:
        t0 = time.monotonic()
        reply = self.ask_peer(peer, "evict", wait=wait, bytes=nbytes)
        return {**reply, "ms": (time.monotonic() - t0) * 1e3}

    def _answer(self, peer, reply: dict | None = None, shortfall: int = 0, left=None, error=None) -> int:
        """Record what came of asking `peer`; returns what is still short."""
        if error is not None:
            log.warning("%s: could not evict %s: %s", self.name, peer.name, error)
            self.asked[peer.pid] = f"{peer.name} did not: {error}"
            self._answered.discard(peer.pid)
            return shortfall
        log.info("%s: %s released %d bytes to make room (answered in %.1f ms)", self.name, peer.name,
                 reply["freed"], reply.get("ms", 0.0))
        self.asked[peer.pid] = f"{peer.name} released {reply['freed']} B"
        if reply["freed"]:
            self._answered.add(peer.pid)
        self.freed += reply["freed"]
        return left() if left is not None else shortfall - reply["freed"]

    def _step_aside(self, peer, asking: Future, rest: list, shortfall: int, left, why: str) -> None:
        """Raise the StepAside whose work, token dropped, waits for `peer`'s answer to `asking`
        (no longer than the requester's deadline, nor once it cancels), then asks `rest`."""
        def work(deadline: float | None, cancel: Callable[[], bool] | None) -> None:
            while not futures.wait([asking], timeout=ANSWER_POLL).done:
                if (cancel is not None and cancel()) or (deadline is not None and self.clock() >= deadline):
                    self._answer(peer, error=VramdError("no answer within the time the requester had left"))
                    return
            try:
                still = self._answer(peer, asking.result(), shortfall, left)
            except (VramdError, OSError, ValueError) as e:
                still = self._answer(peer, error=e, shortfall=shortfall)
            self.evict_peers(rest, still, left, deadline=deadline, cancel=cancel)
            if self.freed:
                self._settled = self.clock() + SETTLE
        self.steps += 1
        then = f", then asking {', '.join(f'{m.name} ({m.pid})' for m in rest)} (in eviction order)" if rest else ""
        raise StepAside(f"{self.name}: {why + ': ' if why else ''}{shortfall} B short; parked peer {peer.name} "
                        f"({peer.pid}) has not answered within {self.quick_ask:g} s: waiting for it{then} "
                        "without the token", work)

    def evict_peers(self, peers: list, shortfall: int, left: Callable[[], int] | None = None, *,
                    deadline: float | None = None, cancel: Callable[[], bool] | None = None) -> set[int]:
        """Ask `peers` in turn to release until `shortfall` bytes are freed (`left()`: what is
        still short after each, else the shortfall less what they freed).  Each drains before
        it replies: its memory is back with the driver.  Each waits EVICT_WAIT s at most, and
        no more than is left until `deadline` (the clock's); none is asked after it, nor once
        `cancel()` says so.  Never call this holding the token (a StepAside's work).  Returns the
        pids asked; each is recorded in `asked` with what came of it."""
        asked = set()
        for peer in peers:
            if shortfall <= 0 or (cancel is not None and cancel()):
                break
            wait = EVICT_WAIT
            if deadline is not None:
                left_s = deadline - self.clock()
                if left_s <= 0:
                    break
                wait = min(wait, max(ASK_WAIT_MIN, left_s))
            asked.add(peer.pid)
            try:
                reply = self._timed(peer, wait, shortfall)
            except (VramdError, OSError, ValueError) as e:   # a connection reset, a garbled reply: counted out
                shortfall = self._answer(peer, error=e, shortfall=shortfall)
                continue
            shortfall = self._answer(peer, reply, shortfall, left)
        return asked

    def _asked_text(self) -> str:
        return "; asked in this warm-up: " + ", ".join(self.asked.values()) if self.asked else ""


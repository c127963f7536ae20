"""The participant state machine: when to take the token, and when to give it back.

    cold --ensure_warm()--> warming --restore ok--> warm --idle()/checkpoint()--> cooling --> cold
                             |  ^  |                                                     ^
                             |  |  +--restore failed: token dropped, nothing lost--------+
                             +--+ restore stepped aside (StepAside): token dropped, the
                                  peers asked without it, queued again (still warming)

Any process can be a participant: give it `restore` (bring buffers to the
device; called with the token held, so the very first upload is coordinated
too) and `release` (free them), then call `ensure_warm()` before each compute
and `idle()` at each idle point.  Rules it keeps:

- it yields only at points the caller marks: `idle()` (nothing to do) or
  `checkpoint()` (between two requests while more wait), never mid-compute;
- a ring is honoured only after the holder has held for `quantum` seconds, so
  two busy peers cannot thrash; a ring from a pid that is not waiting for
  the token counts at most once per `ring_interval` per pid and per ringing
  user (doorbell.RingGate), so a flooding ringer gets a bounded number of
  yields however many of its processes it rings as, and delays nobody else;
  a holder that never idles yields at a checkpoint once it has held for
  `max_hold` seconds while someone waits;
- it never holds the token for long while it waits on another process to
  make room: a restore asks parked peers with the token held only while
  they answer quickly (room.py's QUICK_ASK), and for one that does not it
  raises StepAside, whose work waits with the token free (others may take
  it meanwhile);
- waiters are served in arrival order (tickets, see queue.py), and a holder
  that yields queues behind them (so does one that steps aside); a waiter
  that knows only flock (llama.cpp) is not barged either: after yielding to
  one, we let it take the token before we ask again.

A warden thread watches the doorbell and only sets a flag; the caller's
thread does every state change.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Callable

from vramd.arena import doorbell, proclocks
from vramd.arena.layout import Arena
from vramd.arena.members import Member, Registry, empty_breakdown, process_start_time
from vramd.arena.queue import Queue
from vramd.arena.token import Token
from vramd.errors import ArenaError, Interrupted, Timeout, TokenError
from vramd.failpoints import describe_armed, failpoint

log = logging.getLogger("vramd.arbiter")

DEFAULT_QUANTUM = 0.25
DEFAULT_MAX_HOLD = 5.0
# How long a yielding holder lets a flock-only waiter take the token before
# it queues again regardless (that waiter may have given up).
FOREIGN_HANDOFF_WAIT = 1.0
# Coarse file timestamps: a ring this much older than our acquire still counts.
RING_CLOCK_SLACK = 0.05
# How often a waiter blocked on the token checks whether a new holder took it.
RE_RING_INTERVAL = 0.01
# A waiter whose token.lock was replaced while it waited waits again on the new one, this many times.
TOKEN_REPLACED_RETRIES = 3
# close() waits this long for the warden thread (the daemon's stop path counts it: STOP_BOUND).
WARDEN_JOIN = 2.0



class StepAside(Exception):
    """Raised by a `restore` callback, token held and nothing of ours restored yet, when going
    warm first needs other processes to do something that takes long: a parked peer asked over
    its control socket to evict that has not answered within room.py's QUICK_ASK (a responsive
    one answers in ms, token held).  Holding the token while it takes its time (or never
    answers: hung) would keep every other participant off the GPU meanwhile (issue 19, 4c).
    So ensure_warm drops the token, calls `work(deadline, cancel)` without it (the wait for
    that peer's answer, then the peers left), queues again and calls the restore again; the
    restore raises StepAside again only with someone new to ask, or refuses, or fits.

    `work` must bound itself by `deadline` (time.monotonic(), None: none) and call `cancel()`
    (True: give up) between its waits; `what` says what it waits for (logged)."""

    def __init__(self, what: str, work: Callable[[float | None, "Callable[[], bool] | None"], None]):
        super().__init__(what)
        self.what, self.work = what, work


ReleaseFn = Callable[[], "int | None"]
RestoreFn = Callable[[], "int | None"]
BreakdownFn = Callable[[], dict]


class Participant:
    def __init__(self, arena: Arena, name: str, *, model: str = "",
                 restore: RestoreFn | None = None, release: ReleaseFn | None = None,
                 breakdown: BreakdownFn | None = None, freeing: Callable[[], int] | None = None,
                 on_yield_request: Callable[[], None] | None = None,
                 on_ring_while_cold: Callable[[set[int]], None] | None = None,
                 quantum: float = DEFAULT_QUANTUM, max_hold: float = DEFAULT_MAX_HOLD,
                 ring_interval: float = doorbell.UNPROVEN_RING_INTERVAL):
        if quantum < 0 or max_hold < quantum:
            raise ValueError("need 0 <= quantum <= max_hold")
        self.arena = arena
        self.pid = os.getpid()
        self.token = Token(arena.token_path)
        self.queue = Queue(arena.queue_dir)
        self.registry = Registry(arena.members_dir)
        # Which rings count: a pid waiting for the token always; any other
        # ringer at most once per ring_interval (a flood is rate-limited per pid).
        self.ring_gate = doorbell.RingGate(arena.doorbell_dir, ring_interval)
        self.quantum = quantum
        self.max_hold = max_hold
        self._restore = restore
        self._release = release
        self._breakdown = breakdown
        # Device bytes released but still on their way back to the driver (the
        # residency core frees in the background): published, so that the next
        # holder waits for them instead of calling them someone else's.
        self._freeing = freeing
        # Called from the warden thread when a yield becomes wanted, so a
        # caller blocked on its own work queue can wake up and call idle().
        self._on_yield_request = on_yield_request
        # Called from the warden with the pids that rang while we do not hold
        # the token: a parked daemon releases for a flock-only peer.
        self._on_ring_while_cold = on_ring_while_cold
        self.member = Member(name=name, pid=self.pid, model=model,
                             start_time=process_start_time(self.pid) or time.time(),
                             failpoints=describe_armed())
        self._yield_wanted = threading.Event()
        self._stop = threading.Event()
        self._warden: threading.Thread | None = None
        self._watcher: doorbell.Watcher | None = None
        self._warm_since_wall = 0.0
        self._foreign_at_release: set[int] = set()
        self._publish_lock = threading.RLock()
        self._wait_started = time.monotonic()
        self.cold_reason = ""
        self.steps_aside = 0   # how often the last ensure_warm dropped the token for a StepAside
        self.last_restore_s = 0.0   # the last warm-up's restore alone, the token held (the daemon's log)

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> "Participant":
        """Publish the member record and start watching the doorbell."""
        self._publish("cold")
        self._watcher = doorbell.Watcher(self.arena.doorbell_dir, self.pid)
        self._warden = threading.Thread(target=self._warden_loop, name="vramd-warden", daemon=True)
        self._warden.start()
        return self

    def close(self) -> None:
        """Go cold, stop the warden, withdraw our record and ring.  Idempotent."""
        try:
            self.go_cold(reason="shutdown")
        finally:
            self._stop.set()
            if self._watcher is not None:
                self._watcher.interrupt()
            if self._warden is not None:
                self._warden.join(timeout=WARDEN_JOIN)
            if self._watcher is not None:
                self._watcher.close()
                self._watcher = None
            self.registry.remove(self.pid)
            doorbell.remove_ring(self.arena.doorbell_dir, self.pid)

    def __enter__(self) -> "Participant":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def state(self) -> str:
        return self.member.state

    @property
    def holds_token(self) -> bool:
        return self.token.held

    def held_for(self) -> float:
        at = self.token.acquired_at
        return 0.0 if at is None or not self.token.held else time.monotonic() - at

    # -- going warm --------------------------------------------------------

    def ensure_warm(self, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> None:
        """Hold the token and have our buffers restored; a no-op when warm.

        Raises vramd.errors.Timeout if the token could not be had in `timeout`
        seconds, Interrupted if `cancel()` turned true meanwhile, and the
        restore's own exception if restoring failed (the token is dropped
        again and we stay cold).  A restore that raises StepAside has the
        token dropped, its work done without the token, and is tried again
        (see StepAside).
        """
        if self.token.held:
            return
        if timeout is not None and not math.isfinite(timeout):
            timeout = None
        started = self._wait_started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        self._publish("warming")
        self.steps_aside = 0
        while True:
            try:
                self._let_foreign_waiter_go(deadline)
                self._queue_and_acquire(deadline, timeout, cancel)
            except BaseException:
                doorbell.remove_ring(self.arena.doorbell_dir, self.pid)
                self._publish_unheld()
                raise
            try:
                moved = self._restore_holding()
                break
            except StepAside as aside:
                step = aside   # the token is dropped (_restore_holding): the work runs without it
            try:
                self._step_aside(step, deadline, timeout, cancel)
            except BaseException:
                self._publish_unheld()
                raise
        self.member.switches += 1
        self.member.bytes_h2d += moved or 0
        self.member.last_switch_ms = (time.monotonic() - started) * 1000
        self.member.last_used = time.time()
        self._publish("warm")
        if self._someone_waiting():
            self._yield_wanted.set()
            if self._on_yield_request is not None:
                self._on_yield_request()

    def _restore_holding(self) -> "int | None":
        """With the token just taken: restore.  Whatever fails before we are warm (the restore, or
        anything around it) drops the token again; so does a StepAside, published as still warming."""
        restored = False
        try:
            failpoint("warm.after_token")
            # A yield flag left by a warden decision that raced our last go_cold
            # belongs to the previous hold: start this one clean.
            self._yield_wanted.clear()
            self._warm_since_wall = time.time()
            doorbell.remove_ring(self.arena.doorbell_dir, self.pid)
            t0 = time.monotonic()
            moved = self._restore() if self._restore else None
            self.last_restore_s = time.monotonic() - t0   # the upload alone (last_switch_ms: the wait too)
            restored = True
            failpoint("warm.restored")
            return moved
        except StepAside:
            # Nothing of ours moved.  We still want the GPU ("warming", which claims nothing), but
            # we wait for other processes now, not for the token: no ring, no ticket, and a
            # flock-only waiter we drop it for is let go first when we queue again.
            try:
                foreign = self._foreign_waiters()
                self._publish("warming")   # before the token goes: the next holder reads it
            finally:
                self.token.release()
                self._yield_wanted.clear()
            self._foreign_at_release = foreign
            raise
        except BaseException:
            try:
                if restored and self._release is not None:
                    # Restored, then failed: go cold as a yield would (what our
                    # release policy keeps stays, parked and published).
                    try:
                        self._release()
                    except Exception as e:
                        log.error("%s: releasing after a failed warm-up failed: %s", self.member.name, e)
                doorbell.remove_ring(self.arena.doorbell_dir, self.pid)
                self._publish_unheld()  # before the token goes: the next holder reads it
            finally:
                self.token.release()
                self._yield_wanted.clear()
            raise

    def _step_aside(self, step: "StepAside", deadline: float | None, timeout: float | None,
                    cancel: Callable[[], bool] | None) -> None:
        """A restore's StepAside, the token dropped: its work, then back in the queue.

        The queue again means a new ticket, behind whoever queued meanwhile: keeping our place
        would keep a live ticket at the head, and the queue is a lock too (every vramd waiter
        sleeps on the ticket ahead of it), so nobody could take the free token while we wait on
        a peer, which is what stepping aside is for.  We lose at most one turn per step, and
        the restore steps aside only while it has someone left to ask (room.py: each peer at
        most once per warm-up), so the steps are few.
        """
        self.steps_aside += 1
        log.info("%s: %s; the GPU token is free meanwhile", self.member.name, step.what)
        t0 = time.monotonic()
        step.work(deadline, cancel)
        log.info("%s: done in %.3f s; queueing for the GPU token again", self.member.name, time.monotonic() - t0)
        if cancel is not None and cancel():
            raise Interrupted("gave up waiting for the GPU: shutting down")
        if deadline is not None and time.monotonic() >= deadline:
            waited = time.monotonic() - self._wait_started
            raise Timeout(f"not warm after {waited:.1f} s (timeout {timeout:g} s): {step.what} took the time "
                          "that was left")

    def _queue_and_acquire(self, deadline: float | None, timeout: float | None,
                           cancel: Callable[[], bool] | None) -> None:
        ticket = self.queue.take(self.pid)
        try:
            if not self.queue.wait_turn(ticket, _left(deadline), cancel):
                self._raise_not_acquired(timeout, cancel)
            # First in line: ask whoever holds the token to yield.
            try:
                doorbell.ring(self.arena.doorbell_dir, self.pid)
            except ArenaError as e:
                # A ring only asks a holder to yield: with the token free we
                # need none.  (A file another user left under our pid in a
                # sticky doorbell/ we do not own can make ringing impossible.)
                if not self.token.try_acquire():
                    raise ArenaError(f"{e}; the token is held by {self.holder_text()}, "
                                     "which cannot be asked to yield without a ring") from None
                log.warning("%s: cannot ring (%s); the token is free, so going warm without a ring",
                            self.member.name, e)
                return
            failpoint("warm.before_token")
            if not self._acquire_ringing(deadline, cancel):
                self._raise_not_acquired(timeout, cancel)
        finally:
            self.queue.done(ticket)

    def _raise_not_acquired(self, timeout: float | None, cancel: Callable[[], bool] | None):
        if cancel is not None and cancel():
            raise Interrupted("gave up waiting for the GPU token: shutting down")
        waited = time.monotonic() - self._wait_started
        raise Timeout(f"the GPU token was not free after {waited:.1f} s (timeout {timeout:g} s; "
                      f"holder: {self.holder_text()})")

    def _acquire_ringing(self, deadline: float | None, cancel: Callable[[], bool] | None = None) -> bool:
        """`_acquire_ringing_once`; if token.lock was replaced while we waited (we locked an inode
        that is no longer the arena's: TokenError), drop it and wait on the file there now.  We
        hold nothing yet, so this is safe; a holder of the old inode sees it and stops (guard.py)."""
        for attempt in range(TOKEN_REPLACED_RETRIES + 1):
            try:
                return self._acquire_ringing_once(deadline, cancel)
            except TokenError as e:
                if attempt == TOKEN_REPLACED_RETRIES or not os.path.lexists(self.token.path):
                    raise
                log.warning("%s: %s; waiting on the new token file", self.member.name, e)
                try:
                    doorbell.ring(self.arena.doorbell_dir, self.pid)
                except Exception:  # the acquire goes on; a holder may yield without our ring
                    pass
        return False

    def _acquire_ringing_once(self, deadline: float | None, cancel: Callable[[], bool] | None = None) -> bool:
        """Block on the token; ring again whenever a new process takes it meanwhile.

        A flock-only peer (llama.cpp) drops rings heard while it was cold, so
        if it grabs the token while we wait, our first ring is lost on it.
        """
        if self.token.try_acquire():
            return True
        done = threading.Event()
        key = self.token.key()

        def re_ring():
            last = proclocks.flock_taker(key)
            while not done.wait(RE_RING_INTERVAL):
                taker = proclocks.flock_taker(key)
                if taker not in (None, last, self.pid):
                    try:
                        doorbell.ring(self.arena.doorbell_dir, self.pid)
                    except Exception as e:  # a vanished doorbell: the acquire still goes on
                        log.warning("%s: re-ring failed: %s", self.member.name, e)
                last = taker

        ringer = threading.Thread(target=re_ring, name="vramd-re-ring", daemon=True)
        ringer.start()
        try:
            return self.token.acquire(_left(deadline), cancel)
        finally:
            done.set()
            ringer.join()

    def _let_foreign_waiter_go(self, deadline: float | None) -> None:
        """After yielding to a flock-only waiter, do not barge back ahead of it."""
        waiting_for = self._foreign_at_release
        self._foreign_at_release = set()
        if not waiting_for:
            return
        stop = time.monotonic() + FOREIGN_HANDOFF_WAIT
        if deadline is not None:
            stop = min(stop, deadline)
        key = self.token.key()
        # The kernel unlists a woken waiter until it runs and retries, so "not
        # waiting any more" proves nothing while it lives: wait for it to hold
        # the token, or to die, or for FOREIGN_HANDOFF_WAIT.
        while time.monotonic() < stop:
            entries = proclocks.locks_on(key)
            if any(not e.waiting and e.pid != self.pid for e in entries):
                return  # someone else took it
            if not any(doorbell.pid_alive(pid) for pid in waiting_for):
                return
            time.sleep(0.0005)

    def holder_text(self) -> str:
        """Who holds the token, and for how long (a Timeout's message)."""
        holders = self.token.holders()
        if not holders:
            return "none"
        members = {m.pid: m for m in self.registry.list(clean=False)}

        def one(pid: int) -> str:
            m = members.get(pid)
            if m is None:
                return f"pid {pid} (not a vramd member)"
            # How long it has held: since its record said warm (a vramd holder yields between
            # requests, and between two generation steps after its quantum: vramd/server/slots.py).
            held = f", {m.state} for {max(0.0, time.time() - m.since):.1f} s" if m.state in ("warm", "cooling") else ""
            return f"{m.name} {pid}{held}"
        return ", ".join(one(p) for p in holders)

    # -- going cold --------------------------------------------------------

    def idle(self) -> bool:
        """An idle point: yield if a peer asked and we held for the quantum."""
        if self.token.held and self._yield_wanted.is_set() and self.held_for() >= self.quantum:
            self.go_cold(reason="yield")
            return True
        return False

    def checkpoint(self) -> bool:
        """Between two requests while more wait: yield only after max_hold."""
        if self.token.held and self._yield_wanted.is_set() and self.held_for() >= self.max_hold:
            self.go_cold(reason="yield")
            return True
        return False

    def yield_requested(self) -> bool:
        return self.token.held and self._yield_wanted.is_set()

    def yield_due_in(self) -> float | None:
        """Seconds until idle() would yield (0: now); None if nobody asked."""
        if not self.yield_requested():
            return None
        return max(0.0, self.quantum - self.held_for())

    def incoming_need(self) -> int | None:
        """Device bytes the next waiter needs, if it is a member that said so.

        None when the next waiter is not a vramd member (a llama.cpp peer
        expects an empty GPU) or published no need.
        """
        queued = [pid for _n, pid in self.queue.live() if pid != self.pid]
        blocked = [pid for pid in self.token.waiters() if pid != self.pid]
        for pid in queued[:1] or blocked[:1]:
            member = self.registry.read(pid)
            if member is None or member.wants_bytes <= 0:
                return None
            return member.wants_bytes
        return None

    def wait_yield_due(self, timeout: float | None) -> bool:
        """Block until a yield is due (asked, and quantum served), or `timeout` s pass."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._yield_wanted.wait(_left(deadline)):
            return False
        rest = self.quantum - self.held_for()
        if rest > 0:
            left = _left(deadline)
            if left is not None and left < rest:
                time.sleep(left)
                return False
            time.sleep(rest)
        return self.token.held

    def go_cold(self, reason: str = "idle") -> None:
        """Release our buffers and drop the token.  A no-op when cold."""
        if not self.token.held:
            return
        self.cold_reason = reason   # what the release callback reports (the daemon's log line)
        try:
            self._publish("cooling")
        except Exception as e:  # a record we cannot write must not keep the GPU
            log.error("%s: publishing our record failed while going cold: %s", self.member.name, e)
        try:
            moved = self._release() if self._release else None
            self.member.bytes_d2h += moved or 0
        finally:
            # Whatever failed above, the token is released: a process that
            # believes it is cold must never keep the GPU from its peers.
            foreign: set[int] = set()
            try:
                foreign = self._foreign_waiters()
                if reason == "yield":
                    self.member.yields += 1
                # Publish before dropping the token: the next holder sizes its
                # restore by what our record says we still hold on the device.
                # Still holding device memory without the token is "parked".
                self.member.last_used = time.time()
                self._publish_unheld()
            except Exception as e:
                log.error("%s: publishing our record failed while going cold: %s", self.member.name, e)
            try:
                failpoint("cold.before_unlock")
            finally:
                self.token.release()
                self._yield_wanted.clear()
                self._foreign_at_release = foreign
            log.debug("%s: cold (%s)", self.member.name, reason)

    def _device_bytes(self) -> int:
        return sum(v["device"] for v in self._breakdown().values()) if self._breakdown else 0

    def _publish_unheld(self) -> None:
        self._publish("parked" if self._device_bytes() else "cold")

    def set_resident_state(self) -> None:
        """Re-publish cold/parked after our device bytes changed without the token (an eviction)."""
        if not self.token.held:
            self._publish_unheld()

    # -- who waits ---------------------------------------------------------

    def _foreign_waiters(self) -> set[int]:
        """Pids blocked in flock on the token that hold no vramd ticket."""
        blocked = set(self.token.waiters())
        if not blocked:
            return set()
        ticketed = {pid for _n, pid in self.queue.live()}
        return blocked - ticketed - {self.pid}

    def _waiting_pids(self) -> set[int]:
        """Pids the kernel shows waiting for the token: blocked in flock on it, or
        holding a live ticket; while we are cold, its holder too (a peer that rang
        and got it).  What makes a ring proven (doorbell.RingGate)."""
        entries = [e for e in proclocks.locks_on(self.token.key()) if e.kind == "FLOCK"]
        pids = {e.pid for e in entries if e.waiting or not self.token.held}
        try:
            pids |= {pid for _n, pid in self.queue.live()}
        except Exception:  # a queue we may not list: flock waiters still count
            pass
        return pids - {self.pid}

    def _someone_waiting(self) -> bool:
        """Anyone queued, blocked on the token, or ringing since we took it?"""
        if any(pid != self.pid for _n, pid in self.queue.live()):
            return True
        if set(self.token.waiters()) - {self.pid}:
            return True
        rings = doorbell.scan(self.arena.doorbell_dir).rings
        since = self._warm_since_wall - RING_CLOCK_SLACK
        fresh = {pid for pid, mtime in rings.items() if pid != self.pid and mtime >= since}
        return bool(fresh) and bool(self.ring_gate.admit(fresh, self._waiting_pids))

    def _warden_loop(self) -> None:
        watcher = self._watcher
        while not self._stop.is_set():
            rang = watcher.wait(self.ring_gate.next_check())
            if self._stop.is_set():
                return
            if watcher.gone:
                log.error("%s: the doorbell directory %s was removed; rings are no longer heard",
                          self.member.name, self.arena.doorbell_dir)
                return
            try:
                if not self.token.held:
                    # Nothing to yield; a parked holder of device memory may
                    # still have to make room (see on_ring_while_cold).
                    admitted = self.ring_gate.admit(rang or (), self._waiting_pids)
                    if admitted and self._on_ring_while_cold is not None:
                        self._on_ring_while_cold(admitted)
                    continue
                if rang is None:
                    wanted = self._someone_waiting()
                else:
                    wanted = bool(self.ring_gate.admit(rang, self._waiting_pids))
            except Exception as e:  # a vanished file mid-scan: look again next ring
                log.warning("%s: doorbell rescan failed: %s", self.member.name, e)
                continue
            if wanted:
                self._yield_wanted.set()
                if self._on_yield_request is not None:
                    self._on_yield_request()

    # -- the member record -------------------------------------------------

    def _publish(self, state: str) -> None:
        # The loop, control and warden threads all publish: one at a time, so
        # the record on disk is always one consistent snapshot.
        with self._publish_lock:
            m = self.member
            m.state = state
            m.since = time.time()
            m.breakdown = self._breakdown() if self._breakdown else empty_breakdown()
            m.freeing_bytes = self._freeing() if self._freeing else 0
            self.registry.write(m)

    def publish(self) -> None:
        """Re-publish the record (e.g. after the breakdown changed)."""
        self._publish(self.member.state)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())

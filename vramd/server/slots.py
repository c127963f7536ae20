"""The daemon's generation slots, the queue bound, and what happens between two of a generation's steps.

Owns: `Slot` (one sequence the engine holds: the request it serves, generating or paused,
its tokens and pauses), `Slots` (the set of them: `--parallel`, the queue bound `--max-queue`,
the pause between steps, the figures `vramd status` and /metrics show).

A generation used to hold the GPU for as long as it ran: the daemon yielded only at idle
points between jobs, so a peer that rang waited for our whole generation.  Now the loop asks
`between_steps` after every token (the engine's emit callback, before the next forward
pass): when a peer has rung and our hold quantum is served (Participant.yield_due_in() == 0;
--max-hold is at least the quantum, so it is served too), the slot goes cold exactly as the
idle path does (weights and scratch freed; the K/V cache and a recurrent state kept on the
device, or copied to the host under --evict-state always / an incoming peer's need), waits
for the token behind the peer, comes back warm (the decode graph re-records after the
residency move: vramd/engine/model.py) and the generation continues where it stopped, so
its text is the unswitched text.  The peer waits at most one of our decode steps past the
quantum; a prefill is one step here (its chunks are not yet interruptible).  A streaming
client sees SSE keep-alive comments meanwhile (daemon.py's stream writer sends them when no
piece comes), a client that goes away ends the wait (the `cancel` callable), a stop too; a
peer that keeps the GPU past --wake-timeout fails the paused generation with that 503 (a
streamed one: an error event after its pieces).

Several slots (`--parallel N`, issue 16): the engine's KV cache holds N sequences and the
daemon's batch session (vramd/server/batched.py) steps their generations together; slot i is
sequence i.  Between two of the batch's steps the same pause applies to the whole batch
(`pause`): every busy slot shows "paused" while the peer holds the GPU, and each resumes where
it stopped.  The default (`auto`, DEFAULT_PARALLEL) is sized by the daemon so that the KV cache
of every slot fits the budget at --ctx (vramd/server/daemon.py `_choose_parallel`).
MAX_PARALLEL is the replayed step's bound (vramd/engine/model.py SLOTS_REPLAY): beyond it each
step would be recorded again.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from vramd.errors import Interrupted, Timeout, VramdError

log = logging.getLogger("vramd.slots")

DEFAULT_PARALLEL = 4   # --parallel auto: at most this many slots, fewer where their KV does not fit
MAX_PARALLEL = 16      # the most slots: a step of 16 decode rows replays its recording (model.SLOTS_REPLAY)
DEFAULT_MAX_QUEUE = 64   # generation requests waiting for a slot before a 503 (--max-queue)
# A 503 for a full queue says to come back in this many seconds: a short generation's time.
QUEUE_RETRY_AFTER = 1
RATE_WINDOW = 10.0   # seconds of tokens the tokens/s figure counts


class QueueFull(VramdError):
    """More generation requests wait than --max-queue allows: 503, Retry-After."""

    http_status = 503
    retry_after = QUEUE_RETRY_AFTER


def check_parallel(parallel: int | None, where: str) -> None:
    """None is `auto` (the daemon sizes it)."""
    from vramd.errors import UsageError
    if parallel is None:
        return
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UsageError(f"{where}: parallel {parallel}: between 1 and {MAX_PARALLEL} slots (a step of "
                         f"{MAX_PARALLEL} sequences' decode tokens is the largest recorded once and replayed)")


@dataclass
class Slot:
    id: int
    state: str = "idle"          # idle, generating, paused
    request: str | None = None   # what it serves (the request's kind)
    since: float = 0.0           # monotonic: when it took the request
    tokens: int = 0              # generated for it so far
    pauses: int = 0              # times it went cold mid-generation for a peer
    paused_since: float | None = None
    paused_s: float = 0.0        # seconds spent paused, the current pause included once it ends

    def rate(self, now: float) -> float:
        """Its request's tokens per second while it generated (pauses left out); 0 when idle."""
        if self.state == "idle":
            return 0.0
        paused = self.paused_s + (now - self.paused_since if self.paused_since is not None else 0.0)
        ran = now - self.since - paused
        return self.tokens / ran if ran > 0 else 0.0

    def row(self, now: float) -> dict:
        busy = self.state != "idle"
        return {"id": self.id, "state": self.state, "request": self.request,
                "tokens_per_second": round(self.rate(now), 3),
                "for_s": round(now - self.since, 3) if busy else None, "tokens": self.tokens,
                "pauses": self.pauses,
                "paused_for_s": round(now - self.paused_since, 3) if self.paused_since is not None else None,
                "paused_s": round(self.paused_s + (now - self.paused_since if self.paused_since else 0.0), 3)}


class Slots:
    """The slots and the pause between steps.  `yield_due`: seconds until the participant's
    yield is due (None: nobody rang); `go_cold`: yield the token keeping the slot's state;
    `go_warm(cancel)`: the token back and resident (raises Interrupted when `cancel()` says so)."""

    def __init__(self, parallel: int, max_queue: int, yield_due: Callable[[], float | None],
                 go_cold: Callable[[], None], go_warm: Callable[[Callable[[], bool]], None]):
        self.slots = [Slot(i) for i in range(parallel)]
        self.max_queue = max_queue
        self._yield_due, self._go_cold, self._go_warm = yield_due, go_cold, go_warm
        self._lock = threading.Lock()
        self._times: collections.deque[float] = collections.deque()   # when recent tokens came
        self.pauses = 0          # mid-generation pauses, all slots (a counter)
        self.queue_full = 0      # requests refused for a full queue (a counter)

    # -- admission ---------------------------------------------------------

    def admit(self, queued: int) -> None:
        """A new generation request, `queued` already waiting: refused when the queue is full."""
        if queued >= self.max_queue:
            with self._lock:
                self.queue_full += 1
            raise QueueFull(f"{queued} generation requests already wait for a slot (--max-queue "
                            f"{self.max_queue}); retry in {QUEUE_RETRY_AFTER} s")

    @contextlib.contextmanager
    def serving(self, request: str):
        """Slot 0 while the block runs: a generation that runs alone (the one-slot path)."""
        slot = self.occupy(0, request)
        try:
            yield slot
        finally:
            self.release(0)

    def occupy(self, seq: int, request: str) -> Slot:
        """Slot `seq` takes a request (of kind `request`)."""
        slot = self.slots[seq]
        slot.state, slot.request, slot.since, slot.tokens = "generating", request, time.monotonic(), 0
        slot.pauses, slot.paused_s, slot.paused_since = 0, 0.0, None
        return slot

    def release(self, seq: int) -> None:
        slot = self.slots[seq]
        slot.state, slot.request, slot.paused_since = "idle", None, None

    def count(self, slot: Slot) -> None:
        """A token of `slot` (the tokens/s figure, the slot's own count)."""
        now = time.monotonic()
        slot.tokens += 1
        with self._lock:
            self._times.append(now)
            while self._times and self._times[0] < now - RATE_WINDOW:
                self._times.popleft()

    # -- between two steps ---------------------------------------------------

    def pause_due(self) -> bool:
        """A peer rang and our quantum is served: the next point between two steps pauses."""
        return self._yield_due() == 0

    def between_steps(self, slot: Slot, cancel: Callable[[], bool]) -> bool:
        """After a token of `slot` (the one-slot path): count it; when a peer's yield is due,
        pause.  False: give the generation up (cancel() said so meanwhile)."""
        self.count(slot)
        if not self.pause_due() or cancel():
            return True
        return self.pause([slot], cancel) and not cancel()

    def pause(self, slots: list[Slot], cancel: Callable[[], bool]) -> bool:
        """Go cold keeping the slots' sequences, wait for the token behind the peer, come back
        warm; the slots show "paused" meanwhile.  False: the wait was given up (cancel() said
        so: a stop, a lost token, or every client gone)."""
        now = time.monotonic()
        for slot in slots:
            slot.state, slot.paused_since = "paused", now
            slot.pauses += 1
        with self._lock:
            self.pauses += 1
        log.info("slot%s %s: pausing after %s tokens: a peer rang and the quantum is served",
                 "s" if len(slots) > 1 else "", ",".join(str(s.id) for s in slots),
                 ",".join(str(s.tokens) for s in slots))
        try:
            self._go_cold()
            self._go_warm(cancel)
        except Interrupted:
            return False   # the client went away, or a stop: the generation ends as cancelled
        except Timeout as e:   # the peer kept the GPU past --wake-timeout: say it was a paused generation
            raise Timeout(f"a generation paused after {max(s.tokens for s in slots)} tokens: {e}") from None
        finally:
            for slot in slots:
                slot.paused_s += time.monotonic() - slot.paused_since
                slot.state, slot.paused_since = "generating", None
        log.info("resumed after %.3f s paused", time.monotonic() - now)
        return True

    # -- what status and /metrics show -------------------------------------------

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            n = sum(1 for t in self._times if t >= now - RATE_WINDOW)
        return n / RATE_WINDOW

    def status(self, queued: int, reused_tokens: int) -> dict:
        now = time.monotonic()
        rows = [s.row(now) for s in self.slots]
        return {"parallel": len(self.slots), "busy": sum(r["state"] != "idle" for r in rows),
                "paused": sum(r["state"] == "paused" for r in rows), "queued": queued,
                "max_queue": self.max_queue, "queue_full_total": self.queue_full, "pauses_total": self.pauses,
                "tokens_per_second": round(self.tokens_per_second(), 3), "cached_tokens_total": reused_tokens,
                "slots": rows}

    def render_metrics(self, label: str) -> list[str]:
        from vramd.server.metrics import _one as one
        rows = [s.state for s in self.slots]
        now = time.monotonic()
        per_slot = ["# HELP vramd_slot_tokens_per_second Tokens per second of the request a slot serves "
                    "(pauses left out; 0: idle).", "# TYPE vramd_slot_tokens_per_second gauge"]
        per_slot += [f'vramd_slot_tokens_per_second{{{label},slot="{s.id}"}} {round(s.rate(now), 3)}'
                     for s in self.slots]
        return [*one("vramd_slots", "gauge", "Generation slots (--parallel).", label, len(rows)),
                *per_slot,
                *one("vramd_slots_busy", "gauge", "Slots serving a request (paused ones included).", label,
                     sum(s != "idle" for s in rows)),
                *one("vramd_paused_requests", "gauge", "Generations paused mid-way while a peer holds the GPU.",
                     label, sum(s == "paused" for s in rows)),
                *one("vramd_generation_pauses_total", "counter",
                     "Times a generation went cold between two steps for a peer that rang.", label, self.pauses),
                *one("vramd_queue_full_total", "counter", "Generation requests refused (503) for a full queue.",
                     label, self.queue_full),
                *one("vramd_max_queue", "gauge", "Generation requests that may wait (--max-queue).", label,
                     self.max_queue),
                *one("vramd_tokens_per_second", "gauge", f"Tokens generated per second over the last "
                     f"{RATE_WINDOW:g} s.", label, round(self.tokens_per_second(), 3))]

"""The loop's unit of work (`Job`): what a requester hands the daemon's loop thread and waits on.

Owns a job's life from the requester's side: its wait for the GPU counted from arrival (a 503
on time even behind a long job), giving up before the loop takes it, the client's `cancelled`
event (the generation stops at its next step), the result or error handed back.  The loop
(vramd/server/daemon.py) runs jobs one at a time; the slots between a generation's steps are
vramd/server/slots.py's.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from vramd.errors import Timeout

# A waiter for the GPU that gets no token in this long is told so (503).
DEFAULT_WAKE_TIMEOUT = 60.0

@dataclass
class Job:
    """One unit of the loop's work.  Its `timeout` (the wait for the GPU) counts from `arrived`:
    a job queued behind others is not given a fresh timeout when the loop reaches it."""
    kind: str
    fn: Callable[[], Any] | None = None
    needs_gpu: bool = False
    timeout: float | None = DEFAULT_WAKE_TIMEOUT
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    arrived: float = field(default_factory=time.monotonic)
    taken: threading.Event = field(default_factory=threading.Event)   # the loop started it, or it finished
    abandoned: bool = False   # its requester stopped waiting before the loop took it
    cancelled: threading.Event = field(default_factory=threading.Event)   # its client went away
    _claim: threading.Lock = field(default_factory=threading.Lock)
    run: Any = None   # a generation request's choices (vramd/server/generating.py Run), else None

    def finish(self, result=None, error=None) -> None:
        """Hand the result or error over; once (a batch session finishes its requests' jobs as
        they end, and the loop's own finish of the session's first job then changes nothing)."""
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.taken.set()
        self.done.set()

    def left(self) -> float | None:
        """Seconds left of its timeout (None: no limit)."""
        if self.timeout is None or not math.isfinite(self.timeout):
            return None
        return self.arrived + self.timeout - time.monotonic()

    def take(self) -> bool:
        """The loop starts it; False if its requester gave up meanwhile (it was told so)."""
        with self._claim:
            if self.abandoned:
                return False
            self.taken.set()
            return True

    def wait_taken(self, busy: Callable[[], str], tick: Callable[[], None] | None = None,
                   every: float = 1.0) -> None:
        """The requester's side: until the loop takes the job (or it finished).  Past the
        timeout, give it up and raise Timeout: a 503 on time even behind a long job.
        tick: called every `every` seconds meanwhile (a stream's keep-alive); what it raises
        gives the job up too (a client that went away) and is raised here."""
        while True:
            left = self.left()
            wait = every if tick is not None else None
            if left is not None:
                wait = max(0.0, left) if wait is None else min(wait, max(0.0, left))
            if self.taken.wait(wait):
                return
            left = self.left()
            if left is None or left > 0:
                try:
                    tick()
                    continue
                except BaseException:
                    if self._give_up():
                        raise
                    return   # taken meanwhile: the reply's own writes will find what tick found
            if self._give_up():
                raise Timeout(f"waited {time.monotonic() - self.arrived:.1f} s for the GPU (timeout "
                              f"{self.timeout:g} s): {busy()}")
            return

    def _give_up(self) -> bool:
        """Abandon the job unless the loop took it already (then False)."""
        with self._claim:
            if self.taken.is_set():
                return False
            self.abandoned = True
            return True

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result

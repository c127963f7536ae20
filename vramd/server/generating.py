"""A generation request on the loop thread: its choices run alone, or join the batch of every slot.

Owns `Run` (one OpenAI generation request's choices as the loop runs them: each choice's emit
callback, which puts its pieces on the request's event queue for the HTTP thread, the
request's usage figures and the end of each choice) and `BatchSession` (continuous batching
in the daemon, `--parallel N` above 1: the engine's Batcher, vramd/engine/batching.py, stepped
on the loop thread while generation requests join and leave between its steps).

Two paths, one per request:
- alone (`Run.alone`): its choices one after another on sequence 0 through Engine.generate;
  what --parallel 1 does for every request, and what a request the batch cannot take does:
  an image prompt (its embeddings are made on the loop), or under --context-overflow shift a
  request whose prompt and max_tokens may pass the context (the shift re-prefills one
  sequence; the batch ends a full sequence with "length").
- batched (`BatchSession.run`): the loop takes a batchable request and starts a session; each
  choice is a Generation in the Batcher (a request's n choices run side by side).  After every
  step the session takes the next requests off the loop's queue while slots are free, as long
  as the queue's head is another batchable generation; anything else at the head (an
  embedding, an image prompt, a control job) waits for the session to drain, so the queue's
  order holds and nothing is starved by a stream of short generations.  A request is answered
  (its Job finished) when its last choice ends, not when the session does.

Between two steps of the batch, when a peer rang and our quantum is served, the whole batch
pauses (Slots.pause: cold keeping every slot's K/V, the token back, warm again) and every
generation continues where it stopped.  A paused wait that is given up (a stop, a lost token,
every client gone) cancels every generation without another step: no forward pass ever runs
without the token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from vramd.errors import ShuttingDown

if TYPE_CHECKING:
    from vramd.server.jobs import Job

log = logging.getLogger("vramd.generating")


class Run:
    """One generation request's choices (daemon._Choice: builder, request, sampling, ids) on
    the loop.  The HTTP thread reads `events` ("piece", (index, Piece)) and ("end", (index,
    finish)); `timing` is the request line's figures, written on the loop."""

    def __init__(self, d, kind: str, choices: list, arrived: float):
        self.d, self.kind, self.choices, self.arrived = d, kind, choices, arrived
        self.events: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.cancelled = threading.Event()
        self.timing: dict = {"prompt_tokens": 0, "generated_tokens": 0, "reused_tokens": 0}
        self.finishes: list[str | None] = [None] * len(choices)
        self.error: BaseException | None = None
        self.left = len(choices)   # choices not yet ended (the batch)

    @property
    def batchable(self) -> bool:
        """Its choices can join the batch (the module header says which cannot)."""
        e = self.d.engine
        for c in self.choices:
            if c.ids is None:
                return False   # an image prompt: embeddings made on the loop
            if e.overflow == "shift" and (c.sampling.max_tokens is None
                                          or len(c.ids) + c.sampling.max_tokens > e.ctx):
                return False
        return True

    def stopped(self) -> bool:
        """Stop generating at the next step: the client went away, a stop, the token lost."""
        d = self.d
        return self.cancelled.is_set() or d.stopping or d.lost is not None

    def begin(self, c, ids: list[int]) -> None:
        c.builder.prompt_tokens = len(ids)
        self.timing["prompt_tokens"] += len(ids)
        if c.req.echo:
            c.builder.echo_text = c.req.prompt if isinstance(c.req.prompt, str) else self.d.engine.detokenize(ids)

    def emit_for(self, c, after: Callable[[], bool]) -> Callable:
        """The emit callback of choice c: the piece to the HTTP thread; False (cancel) when the
        request stopped, else what `after` (the token counted, a pause between steps) says."""
        d = self.d

        def emit(piece) -> bool:
            d.beat = time.monotonic()
            if "ttft_s" not in self.timing:
                self.timing["ttft_s"] = round(d.beat - self.arrived, 6)
                d.metrics.observe_first_token(d.beat - self.arrived)
            if piece.token >= 0:
                self.timing["generated_tokens"] += 1
            self.events.put(("piece", (c.builder.index, piece)))
            # A stop ends the generation at its next step (a clean finish, never a dead loop);
            # so does a token that is no longer the arena's (never compute beside another holder).
            return not self.stopped() and (piece.token < 0 or after())
        return emit

    def end(self, c, finish: str, made: int, reused: int) -> str:
        """Choice c ended: its usage, its end event; a stop or a lost token is the request's error."""
        d = self.d
        c.builder.cached_tokens = reused
        self.timing["reused_tokens"] += reused
        if finish == "cancelled" and d.lost is not None:
            raise ShuttingDown(f"{d.name}: {d.lost}: the generation was ended after {made} tokens")
        if finish == "cancelled" and not self.cancelled.is_set():
            raise ShuttingDown(f"{d.name} is shutting down: the generation was ended after {made} tokens")
        self.events.put(("end", (c.builder.index, finish)))
        return finish

    # -- alone -----------------------------------------------------------------

    def alone(self) -> list[str]:
        """Every choice in turn on sequence 0 (slot 0), pausing between tokens for a peer."""
        d, e = self.d, self.d.engine
        self.timing["queue_s"] = round(time.monotonic() - self.arrived, 6)   # other jobs and the GPU token
        finishes = []
        with d.slots.serving(self.kind) as slot:
            for c in self.choices:
                ids, embeds = (c.ids, {}) if c.ids is not None else e.prompt(c.req.prompt_input())
                self.begin(c, ids)
                made = self.timing["generated_tokens"]
                emit = self.emit_for(c, lambda: d.slots.between_steps(
                    slot, lambda: d._before_pause(self.cancelled.is_set)))
                d.host_cache.before(e, ids)   # the slot's sequence saved, or a saved one brought back
                reused = e.stats["reused_tokens"]
                finish = e.generate(ids, c.sampling, emit, embeds)
                if e.shift_stats["shifts"]:
                    c.builder.add_shifts(e.shift_stats)
                finishes.append(self.end(c, finish, self.timing["generated_tokens"] - made,
                                         e.stats["reused_tokens"] - reused))
                if self.cancelled.is_set():
                    break
        return finishes


class BatchSession:
    """Continuous batching on the loop thread (the module header).  `waiting`: generations
    taken off the loop's queue that wait in the Batcher for a slot."""

    def __init__(self, d):
        self.d = d
        self.batcher = None
        self.owner: dict = {}         # Generation -> (Run, choice)
        self.open: list["Job"] = []   # jobs of the session not answered yet

    @property
    def waiting(self) -> int:
        b = self.batcher
        return len(b.waiting) if b is not None else 0

    def run(self, first: "Job") -> None:
        """Serve `first` (taken and warm: daemon._run) and every batchable request that comes
        while it runs; each job is finished here as its last choice ends."""
        from vramd.engine.batching import Batcher
        d = self.d
        b = self.batcher = Batcher(d.engine, on_assign=self._assign, on_leave=self._leave)
        try:
            self._join(first)
            while b.active:
                for gen, (r, _c) in list(self.owner.items()):
                    if r.stopped():
                        b.cancel(gen)   # leaves at the step's start, before any forward pass
                b.step()
                self._absorb()
                if b.busy and d.slots.pause_due() and not self._pause():
                    for gen in list(self.owner):
                        b.cancel(gen)
                    b.step()   # every generation leaves; nothing is computed (cancelled: no forward pass)
        except BaseException as e:   # a failed step: every request of the session gets it
            log.error("%s: a batched step failed: %s", d.name, e)
            for job in list(self.open):
                self._finish(job, error=e)
            for s in range(len(d.slots.slots)):
                d.slots.release(s)
        finally:
            self.batcher, self.owner = None, {}

    def _join(self, job: "Job") -> None:
        r: Run = job.run
        r.timing["queue_s"] = round(time.monotonic() - r.arrived, 6)
        self.open.append(job)
        for c in r.choices:
            self.begin_choice(r, c)

    def begin_choice(self, r: Run, c) -> None:
        b = self.batcher
        r.begin(c, c.ids)
        cell: list = []
        emit = r.emit_for(c, lambda: self._count(cell[0]))
        gen = b.submit(c.ids, c.sampling, emit)
        cell.append(gen)
        self.owner[gen] = (r, c)

    def _count(self, gen) -> bool:
        self.d.slots.count(self.d.slots.slots[gen.seq])
        return True

    def _assign(self, gen, seq: int) -> None:
        d = self.d
        r, _c = self.owner[gen]
        d.host_cache.before(d.engine, gen.ids, seq)   # the slot's sequence saved, or a saved one brought back
        d.slots.occupy(seq, r.kind)

    def _leave(self, gen) -> None:
        r, c = self.owner.pop(gen)
        if gen.seq >= 0:
            self.d.slots.release(gen.seq)
        try:
            r.finishes[c.builder.index] = r.end(c, gen.finish, gen.made, getattr(gen, "reused", 0))
        except BaseException as e:
            r.error = r.error or e
        r.left -= 1
        if r.left == 0:
            self._finish(r.job, error=r.error)

    def _finish(self, job: "Job", error: BaseException | None = None) -> None:
        if job in self.open:
            self.open.remove(job)
        job.finish(None if error is not None else list(job.run.finishes), error)
        self.d.last_activity = time.monotonic()

    def _absorb(self) -> None:
        """Requests off the head of the loop's queue into the batch while a slot is free."""
        d, b = self.d, self.batcher
        while b.free > 0:
            with d.jobs.mutex:
                q = d.jobs.queue
                # Past the pokes (left in the queue: a lost token's poke is what wakes the loop to
                # go cold and stop once the session ends), the first job in line.
                i = next((i for i, j in enumerate(q) if j.kind != "poke"), None)
                if i is None or getattr(q[i], "run", None) is None or not q[i].run.batchable:
                    return
                job = q[i]
                del q[i]
            if job.take():   # (False: its requester gave up waiting; it was told so)
                job.run.job = job
                self._join(job)

    def _pause(self) -> bool:
        """The whole batch pauses for a peer; False: it stops instead (the token we hold was
        replaced or unlinked, a stop, every client gone: judged before going cold, as the
        one-slot path does, so a replaced token is never handed on), or the wait was given up."""
        d = self.d
        runs = {r for r, _c in self.owner.values()}

        def give_up() -> bool:
            return d._before_pause(lambda: all(r.cancelled.is_set() for r in runs))
        if give_up():
            return False
        return d.slots.pause([d.slots.slots[s] for s in sorted(self.batcher.busy)], give_up)

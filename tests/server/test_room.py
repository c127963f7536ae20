"""The residency policy (vramd/server/room.py) without a daemon.

Real objects throughout: a residency core on lavapipe holding a model's three
regions, member records (vramd.arena.members.Member), the arena's token (real
flock), the memory view the daemon's look produces (memview.ForeignWatch).
The asking (vramd/server/asking.py) is Room's.  What stands in: each peer is a Python callable in place of its control
socket (it releases what it is asked for, in its record and in the device's
free memory, as a daemon does; an "unanswering" one really blocks, in the
thread the policy asks from), and the clock, so that the 5 s wait for
freeing memory takes no time.  A peer that answers within the quick window
is asked with the token held; one that does not makes the policy raise
arbiter.StepAside (the rest of the asking is done without the token);
`stepping_aside` does what the Participant does with it: the work, then
the check again.  The sockets themselves are covered by
tests/integration (test_cache.py, test_device_room.py, test_foreign_memory.py).
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from vramd.arena.arbiter import StepAside
from vramd.arena.layout import Arena
from vramd.arena.members import PRIORITY_SECONDS, Member
from vramd.arena.token import Token
from vramd.errors import OutOfDeviceMemory, PeerError, Timeout
from vramd.gpu.memview import ForeignWatch, MemoryView
from vramd.gpu.residency import Residency
from vramd.server.metrics import Metrics
from vramd.server.asking import ASK_WAIT_MIN, EVICT_WAIT
from vramd.server.room import FREEING_POLL, FREEING_WAIT, ROOM_CHECKS, Room

KiB = 1 << 10
MiB = 1 << 20
HEAP = 1 << 40


class Clock:
    """time.monotonic and time.sleep for the policy: sleeping moves the clock; `at` runs
    an event (a peer's memory coming back) once the clock passes a time."""

    def __init__(self):
        self.now, self.slept, self.events = 1000.0, [], []

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.slept.append(dt)
        self.now += dt
        for ev in [e for e in self.events if e[0] <= self.now]:
            self.events.remove(ev)
            ev[1]()

    def at(self, t: float, fn) -> None:
        self.events.append((self.now + t, fn))


class Machine:
    """The rest of the machine: the other members' records, the device's free memory as the
    driver would report it, and each peer's answer to `evict` (what its daemon does)."""

    def __init__(self, free: int):
        self.free, self.members, self.asked, self.waits = free, [], [], []
        self.watch = ForeignWatch("test")
        self.unanswering: set[str] = set()   # peers whose request times out (hung), after HANG real s
        self.stopped: set[str] = set()       # peers ask_over_socket refuses at once (SIGSTOPped)
        self.stingy: set[str] = set()        # peers that answer, releasing nothing (theirs was taken)
        self.hang = HANG
        self.unhang = threading.Event()      # set: every hung request times out now
        self.clock: "Clock | None" = None      # moved by the wait of a request that times out
        self.kept = 0   # bytes of the next releases the driver's free figure does not show (an allocator's cache)

    def member(self, name, pid, nbytes, *, last_used=0.0, priority=0, pinned=False, state="parked",
               control=True, freeing=0) -> Member:
        m = Member(name=name, pid=pid, start_time=0.0, state=state, last_used=last_used, priority=priority,
                   pinned=pinned, control=f"/nonexistent/{name}.sock" if control else "", freeing_bytes=freeing)
        m.breakdown = {"weights": {"device": nbytes, "host": nbytes}, "state": {"device": 0, "host": 0},
                       "encoder": {"device": 0, "host": 0}, "scratch": {"device": 0, "host": 0}}
        self.members.append(m)
        return m

    def sample(self) -> dict:
        return self.watch.observe(MemoryView("own", 0, HEAP, self.free, None, "the test's heap"), 0, True)

    def ask(self, peer: Member, cmd: str, wait: float, bytes: int = 0, everything: bool = False) -> dict:
        assert cmd == "evict"
        self.asked.append((peer.name, bytes, everything))
        self.waits.append(wait)
        if peer.name in self.stopped:
            raise PeerError(f"{peer.name} (pid {peer.pid}) is stopped; not asked")
        if peer.name in self.unanswering:
            self.unhang.wait(self.hang)    # it really does not answer (well past QUICK)
            if self.clock is not None:
                self.clock.now += wait
            raise Timeout(f"{peer.control}: no reply to 'evict' within {wait:g} s")
        held = peer.device_bytes()         # what it was asked for, or all of it
        freed = 0 if peer.name in self.stingy else held if everything or not bytes else min(held, bytes)
        peer.breakdown["weights"]["device"] = held - freed
        kept = min(self.kept, freed)
        self.kept -= kept
        self.free += freed - kept
        return {"ok": True, "freed": freed}


@pytest.fixture
def model(device):
    """A residency core with a model's regions: weights, KV cache (state), scratch."""
    res = Residency(device)
    regions = [res.region("weights", "m/weights", [("w", 3 * 64 * KiB)]),
               res.region("state", "m/kv", [("k", 2 * 64 * KiB)]),
               res.region("scratch", "m/scratch", [("s", 64 * KiB)])]
    yield res, regions
    res.close()


@pytest.fixture
def token(tmp_path):
    return Token(Arena.open(tmp_path / "arena").token_path)


def room(model, arena, token, budget=HEAP, clock=None, metrics=None) -> Room:
    res, regions = model
    clock = clock or Clock()
    is_member = lambda pid: pid == os.getpid() or any(m.pid == pid for m in arena.members)  # noqa: E731
    return Room("me", res, regions, budget, members=lambda: list(arena.members), is_member=is_member,
                token=token, sample=arena.sample, ask=arena.ask, metrics=metrics or Metrics(),
                clock=clock, sleep=clock.sleep, quick_ask=QUICK)


NEED = 6 * 64 * KiB   # the model's three regions, as the core packs them
# The quick window the tests' rooms ask within (QUICK_ASK's 0.5 s would only slow them), and how
# long (real time) an unanswering peer stays silent before its request times out: well past it.
QUICK = 0.2
HANG = 1.0


def stepping_aside(check, machine: Machine, deadline=None, cancel=None) -> int:
    """Run `check` as the Participant would: on a StepAside (raised, token held, only when the
    last peer asked has not answered within the quick window: one that answers is asked with
    the token held), do its work (the wait for that peer and the rest of the asking, without
    the token), then run the check again.  Returns how many steps aside it took."""
    steps = 0
    while True:
        try:
            check()
            return steps
        except StepAside as step:
            assert machine.asked[-1][0] in machine.unanswering, "stepped aside for a peer that answers"
            steps += 1
            assert steps <= len(machine.members) + ROOM_CHECKS, "the steps aside do not end"
            step.work(deadline, cancel)


def test_going_warm_needs_the_model_regions_not_on_the_device(model, token):
    r = room(model, Machine(HEAP), token)
    assert r.needed_bytes() == NEED and r.needed_bytes(("weights", "state")) == 5 * 64 * KiB
    model[0].restore(["weights"])
    assert r.needed_bytes() == 3 * 64 * KiB and r.device_total() == 3 * 64 * KiB


def test_eviction_order_is_lru_shifted_by_priority_and_ageing(model, token):
    arena = Machine(HEAP)
    now = time.time()
    arena.member("old", 11, MiB, last_used=now - 600)
    arena.member("recent", 12, MiB, last_used=now - 10)
    arena.member("favoured", 13, MiB, last_used=now - 100, priority=2)           # 2 points: 120 s younger
    arena.member("aged", 14, MiB, last_used=now - 400 - 5 * PRIORITY_SECONDS, priority=5)   # ages like recency
    arena.member("pinned", 15, MiB, last_used=now - 9999, pinned=True)
    arena.member("empty", 16, 0, last_used=now - 9999)
    arena.member("warm", 17, MiB, last_used=now - 9999, state="warm")
    arena.member("flock-only", 18, MiB, last_used=now - 9999, control=False)
    arena.member("holder", os.getpid(), MiB, last_used=now - 9999)
    assert token.try_acquire()           # this process holds the token: never on the list
    try:
        order = [m.name for m in room(model, arena, token).eviction_order()]
    finally:
        token.release()
    assert order == ["old", "aged", "recent", "favoured"]


def test_making_room_asks_in_order_with_the_token_held_only_until_the_shortfall_is_covered(model, token):
    arena = Machine(HEAP)
    for i, name in enumerate(("first", "second", "third")):
        arena.member(name, 21 + i, 4 * 64 * KiB, last_used=float(i))
    budget = 3 * 4 * 64 * KiB   # the peers hold all of it
    r = room(model, arena, token, budget=budget)
    assert r.free_bytes() == 0
    assert stepping_aside(lambda: r.make_room(NEED), arena) == 0   # they answer at once: no step aside
    # 6 blocks short: the first peer's 4 do not cover it, the second's do; the third is left alone.
    assert arena.asked == [("first", NEED, False), ("second", 2 * 64 * KiB, False)]
    assert r.free_bytes() >= NEED and arena.members[2].device_bytes() == 4 * 64 * KiB


def test_a_peer_that_does_not_answer_is_asked_once_per_warm_up_then_the_restore_is_refused(model, token):
    arena = Machine(HEAP)
    arena.member("hung", 91, 8 * 64 * KiB, last_used=1.0)        # the LRU, and it never answers
    arena.member("small", 92, 2 * 64 * KiB, last_used=2.0)
    arena.unanswering.add("hung")
    metrics = Metrics()
    r = room(model, arena, token, budget=10 * 64 * KiB, metrics=metrics)   # the peers hold all of it
    t0 = time.monotonic()
    with pytest.raises(StepAside, match=r"parked peer hung \(91\) has not answered within 0.2 s: waiting for it, "
                                        r"then asking small \(92\)") as step:
        r.prepare_restore()
    assert time.monotonic() - t0 < HANG                       # the quick window, not hung's silence
    assert arena.asked == [("hung", NEED, False)] and r.device_total() == 0   # nothing of ours moved
    step.value.work(None, None)                                # the Participant's part, token dropped
    # hung timed out (counted out after EVICT_WAIT), small gave its 2 blocks: 4 short still.
    assert arena.asked == [("hung", NEED, False), ("small", NEED, False)] and arena.waits == [EVICT_WAIT] * 2
    # Looked at again with the token: nobody left to ask in this warm-up, so refused, nobody asked twice.
    with pytest.raises(OutOfDeviceMemory, match=r"asked in this warm-up: hung did not: .*no reply.*, "
                                                r"small released 131072 B"):
        r.prepare_restore()
    assert len(arena.asked) == 2 and r.device_total() == 0 and metrics.restore_failures == 1
    r.begin()                                                  # the next warm-up may ask hung again
    with pytest.raises(StepAside, match=r"hung \(91\)"):
        r.prepare_restore()


def test_the_wait_for_a_silent_peer_ends_at_the_requesters_deadline_or_when_it_gives_up(model, token):
    clock = Clock()
    arena = Machine(HEAP)
    arena.hang = 30.0                          # silent until the test lets it time out
    for i, name in enumerate(("hung", "second", "third")):
        arena.member(name, 95 + i, 4 * 64 * KiB, last_used=float(i))
    arena.unanswering.add("hung")
    r = room(model, arena, token, budget=12 * 64 * KiB, clock=clock)
    try:
        for deadline, cancel in ((clock.now, None), (None, lambda: True)):
            r.begin()
            with pytest.raises(StepAside) as step:
                r.make_room(NEED)
            t0 = time.monotonic()
            step.value.work(deadline, cancel)   # no time left / the requester gives up (a shutdown)
            assert time.monotonic() - t0 < 5, "waited for the silent peer past the deadline"
            assert arena.asked[-1] == ("hung", NEED, False)          # nobody asked after it
            assert "hung did not: no answer within the time the requester had left" in r.asked.values()
    finally:
        arena.unhang.set()
    # With a moment left once it timed out, the next peer's wait is not cut below ASK_WAIT_MIN.
    arena.hang = HANG
    arena.unhang.clear()
    r.begin()
    with pytest.raises(StepAside) as step:
        r.make_room(NEED)
    step.value.work(clock.now + 0.1, None)
    assert arena.asked[-3:] == [("hung", NEED, False), ("second", NEED, False), ("third", 2 * 64 * KiB, False)]
    assert arena.waits[-3:] == [EVICT_WAIT, ASK_WAIT_MIN, ASK_WAIT_MIN]


def test_a_stopped_peer_is_counted_out_at_once_with_no_step_aside(model, token):
    arena = Machine(HEAP)
    arena.member("stopped", 111, 8 * 64 * KiB, last_used=0.0)
    arena.member("next", 112, 8 * 64 * KiB, last_used=1.0)
    arena.stopped.add("stopped")
    r = room(model, arena, token, budget=16 * 64 * KiB)
    r.make_room(NEED)                                      # no StepAside: nobody was slow
    assert arena.asked == [("stopped", NEED, False), ("next", NEED, False)]
    assert "stopped did not: stopped (pid 111) is stopped; not asked" in r.asked.values()


def test_room_still_short_with_nobody_left_to_ask_is_refused_not_passed(model, token):
    # A peer answers but releases nothing (what it had was taken meanwhile): make_room must not
    # return short, leaving the restore to fail later in its scratch.
    arena = Machine(HEAP)
    arena.member("stingy", 121, 8 * 64 * KiB, last_used=0.0)
    arena.stingy.add("stingy")
    metrics = Metrics()
    r = room(model, arena, token, budget=8 * 64 * KiB + 2 * 64 * KiB, metrics=metrics)
    with pytest.raises(OutOfDeviceMemory, match=r"262144 B short of the 393216 B going warm needs, and no parked "
                                                r"peer is left to ask; asked in this warm-up: stingy released 0 B"):
        stepping_aside(lambda: r.make_room(NEED), arena)
    assert metrics.restore_failures == 1 and r.device_total() == 0
    r.make_room(NEED, refuse=False)                       # vramd exec --vram: left to the caller (it warns)


def test_a_restore_the_budget_cannot_hold_is_refused_before_any_peer_is_asked(model, token):
    arena = Machine(HEAP)
    arena.member("pinned", 31, 8 * 64 * KiB, pinned=True)
    arena.member("parked", 32, 64 * KiB)
    metrics = Metrics()
    r = room(model, arena, token, budget=8 * 64 * KiB + 3 * 64 * KiB, metrics=metrics)
    with pytest.raises(OutOfDeviceMemory, match=r"used up by other members' resident buffers that may not be "
                                                r"evicted \(327680 B needed, 131072 B free, 65536 B evictable\)"):
        r.prepare_restore()
    assert arena.asked == [] and metrics.restore_failures == 1 and r.device_total() == 0


def test_a_restore_out_of_reach_of_the_device_is_refused_before_ringing(model, token):
    arena = Machine(free=64 * KiB)
    arena.member("parked", 41, 64 * KiB)
    clock = Clock()
    r = room(model, arena, token, clock=clock)
    with pytest.raises(OutOfDeviceMemory, match="not enough to make room if they all gave it up, so none was asked"):
        r.check_within_reach(NEED)
    assert arena.asked == [] and clock.slept == [0.1] * (ROOM_CHECKS - 1)   # looked again: a driver may lag
    arena.free = NEED - 64 * KiB          # with the peer's 64 KiB it is within reach
    r.check_within_reach(NEED)


def test_memory_taken_outside_the_arena_is_made_up_by_parked_peers(model, token):
    # The budget's accounting says there is room; the device says otherwise (someone outside
    # the arena holds memory): parked peers are asked for the difference, in eviction order.
    arena = Machine(free=2 * 64 * KiB)
    arena.member("older", 51, 3 * 64 * KiB, last_used=1.0)
    arena.member("newer", 52, 3 * 64 * KiB, last_used=2.0)
    arena.member("spare", 53, 3 * 64 * KiB, last_used=3.0)
    clock = Clock()
    r = room(model, arena, token, clock=clock)
    assert stepping_aside(lambda: r.check_device_memory(NEED), arena) == 0   # they answer at once
    assert arena.asked == [("older", 4 * 64 * KiB, False), ("newer", 64 * KiB, False)]
    assert arena.free >= NEED and arena.members[2].device_bytes() == 3 * 64 * KiB


def test_a_release_the_device_undercounts_is_asked_for_again_a_peer_that_did_not_answer_never(model, token):
    arena = Machine(free=0)
    arena.kept = 2 * 64 * KiB                  # the driver's figure shows 2 blocks less than released
    arena.member("hung", 101, 8 * 64 * KiB, last_used=0.0)
    arena.member("big", 102, 16 * 64 * KiB, last_used=1.0)
    arena.unanswering.add("hung")
    clock = Clock()
    arena.clock = clock
    r = room(model, arena, token, clock=clock)
    assert stepping_aside(lambda: r.check_device_memory(NEED), arena) == 1   # for hung only
    # hung once (counted out); big for the 6 blocks, then for the 2 the device did not show.
    assert arena.asked == [("hung", NEED, False), ("big", NEED, False), ("big", 2 * 64 * KiB, False)]
    assert arena.free >= NEED


def test_memory_being_freed_is_waited_for_without_asking_anyone(model, token):
    arena = Machine(free=64 * KiB)
    releasing = arena.member("releasing", 61, 0, freeing=5 * 64 * KiB)
    arena.member("parked", 62, 8 * 64 * KiB)
    clock = Clock()

    def freed():
        releasing.freeing_bytes = 0
        arena.free += 5 * 64 * KiB
    clock.at(0.5, freed)
    room(model, arena, token, clock=clock).check_device_memory(NEED)
    assert arena.asked == [] and set(clock.slept) == {FREEING_POLL}


def test_memory_that_is_never_freed_is_counted_out_after_the_wait(model, token):
    arena = Machine(free=64 * KiB)
    arena.member("stuck", 71, 0, freeing=5 * 64 * KiB)
    clock = Clock()
    t0 = clock.now
    still = f"0.3 MiB released by vramd members are still being freed after {FREEING_WAIT:g} s"
    with pytest.raises(OutOfDeviceMemory, match=still):
        room(model, arena, token, clock=clock).check_device_memory(NEED)
    assert clock.now - t0 >= FREEING_WAIT and arena.asked == []


def test_our_eviction_goes_scratch_then_state_then_weights_and_stops_when_enough(model, token):
    res, (weights, kv, scratch) = model
    kv.tensors["k"].host()[:] = np.arange(2 * 64 * KiB, dtype=np.uint8)
    res.restore(["weights", "state"])
    scratch.tensors["s"].buffer()                    # the first compute brings scratch in
    kv.evict = False                                 # --evict-state never: an eviction still copies it out
    metrics = Metrics()
    r = room(model, Machine(HEAP), token, metrics=metrics)
    with pytest.raises(PeerError, match="holds the token"):
        r.evict(1, holds_token=True)
    assert r.evict(1) == 64 * KiB and not scratch.resident and kv.resident and weights.resident
    assert r.evict(64 * KiB + 1) == 2 * 64 * KiB and not kv.resident and weights.resident
    assert kv.info()["shadow_valid"] and (kv.tensors["k"].read() == np.arange(2 * 64 * KiB, dtype=np.uint8)).all()
    assert r.evict(everything=True) == 3 * 64 * KiB and r.device_total() == 0
    assert r.evict(everything=True) == 0
    assert (metrics.evictions, metrics.evicted_bytes) == (3, NEED)


def test_going_cold_parks_in_cache_mode_and_releases_in_exclusive_mode(model, token):
    res, (weights, kv, scratch) = model
    r = room(model, Machine(HEAP), token)
    res.restore(["weights", "state"])
    cold = dict(everything=False, evict_state="auto", foreign_next=False, incoming_need=0, stopping=False)
    assert r.release(exclusive=False, **cold) == 0 and r.device_total() == 5 * 64 * KiB   # parked
    # The next holder's need fits beside our KV cache: exclusive frees the rest, the cache stays.
    assert r.release(exclusive=True, **cold) == 0 and kv.resident and not weights.resident
    res.restore(["weights"])
    assert r.release(exclusive=True, **{**cold, "incoming_need": HEAP}) == 2 * 64 * KiB   # it does not fit
    assert r.device_total() == 0 and r.freeing_bytes() == 0   # drained: the next holder allocates at once


def test_evict_state_policy(model, token):
    r = room(model, Machine(HEAP), token)
    model[0].restore(["state"])
    assert r.should_evict_state("always", 0, False) and not r.should_evict_state("never", HEAP, True)
    assert not r.should_evict_state("auto", 0, False) and r.should_evict_state("auto", HEAP, False)
    assert r.should_evict_state("auto", None, True) and not r.should_evict_state("auto", None, False)


def test_a_foreign_waiter_or_ring_empties_parked_peers(model, token, tmp_path):
    arena = Machine(HEAP)
    arena.member("parked", 81, 64 * KiB)
    arena.member("cold", 82, 0)
    r = room(model, arena, token)
    assert token.try_acquire()
    waiter = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); "
                               "fcntl.flock(f, fcntl.LOCK_EX)", str(token.path)])
    try:
        deadline = time.monotonic() + 10
        while waiter.pid not in token.waiters() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.foreign_peer_waits(os.getpid())             # not a member: a flock-only peer
        arena.member("now-a-member", waiter.pid, 0)
        assert not r.foreign_peer_waits(os.getpid())
    finally:
        token.release()
        waiter.wait(10)
    assert not r.foreign_ring({999999})                      # nothing of ours on the device: nothing to give
    model[0].restore(["weights"])
    assert r.foreign_ring({999999}) and not r.foreign_ring({81})
    r.empty_parked_peers()
    assert arena.asked == [("parked", 0, True)]             # the cold one holds nothing: not asked


def test_settling_frees_waits_for_the_driver_only_when_cold_with_bytes_out(model, token):
    res = model[0]
    r = room(model, Machine(HEAP), token)
    res.restore(["weights"])
    res.release(["weights"])
    assert not r.settle_frees(holds_token=True, published_freeing=3 * 64 * KiB)
    assert not r.settle_frees(holds_token=False, published_freeing=0)
    assert r.settle_frees(holds_token=False, published_freeing=3 * 64 * KiB) and r.freeing_bytes() == 0

"""A restore that steps aside (arbiter.StepAside): its work runs without the token, then the warm-up goes on.

The participant going warm runs in the test's process (real flock, real
ticket, real member record); the third participant that takes the GPU while
the work runs is a real process (tests/arena/peerproc.py).  The daemon's use
of it, asking parked peers to evict, is tests/integration/test_waits.py's.
"""

import os
import time

import pytest

from vramd.arena.arbiter import Participant, StepAside
from vramd.arena.layout import Arena
from vramd.arena.members import Registry
from vramd.arena.queue import Queue
from vramd.arena.token import Token
from vramd.errors import Interrupted, Timeout


def look(arena: Arena) -> dict:
    """What the arena says about us (this process) right now."""
    me = os.getpid()
    return {"holders": Token(arena.token_path).holders(), "state": Registry(arena.members_dir).read(me).state,
            "tickets": [pid for _n, pid in Queue(arena.queue_dir).live()],
            "ring": (arena.doorbell_dir / str(me)).exists()}


def test_the_token_is_free_while_the_work_of_a_step_aside_runs(arena_dir, peers):
    arena = Arena.open(arena_dir)
    other = peers(arena_dir, "other")
    seen, holders_at_restore = {}, []

    def work(deadline, cancel):
        seen.update(look(arena))
        seen["other"] = other.ask("warm 3")     # a third participant takes the GPU meanwhile
        seen["other_cold"] = other.ask("cold")
        seen["left"] = deadline - time.monotonic()

    def restore():
        holders_at_restore.append(Token(arena.token_path).holders())
        if len(holders_at_restore) == 1:
            raise StepAside("asking a peer", work)
        return 4096

    with Participant(arena, "asker", restore=restore) as p:
        p.ensure_warm(20)
        assert p.holds_token and p.state == "warm" and p.steps_aside == 1
        assert p.member.switches == 1 and p.member.bytes_h2d == 4096    # one warm-up, counted once
    assert holders_at_restore == [[os.getpid()], [os.getpid()]]       # each restore with the token
    # While the work ran: nothing held, no ticket, no ring (we waited for no holder), the record
    # "warming" (which claims no GPU), and the other participant took the token and gave it back.
    assert seen["holders"] == [] and seen["tickets"] == [] and not seen["ring"], seen
    assert seen["state"] == "warming" and seen["other"].startswith("warm"), seen
    assert seen["other_cold"].startswith("cold") and 0 < seen["left"] <= 20, seen


def test_a_step_aside_that_outlasts_the_timeout_or_is_cancelled_ends_cold(arena_dir):
    arena = Arena.open(arena_dir)
    stop = {"now": False}

    def restore():
        def work(deadline, cancel):
            while time.monotonic() < deadline + 0.05 and not cancel():
                time.sleep(0.01)
        raise StepAside("asking a slow peer", work)

    with Participant(arena, "asker", restore=restore) as p:
        t0 = time.monotonic()
        with pytest.raises(Timeout, match=r"timeout 0.5 s\): asking a slow peer took the time that was left"):
            p.ensure_warm(0.5, cancel=lambda: stop["now"])
        assert time.monotonic() - t0 < 1.5
        assert not p.holds_token and p.state == "cold" and p.member.switches == 0
        assert look(arena) == {"holders": [], "state": "cold", "tickets": [], "ring": False}
        stop["now"] = True
        with pytest.raises(Interrupted):
            p.ensure_warm(30, cancel=lambda: stop["now"] and p.steps_aside > 0)
        assert time.monotonic() - t0 < 3
        assert look(arena) == {"holders": [], "state": "cold", "tickets": [], "ring": False}

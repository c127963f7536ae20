"""Real processes contending on a real flock: exclusion, FIFO order, no barging, SIGKILL."""

import os
import signal
import time

import pytest

from vramd.arena.layout import Arena
from vramd.arena.queue import Queue
from vramd.arena.token import Token

from .conftest import wait_until


@pytest.mark.parametrize("n", [2, 4])
def test_contending_peers_never_overlap_and_all_progress(arena_dir, peers, n):
    ps = [peers(arena_dir, f"p{i}") for i in range(n)]
    for p in ps:  # barrier: everyone is up before anyone starts
        p.send("busy 15 0.002")
    results = [p.read(timeout=60) for p in ps]
    for p, r in zip(ps, results):
        assert r.startswith("done"), (p.name, r)
        switches = int(r.split()[1])
        assert switches >= 1
    # With everyone busy and ringing, the token changed hands: more
    # acquisitions in total than peers.
    assert sum(int(r.split()[1]) for r in results) > n
    assert not (arena_dir / "inside").exists()


def test_sigkill_of_holder_hands_token_to_waiter_fast(arena_dir, peers):
    holder = peers(arena_dir, "holder")
    waiter = peers(arena_dir, "waiter")
    assert holder.ask("warm").startswith("warm")
    waiter.send("warm")
    queued = Queue(Arena.open(arena_dir).queue_dir)
    wait_until(lambda: Token(arena_dir / "token.lock").waiters() == [waiter.pid]
               or any(pid == waiter.pid for _n, pid in queued.live()))
    time.sleep(0.05)  # let the waiter block in flock
    killed_at = time.monotonic()
    holder.proc.send_signal(signal.SIGKILL)
    reply = waiter.read()
    assert reply.startswith("warm"), reply
    latency = float(reply.split()[1]) - killed_at
    assert latency < 0.100, f"waiter got the token {latency * 1000:.1f} ms after the SIGKILL"


def test_holder_child_inherits_nothing(arena_dir, peers):
    holder = peers(arena_dir, "holder")
    assert holder.ask("warm").startswith("warm")
    child_pid = int(holder.ask("spawn").split()[1])
    try:
        waiter = peers(arena_dir, "waiter")
        waiter.send("warm 10")
        time.sleep(0.1)
        killed_at = time.monotonic()
        holder.proc.send_signal(signal.SIGKILL)
        reply = waiter.read()
        assert reply.startswith("warm"), reply
        assert float(reply.split()[1]) - killed_at < 0.100
        os.kill(child_pid, 0)  # the child still runs, yet holds nothing
        assert Token(arena_dir / "token.lock").holders() == [waiter.pid]
    finally:
        os.kill(child_pid, signal.SIGKILL)


def test_waiters_are_served_in_arrival_order(arena_dir, peers):
    holder = peers(arena_dir, "holder")
    assert holder.ask("warm").startswith("warm")
    queue = Queue(Arena.open(arena_dir).queue_dir)
    waiters = []
    for i in range(4):
        w = peers(arena_dir, f"w{i}")
        w.send("warm")
        wait_until(lambda: len(queue.live()) == i + 1)
        waiters.append(w)
    assert holder.ask("cold").startswith("cold")
    order = []
    for _ in range(4):
        # Whoever is warm now releases once it is its turn; record who.
        got = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            holders = Token(arena_dir / "token.lock").holders()
            got = next((w for w in waiters if w.pid in holders and w not in order), None)
            time.sleep(0.002)
        assert got is not None
        assert got.read().startswith("warm")
        order.append(got)
        assert got.ask("cold").startswith("cold")
    assert [w.name for w in order] == ["w0", "w1", "w2", "w3"]


def test_yielding_holder_does_not_barge(arena_dir, peers):
    """The holder yields and asks again at once; the waiter must go first every time.

    The waiter is stopped (SIGSTOP) while blocked in flock, so it cannot
    retry the lock when it is released: on flock alone the holder would take
    it straight back.  The tickets must keep the holder waiting instead.
    """
    holder = peers(arena_dir, "holder")
    waiter = peers(arena_dir, "waiter")
    token = Token(arena_dir / "token.lock")
    assert holder.ask("warm").startswith("warm")
    for _ in range(5):
        waiter.send("warm")
        wait_until(lambda: token.waiters() == [waiter.pid])
        os.kill(waiter.pid, signal.SIGSTOP)
        try:
            holder.send("rewarm 10")
            wait_until(lambda: holder.pid not in token.holders())
            time.sleep(0.2)
            assert holder.pid not in token.holders(), "the yielding holder barged ahead of the waiter"
        finally:
            os.kill(waiter.pid, signal.SIGCONT)
        got = waiter.read()
        assert got.startswith("warm"), got
        assert waiter.ask("cold").startswith("cold")
        reply = holder.read().split()
        assert reply[0] == "rewarm", reply
        assert float(got.split()[1]) < float(reply[2])


def test_timeout_when_token_is_never_free(arena_dir, peers):
    holder = peers(arena_dir, "holder")
    assert holder.ask("warm").startswith("warm")
    waiter = peers(arena_dir, "waiter")
    t0 = time.monotonic()
    assert waiter.ask("warm 0.3") == "timeout"
    assert time.monotonic() - t0 < 5
    # The abandoned wait left no ticket and holds nothing.
    assert Queue(arena_dir / "queue").live() == []
    assert holder.ask("cold").startswith("cold")
    assert waiter.ask("warm 5").startswith("warm")

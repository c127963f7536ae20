"""The doorbell: rings before the watch, stale rings, pid reuse, floods."""

import os
import subprocess
import sys
import time

from vramd.arena import doorbell
from vramd.arena.layout import Arena
from vramd.arena.token import Token

from .conftest import wait_until


def test_ring_written_before_the_watch_is_not_lost(arena_dir, peers):
    # The holder takes the token with no warden running yet...
    holder = peers(arena_dir, "holder", warden=False)
    assert holder.ask("warm").startswith("warm")
    # ...a waiter rings and blocks...
    waiter = peers(arena_dir, "waiter")
    waiter.send("warm")
    token = Token(arena_dir / "token.lock")
    wait_until(lambda: waiter.pid in token.waiters())
    # ...and only then does the holder start watching: the rescan must find it.
    assert holder.ask("start") == "started"
    assert holder.ask("serve 5").startswith("cold")
    assert waiter.read().startswith("warm")


def test_watcher_reports_live_foreign_rings_and_ignores_the_rest(arena_dir):
    arena = Arena.open(arena_dir)
    w = doorbell.Watcher(arena.doorbell_dir)
    try:
        assert w.wait(0) is None  # first call: rescan (rings before the watch)
        sleeper = subprocess.Popen(["sleep", "30"])
        try:
            doorbell.ring(arena.doorbell_dir, os.getpid())        # our own: ignored
            doorbell.ring(arena.doorbell_dir, 4_000_000)          # not a live pid
            (arena.doorbell_dir / "not-a-pid").write_text("1")    # not a pid at all
            (arena.doorbell_dir / "0123").write_text("1")         # leading zero
            doorbell.ring(arena.doorbell_dir, sleeper.pid)        # a real one
            got = set()
            deadline = time.monotonic() + 5
            while sleeper.pid not in got and time.monotonic() < deadline:
                got |= w.wait(1) or set()
            assert got == {sleeper.pid}
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        w.close()


def test_stale_rings_are_cleaned_and_pid_reuse_does_not_fool_it(arena_dir):
    arena = Arena.open(arena_dir)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    doorbell.ring(arena.doorbell_dir, dead.pid)
    live = subprocess.Popen(["sleep", "30"])
    try:
        # A ring file older than the process now holding its pid: left by an
        # earlier process with the same pid.
        reused = doorbell.ring(arena.doorbell_dir, live.pid)
        old = time.time() - 3600
        os.utime(reused, (old, old))
        fresh = subprocess.Popen(["sleep", "30"])
        try:
            doorbell.ring(arena.doorbell_dir, fresh.pid)
            scan = doorbell.scan(arena.doorbell_dir)
            assert set(scan.rings) == {fresh.pid}
            assert sorted(scan.cleaned) == sorted([str(dead.pid), str(live.pid)])
            assert sorted(os.listdir(arena.doorbell_dir)) == [str(fresh.pid)]
        finally:
            fresh.kill()
            fresh.wait()
    finally:
        live.kill()
        live.wait()


FLOOD = r"""
import os, sys, time
from pathlib import Path
d = Path(sys.argv[1])
fake = 4_000_000
for i in range(int(sys.argv[2])):
    # Alternate real rings (our live pid) with names that are not live pids.
    name = str(os.getpid()) if i % 2 else str(fake + i % 1000)
    fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"1")
    os.close(fd)
print("flooded", flush=True)
"""


def test_doorbell_flood_loses_no_real_ring_and_yields_once_per_quantum(arena_dir, peers):
    quantum = 0.2
    holder = peers(arena_dir, "holder", quantum=quantum)
    assert holder.ask("warm").startswith("warm")
    flooder = subprocess.Popen([sys.executable, "-c", FLOOD, str(arena_dir / "doorbell"), "10000"],
                               stdout=subprocess.PIPE, text=True)
    # The holder serves the whole time: each yield is followed by a re-warm.
    t0 = time.monotonic()
    yields = 0
    waiter = None
    while flooder.poll() is None or waiter is None:
        reply = holder.ask("rewarm 0.5", timeout=30)
        if reply.startswith("rewarm"):
            yields += 1
        if waiter is None and time.monotonic() - t0 > 0.1:
            # A real waiter arrives in the middle of the flood.
            waiter = peers(arena_dir, "waiter")
            waiter.send("warm 20")
            waiter.send("cold")  # once served, give it back so the holder goes on
        if time.monotonic() - t0 > 30:
            break
    elapsed = time.monotonic() - t0
    assert flooder.wait(30) == 0
    assert waiter.read(timeout=20).startswith("warm"), "the real ring was lost in the flood"
    assert waiter.read().startswith("cold")
    assert yields <= elapsed / quantum + 2, f"{yields} yields in {elapsed:.2f} s with a {quantum} s quantum"


# Rings its own (live) pid every millisecond and never waits for the token:
# the ringer the per-ringer rate limit is for.
FLOOD_OWN_PID = r"""
import os, sys, time
d, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
name = os.path.join(d, str(os.getpid()))
n = 0
while time.monotonic() < end:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"1")
    os.close(fd)
    n += 1
    time.sleep(0.001)
print(n, flush=True)
"""

# A flock-only waiter, as llama.cpp: ring, then block on the token.
RING_THEN_WAIT = r"""
import fcntl, os, sys, time
arena = sys.argv[1]
with open(os.path.join(arena, "doorbell", str(os.getpid())), "w") as f:
    f.write("1")
rang = time.monotonic()
fd = os.open(os.path.join(arena, "token.lock"), os.O_RDONLY | os.O_CLOEXEC)
fcntl.flock(fd, fcntl.LOCK_EX)
print(rang, time.monotonic(), flush=True)
"""


def held_times(reply: str) -> list[float]:
    assert reply.startswith("held"), reply
    return [float(t) for t in reply.split()[1:]]


def test_a_flooding_ringer_gets_one_yield_per_interval_and_delays_no_other_ringer(arena_dir, peers):
    quantum, interval, hold = 0.05, 2.0, 5.0
    holder = peers(arena_dir, "holder", quantum=quantum, ring_interval=interval)
    assert holder.ask("warm").startswith("warm")
    holder.send(f"hold {hold}")
    t0 = time.monotonic()
    flooder = subprocess.Popen([sys.executable, "-c", FLOOD_OWN_PID, str(arena_dir / "doorbell"), str(hold)],
                               stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # mid-way through the flooder's first interval
    # A second ringer, also one that does not wait (a script's `echo 1 > doorbell/$$`).
    other = subprocess.Popen(["sh", "-c", f'echo 1 > {arena_dir / "doorbell"}/$$; sleep 10'])
    try:
        wait_until(lambda: (arena_dir / "doorbell" / str(other.pid)).exists())
        rang = time.monotonic()
        times = held_times(holder.read(timeout=hold + 30))
        rings = int(flooder.communicate(timeout=30)[0])
    finally:
        other.kill()
        other.wait()
    assert rings > 2 * hold / quantum  # a flood: several rings per quantum, for the whole hold
    before = [t for t in times if t < rang]
    after = [t for t in times if t >= rang]
    # The flooder alone: at most one yield per interval (without the gate,
    # one per quantum: ~20 in this second).
    assert len(before) <= (rang - t0) / interval + 1, times
    # The other ringer's ring is acted on at once: one quantum, not the
    # flooder's interval.
    assert after and after[0] - rang < 0.6, (rang, times)
    # Over the whole hold: the flooder's one per interval, plus the other's.
    assert len(times) <= hold / interval + 2, times


def test_a_waiter_rings_through_a_flood_and_gets_the_token_at_once(arena_dir, peers):
    quantum, interval, hold = 0.05, 2.0, 4.0
    holder = peers(arena_dir, "holder", quantum=quantum, ring_interval=interval)
    assert holder.ask("warm").startswith("warm")
    holder.send(f"hold {hold}")
    flooder = subprocess.Popen([sys.executable, "-c", FLOOD_OWN_PID, str(arena_dir / "doorbell"), str(hold)],
                               stdout=subprocess.PIPE, text=True)
    time.sleep(0.6)
    # A second ring from the flooder's interval: a waiter the kernel shows
    # blocked on the token (or rings twice within the interval) is served
    # within a quantum either way.
    waiter = subprocess.run([sys.executable, "-c", RING_THEN_WAIT, str(arena_dir)], capture_output=True,
                            text=True, timeout=30)
    assert waiter.returncode == 0, waiter.stderr
    rang, got = map(float, waiter.stdout.split())
    assert got - rang < 0.6, f"the waiter waited {got - rang:.2f} s behind a flood"
    times = held_times(holder.read(timeout=hold + 30))
    assert flooder.wait(30) == 0
    assert len(times) <= hold / interval + 2, times

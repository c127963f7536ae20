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

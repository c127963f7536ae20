"""A participant in its own process, driven line by line over stdin/stdout.

Tests start several of these against one arena and script them:

    warm [timeout]     ensure_warm(); prints `warm <monotonic>` or `timeout`
    idle               idle(); prints `cold <monotonic>` if it yielded, else `still`
    serve [seconds]    wait until a yield is due, then yield; prints `cold <t>` or `nobody`
    rewarm [seconds]   like serve, then ensure_warm() at once; prints `rewarm <cold t> <warm t>`
    hold <seconds>     for that long: yield whenever due, then warm again; prints `held <yield t>...`
    busy <rounds>      loop: warm, a critical section checked against the others, idle
    cold               go_cold(); prints `cold <t>`
    state              prints the state
    spawn              starts `sleep 60` with close_fds=False; prints its pid
    exit               close() and exit

Times are time.monotonic(), which is one clock for every process on the host,
so a test can compare them with its own.
"""

import faulthandler
import os
import signal
import subprocess
import sys
import time

from vramd.arena.arbiter import Participant
from vramd.arena.layout import Arena
from vramd.errors import Timeout


def say(*words):
    print(*words, flush=True)


def critical_section(marker: str, hold: float) -> None:
    """Fail loudly if anyone else is inside: O_EXCL create is our witness."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        say("OVERLAP")
        sys.exit(3)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(hold)
    os.unlink(marker)


def main():
    faulthandler.register(signal.SIGUSR1)  # the test dumps our stacks when we hang
    arena_path, name = sys.argv[1], sys.argv[2]
    quantum = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    start_warden = (sys.argv[4] != "nowarden") if len(sys.argv) > 4 else True
    ring_interval = {"ring_interval": float(sys.argv[5])} if len(sys.argv) > 5 else {}
    arena = Arena.open(arena_path)
    p = Participant(arena, name, quantum=quantum, max_hold=max(quantum, 5.0), **ring_interval)
    started = False
    if start_warden:
        p.start()
        started = True
    say("ready", os.getpid())
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "warm":
            try:
                p.ensure_warm(float(args[0]) if args else None)
                say("warm", time.monotonic())
            except Timeout:
                say("timeout")
        elif cmd == "idle":
            say("cold", time.monotonic()) if p.idle() else say("still")
        elif cmd == "serve":
            limit = float(args[0]) if args else None
            if p.wait_yield_due(limit) and p.idle():
                say("cold", time.monotonic())
            else:
                say("nobody")
        elif cmd == "rewarm":
            # Yield when asked, then ask for the token back at once, in-process:
            # the barging case the kernel alone gets wrong.
            if p.wait_yield_due(float(args[0]) if args else None) and p.idle():
                cold_at = time.monotonic()
                p.ensure_warm()
                say("rewarm", cold_at, time.monotonic())
            else:
                say("nobody")
        elif cmd == "hold":
            end, times = time.monotonic() + float(args[0]), []
            while (left := end - time.monotonic()) > 0:
                if p.wait_yield_due(left) and p.idle():
                    times.append(time.monotonic())
                    p.ensure_warm()
            say("held", *times)
        elif cmd == "busy":
            rounds, hold = int(args[0]), float(args[1])
            marker = os.path.join(arena_path, "inside")
            for _ in range(rounds):
                p.ensure_warm()
                critical_section(marker, hold)
                p.idle()
            p.go_cold()
            say("done", p.member.switches, p.member.yields)
        elif cmd == "cold":
            p.go_cold()
            say("cold", time.monotonic())
        elif cmd == "state":
            say(p.state)
        elif cmd == "start":
            if not started:
                p.start()
                started = True
            say("started")
        elif cmd == "spawn":
            child = subprocess.Popen(["sleep", "60"], close_fds=False)
            say("child", child.pid)
        elif cmd == "exit":
            break
    p.close()
    say("bye")


if __name__ == "__main__":
    main()

"""`make demo`: two participants hand the GPU token back and forth, with `vramd status`.

Each participant runs in its own process against a fresh arena and serves a
few "requests" (a short sleep standing in for compute).  They ring each
other, yield at idle points after their hold quantum, and queue in order;
the timeline shows each hand-over and `vramd status` shows the arena from
outside, as a user would see it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REQUESTS = 4
COMPUTE_S = 0.15
THINK_S = 0.05


def worker(arena_path: str, name: str, offset: float) -> None:
    from vramd.arena.arbiter import Participant
    from vramd.arena.layout import Arena

    t_start = time.monotonic()

    def say(msg):
        print(f"  [{time.monotonic() - t_start + offset:6.3f}s] {name:8s} {msg}", flush=True)

    with Participant(Arena.open(arena_path), name, model=f"{name}.gguf") as p:
        for i in range(REQUESTS):
            t0 = time.monotonic()
            was_cold = not p.holds_token
            p.ensure_warm(timeout=30)
            if was_cold:
                say(f"request {i + 1}: got the token in {(time.monotonic() - t0) * 1000:.1f} ms")
            else:
                say(f"request {i + 1}: already warm")
            time.sleep(COMPUTE_S)  # the compute
            # Idle point: yield if the peer rang and our quantum is served.
            deadline = time.monotonic() + THINK_S
            while time.monotonic() < deadline:
                if p.idle():
                    say("yielded to the peer")
                    break
                time.sleep(0.005)
        say(f"done: {p.member.switches} times warm, {p.member.yields} yields")


def show_status(arena: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena)],
                         capture_output=True, text=True)
    print("\n$ vramd status")
    print(out.stdout.rstrip() or out.stderr.rstrip())
    print()


def main() -> None:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-demo-", dir=base) as tmp:
        arena = Path(tmp) / "arena"
        from vramd.arena.layout import Arena
        Arena.open(arena)
        print(f"vramd demo: two participants share one arena ({arena})\n")
        t0 = time.monotonic()
        procs = []
        for name in ("chat", "task"):
            code = ("from vramd.demo import worker; "
                    f"worker({str(arena)!r}, {name!r}, {time.monotonic() - t0!r})")
            procs.append(subprocess.Popen([sys.executable, "-c", code]))
            time.sleep(0.05)
        time.sleep(0.3)
        show_status(arena)
        time.sleep(0.45)
        show_status(arena)
        codes = [p.wait(60) for p in procs]
        show_status(arena)
        if any(codes):
            sys.exit(f"vramd demo: a participant failed (exit codes {codes})")
        print("Both participants served every request; the token went back and forth at idle points.")


if __name__ == "__main__":
    main()

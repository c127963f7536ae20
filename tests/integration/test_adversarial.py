"""The adversarial run of issue 19: three daemons, a client loop, and a hostile or careless operator.

One scripted run, bounded (well under 2 minutes on lavapipe), with real
processes, signals and files.  While a client thread per daemon sends greedy
requests without pause, the operator:

1. sends the invalid requests of item 6 (each a 400 within 2 s, no GPU taken);
2. SIGSTOPs a parked peer for 3 s (the one that must give up room: --vram-budget fits two of three);
3. SIGSTOPs a `vramd exec` waiting in the ticket queue for 3 s;
4. replaces token.lock (`mv token.lock token.old; touch token.lock`);
5. removes the whole arena (`rm -rf`, as a logout wipes $XDG_RUNTIME_DIR).

A supervisor thread plays systemd: a daemon that exits 4 (its token or arena
is gone) is started again, as Restart=on-failure does.  Asserted:

- never two computing holders: from /proc/locks (sampled every 10 ms: WRITE
  flocks of daemons on any inode token.lock has had) and from the member
  records (warm or cooling), two at once never last longer than 0.5 s, the
  guard's 100 ms look plus one engine step;
- every 503 comes within its timeout (--wake-timeout 3) + 1 s; no other error;
- every served answer is identical to its daemon's reference (its first one);
- afterwards (SIGTERM to all: exit 0) the arena is clean: no members, rings,
  tickets or control sockets, the token free.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from tests.integration.conftest import ROOT, SHAPE, DaemonProc, daemon_env
from tests.integration.test_bad_requests import BAD, raw_post
from tests.integration.test_cache import footprint
from tests.integration.test_waits import all_threads_stopped
from tests.ggufgen.check import write_model
from vramd.arena.members import Registry
from vramd.arena.queue import Queue
from vramd.arena.token import Token

WAKE_TIMEOUT = 3.0
REQUEST = {"prompt": [1, 7, 9], "max_tokens": 4, "temperature": 0}


class Fleet:
    """The three daemons, restarted when they exit 4 (what systemd's Restart=on-failure does)."""

    def __init__(self, arena, models, flags):
        self.arena, self.models, self.flags = arena, models, flags
        self.current: dict[str, DaemonProc] = {}
        self.all: list[DaemonProc] = []
        self.restarts: list[tuple[str, int]] = []
        self.bad_exits: list[str] = []
        self.stopping = False
        self.lock = threading.Lock()
        for name in models:
            self.start(name)

    def start(self, name: str) -> DaemonProc:
        d = DaemonProc(self.arena, self.models[name], name, *self.flags, wait_ready=False)
        with self.lock:
            self.current[name] = d
            self.all.append(d)
        d.wait_ready(60)
        return d

    def supervise(self):
        while not self.stopping:
            for name, d in list(self.current.items()):
                rc = d.proc.poll()
                if rc is None or self.stopping:
                    continue
                if rc != 4:
                    self.bad_exits.append(f"{name} exited {rc}:\n{d.output[-3000:]}")
                    return
                self.restarts.append((name, d.proc.pid))
                time.sleep(0.3)            # RestartSec (scaled down)
                self.start(name)
            time.sleep(0.05)

    def pids(self) -> set[int]:
        return {d.proc.pid for d in self.all}


class Sampler:
    """Who holds a token inode (/proc/locks) and who claims the GPU (the records), every 10 ms."""

    def __init__(self, arena, fleet):
        self.arena, self.fleet = arena, fleet
        self.inodes: set[str] = set()
        self.longest_two_flocks = self.longest_two_claims = 0.0
        self.samples = 0
        self.stop = False

    def run(self):
        since_flocks = since_claims = None
        while not self.stop:
            now = time.monotonic()
            try:
                st = os.stat(self.arena / "token.lock")
                self.inodes.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
            except FileNotFoundError:
                pass
            pids = self.fleet.pids()
            holders = set()
            with open("/proc/locks") as f:
                for line in f:
                    parts = line.split()
                    if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
                        continue
                    if int(parts[4]) in pids and parts[5] in self.inodes:
                        holders.add(int(parts[4]))
            try:
                claims = [m for m in Registry(self.arena / "members").list(clean=False)
                          if m.state in ("warm", "cooling")]
            except Exception:
                claims = []
            since_flocks = (since_flocks or now) if len(holders) > 1 else None
            since_claims = (since_claims or now) if len(claims) > 1 else None
            if since_flocks is not None:
                self.longest_two_flocks = max(self.longest_two_flocks, now - since_flocks)
            if since_claims is not None:
                self.longest_two_claims = max(self.longest_two_claims, now - since_claims)
            self.samples += 1
            time.sleep(0.01)


def client(fleet, name, reference, results, stop, paused):
    while not stop.is_set():
        if paused[name].is_set():
            time.sleep(0.05)
            continue
        d = fleet.current[name]
        try:
            m = d.member()
        except Exception:
            m = None
        if m is None or d.proc.poll() is not None:
            time.sleep(0.05)
            continue
        t0 = time.monotonic()
        try:
            status, body = raw_post(m.endpoint + "/v1/completions", json.dumps(REQUEST).encode(), timeout=30)
        except (urllib.error.URLError, ConnectionError, OSError) as e:   # its daemon is going or gone
            results.append((name, "down", time.monotonic() - t0, repr(e)))
            time.sleep(0.05)
            continue
        took = time.monotonic() - t0
        if status == 200:
            text = body["choices"][0]["text"]
            reference.setdefault(name, text)
            results.append((name, 200, took, text))
        else:
            results.append((name, status, took, body["error"]["message"]))


def test_adversarial_run(tmp_path):
    t_start = time.monotonic()
    arena = tmp_path / "arena"
    files = {n: write_model(tmp_path / f"{n}.gguf", seed=30 + i, shape=SHAPE) for i, n in enumerate("abc")}
    one = footprint(files["a"])
    fleet = Fleet(arena, files, ("--wake-timeout", str(WAKE_TIMEOUT), "--vram-budget", str(2 * one + one // 2)))
    sampler = Sampler(arena, fleet)
    reference: dict[str, str] = {}
    results: list[tuple] = []
    stop = threading.Event()
    paused = {n: threading.Event() for n in files}
    threads = [threading.Thread(target=fleet.supervise, daemon=True), threading.Thread(target=sampler.run, daemon=True)]
    threads += [threading.Thread(target=client, args=(fleet, n, reference, results, stop, paused), daemon=True)
                for n in files]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while len(reference) < 3:
            assert time.monotonic() < deadline and not fleet.bad_exits, (reference, fleet.bad_exits)
            time.sleep(0.05)

        # 1. The invalid requests of item 6: a 400 at once, from whichever daemon.
        for route, raw, says in BAD:
            if "chat" in route and "system" in raw:
                continue   # needs a template that refuses (tests/integration/test_bad_requests.py)
            m = fleet.current["b"].member()
            t0 = time.monotonic()
            status, body = raw_post(m.endpoint + "/v1/" + route, raw.encode())
            assert status == 400 and time.monotonic() - t0 < 2.0, (raw[:60], body)

        # 2. A parked peer stopped for 3 s (its own client pauses: a stopped daemon answers nobody).
        # (one look may find none parked: with three clients looping, a member is as often warming or
        # evicted cold; look again for a while)
        deadline = time.monotonic() + 10
        while True:
            victim = next((n for n, d in fleet.current.items() if d.member() and d.member().state == "parked"),
                          None)
            if victim is not None:
                break
            assert time.monotonic() < deadline, "no member parked within 10 s"
            time.sleep(0.02)
        paused[victim].set()
        frozen = fleet.current[victim]
        frozen.proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        frozen.proc.send_signal(signal.SIGCONT)
        paused[victim].clear()

        # 3. A waiter stopped in the ticket queue for 3 s.
        waiter = subprocess.Popen([sys.executable, "-m", "vramd.cli", "exec", "--", "sleep", "0.2"],
                                  env=daemon_env(VRAMD_ARENA=str(arena)), cwd=ROOT)
        deadline = time.monotonic() + 10
        while waiter.poll() is None and waiter.pid not in [p for _n, p in Queue(arena / "queue").live()]:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        if waiter.poll() is None:
            waiter.send_signal(signal.SIGSTOP)
            while waiter.poll() is None and not all_threads_stopped(waiter.pid):
                time.sleep(0.01)
            time.sleep(3.0)
            waiter.send_signal(signal.SIGCONT)
        assert waiter.wait(20) == 0

        # 4. token.lock replaced under the traffic: its holder (if any) exits 4 and is restarted.
        os.rename(arena / "token.lock", arena / "token.old")
        (arena / "token.lock").touch(mode=0o600)
        time.sleep(4.0)

        # 5. The arena wiped: every daemon exits 4; restarted, they make a new one.
        restarts = len(fleet.restarts)
        while arena.exists():   # the daemons write member records while it goes: delete until it is gone
            shutil.rmtree(arena, ignore_errors=True)
        deadline = time.monotonic() + 40
        while len(fleet.restarts) < restarts + 3 or any(d.member() is None for d in fleet.current.values()):
            assert time.monotonic() < deadline and not fleet.bad_exits, (fleet.restarts, fleet.bad_exits)
            time.sleep(0.1)
        served = sum(1 for r in results if r[1] == 200)
        deadline = time.monotonic() + 20
        while sum(1 for r in results if r[1] == 200) < served + 6:   # all serve again, in the new arena
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads[2:]:
            t.join(40)
        fleet.stopping = True
        sampler.stop = True
        codes = {}
        for name, d in fleet.current.items():
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
                d.proc.send_signal(signal.SIGTERM)
            codes[name] = d.proc.wait(30)
        for d in fleet.all:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
    assert not fleet.bad_exits, fleet.bad_exits
    assert codes == {"a": 0, "b": 0, "c": 0}, codes
    print(f"adversarial run: {len(results)} requests "
          f"({', '.join(f'{k}: {sum(1 for r in results if r[1] == k)}' for k in (200, 503, 'down'))}), "
          f"restarts {fleet.restarts}, {sampler.samples} samples, two token flocks at most "
          f"{sampler.longest_two_flocks:.3f} s, two GPU claims at most {sampler.longest_two_claims:.3f} s, "
          f"{time.monotonic() - t_start:.0f} s")

    # Never two computing holders for longer than the guard's look and one step.
    assert sampler.samples > 1000
    assert sampler.longest_two_flocks < 0.5 and sampler.longest_two_claims < 0.5, vars(sampler)
    # Every 503 in time; nothing else went wrong; every answer the same.
    by = {}
    for name, status, took, what in results:
        by.setdefault(status, []).append((name, took, what))
    assert set(by) <= {200, 503, "down"}, {k: v[:3] for k, v in by.items() if k not in (200, 503, "down")}
    # A 503 comes within its wait for the GPU (--wake-timeout) + 1 s; one for a generation that had
    # the GPU and was ended mid-way (a replaced or wiped token: "ended after N tokens") may have
    # paused for peers between its steps first, each pause's wait bounded by --wake-timeout too.
    def bound(what: str) -> float:
        mid_way = "the generation was ended after" in what or "a generation paused after" in what
        steps = REQUEST["max_tokens"] + 1 if mid_way else 1
        return steps * (WAKE_TIMEOUT + 1.0)
    late = [r for r in by.get(503, []) if r[1] > bound(r[2])]
    assert not late, late[:5]
    wrong = [r for r in by.get(200, []) if r[2] != reference[r[0]]]
    assert not wrong, (wrong[:5], reference)
    assert len(by[200]) > 30
    assert len(fleet.restarts) >= 3    # the wipe restarted all three (the replaced token its holder, if any)
    # The arena is clean again (token.old is the operator's own leftover, gone with the wipe).
    assert os.listdir(arena / "members") == []
    assert os.listdir(arena / "doorbell") == []
    assert [n for n in os.listdir(arena / "queue") if not n.startswith(".")] == []
    assert [n for n in os.listdir(arena / "control") if n.endswith(".sock")] == []
    assert Token(arena / "token.lock").holders() == []
    assert time.monotonic() - t_start < 150

"""systemd's watchdog is fed while the loop waits for the GPU or generates (issue 19, item 3).

A real AF_UNIX notify socket stands in for systemd, with the unit's
`WatchdogSec=` scaled down (systemd/vramd@.service says 30 s; here the
period is 1.5 s, so a gap the unit would punish shows up in seconds).
Before, the loop pinged only between jobs: a daemon waiting 60 s for the
GPU sent no WATCHDOG=1 for 76 s, and systemd would have killed it.
"""

import re
import socket
import threading
import time

from .conftest import ROOT, DaemonProc, daemon_env
from .test_shutdown import hold_token_elsewhere, in_thread, post

PERIOD = 1.5   # seconds: WATCHDOG_USEC, as systemd sets it from WatchdogSec=


def test_the_unit_asks_for_a_watchdog_the_daemon_feeds():
    unit = (ROOT / "systemd" / "vramd@.service").read_text()
    assert int(re.search(r"^WatchdogSec=(\d+)", unit, re.M).group(1)) == 30


class NotifySocket:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.pings: list[float] = []
        self.other: list[str] = []
        self._stop = False
        threading.Thread(target=self._recv, daemon=True).start()

    def _recv(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096).decode()
            except socket.timeout:
                continue
            for line in data.splitlines():
                (self.pings.append(time.monotonic()) if line == "WATCHDOG=1" else self.other.append(line))

    def longest_gap(self, since: float, until: float) -> float:
        marks = [since] + [t for t in self.pings if since <= t <= until] + [until]
        return max(b - a for a, b in zip(marks, marks[1:]))


def test_watchdog_is_fed_while_waiting_for_the_gpu_and_during_a_long_generation(tmp_path, models):
    notify = NotifySocket(tmp_path / "notify.sock")
    arena = tmp_path / "arena"
    env = daemon_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC=str(int(PERIOD * 1e6)))
    d = DaemonProc(arena, models[0], "alpha", "--ctx", "1024", "--wake-timeout", "6", env=env)
    try:
        url = d.member().endpoint + "/v1/completions"
        # 1. Waiting for the GPU: a blocker holds it for longer than the wake-timeout.
        d.ask("yield")
        blocker = hold_token_elsewhere(arena)
        try:
            t0 = time.monotonic()
            status, _body = post(url, {"prompt": [1, 2], "max_tokens": 2})
            t1 = time.monotonic()
        finally:
            blocker.kill()
            blocker.wait()
        assert status == 503 and t1 - t0 > 5.5
        assert notify.longest_gap(t0, t1) < PERIOD, (notify.pings, t0, t1)
        # 2. A long generation: the watchdog is fed between its steps.
        t0 = time.monotonic()
        job = in_thread(post, url, {"prompt": [1, 2, 3], "max_tokens": 200, "temperature": 0})
        job["thread"].join(120)
        t1 = time.monotonic()
        assert job["result"][0] == 200 and t1 - t0 > PERIOD, (job, t1 - t0)
        assert notify.longest_gap(t0, t1) < PERIOD, (notify.pings, t0, t1)
    finally:
        d.stop()
        notify._stop = True

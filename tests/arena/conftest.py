"""Fixtures for arena tests: a fresh arena per test and participant processes."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def arena_dir(tmp_path):
    path = tmp_path / "arena"
    yield path


class Peer:
    """A participant process (tests/arena/peerproc.py) scripted over a pipe."""

    def __init__(self, arena: Path, name: str, quantum: float = 0.0, warden: bool = True,
                 ring_interval: float | None = None):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        interval = [] if ring_interval is None else [str(ring_interval)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.arena.peerproc", str(arena), name, str(quantum),
             "warden" if warden else "nowarden", *interval],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.name = name
        self._lines = start_line_reader(self.proc.stdout)
        ready = self.read()
        assert ready.startswith("ready"), ready
        self.pid = int(ready.split()[1])

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 20.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.send_signal(signal.SIGUSR1)  # peerproc prints its stacks to stderr
            time.sleep(0.2)
            raise TimeoutError(f"peer {self.name} said nothing in {timeout} s") from None
        if line is None:
            raise EOFError(f"peer {self.name} exited with {self.proc.wait()}")
        return line

    def ask(self, line: str, timeout: float = 20.0) -> str:
        self.send(line)
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=5)
            except Exception:
                self.proc.kill()
                self.proc.wait()


def start_line_reader(stream) -> "queue.Queue[str | None]":
    """Lines of `stream` as they come, in a queue (None at EOF).

    select() on a buffered pipe misses lines already read into the buffer,
    so a thread does the reading.
    """
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@pytest.fixture
def peers():
    started: list[Peer] = []

    def start(arena, name, **kw):
        peer = Peer(arena, name, **kw)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.close()


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")

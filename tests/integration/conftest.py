"""Daemons in real processes on real Vulkan (lavapipe in CI), on synthetic GGUF models."""

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ggufgen.check import ModelShape, write_model
from vramd.arena.members import Registry
from vramd.server.control import request

ROOT = Path(__file__).resolve().parents[2]
LAVAPIPE = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"


def daemon_env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    if os.path.exists(LAVAPIPE) and "VK_DRIVER_FILES" not in os.environ:
        env["VK_DRIVER_FILES"] = LAVAPIPE
    env.pop("NOTIFY_SOCKET", None)
    env.update(extra)
    return env


class DaemonProc:
    """`vramd serve` in its own process; its output is collected in a thread."""

    def __init__(self, arena: Path, model: Path, name: str, *flags: str, env: dict | None = None,
                 wait_ready: bool = True, ctx: int | None = None):
        """ctx: --ctx (default CTX; 0: not given, the daemon's own choice)."""
        self.arena, self.name = arena, name
        ctx = CTX if ctx is None else ctx
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vramd.cli", "serve", str(model), "--name", name, "--arena", str(arena),
             "--port", "0", *(("--ctx", str(ctx)) if ctx else ()), "--quantum", "0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or daemon_env(), cwd=ROOT)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        if wait_ready:
            self.wait_ready()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(" serving " in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon {self.name} exited {self.proc.returncode}:\n{self.output}")
            time.sleep(0.02)
        raise AssertionError(f"daemon {self.name} not ready in {timeout} s:\n{self.output}")

    @property
    def socket(self) -> Path:
        return self.arena / "control" / f"{self.name}.sock"

    def ask(self, cmd: str, **args) -> dict:
        return request(self.socket, cmd, wait=60, **args)

    def member(self):
        return next((m for m in Registry(self.arena / "members").list(clean=False) if m.name == self.name), None)

    def stop(self) -> int:
        self.terminate()
        return self.reap()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def reap(self) -> int:
        """Wait for the process to end after `terminate` (SIGKILL after 30 s)."""
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def gpu_held_elsewhere(arena: Path, seconds: int = 30):
    """`vramd exec -- sleep` holding the arena's GPU token (waited for, at most 10 s) while the
    block runs: a holder that never yields, so a daemon's request waits out --wake-timeout."""
    from vramd.arena.token import Token
    blocker = subprocess.Popen([sys.executable, "-m", "vramd.cli", "exec", "--", "sleep", str(seconds)],
                               env=daemon_env(VRAMD_ARENA=str(arena)), cwd=ROOT)
    try:
        deadline = time.monotonic() + 10
        while Token(arena / "token.lock").holders() != [blocker.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        yield blocker
    finally:
        blocker.terminate()
        blocker.wait()


@pytest.fixture
def daemons():
    started: list[DaemonProc] = []

    def start(*args, **kw):
        d = DaemonProc(*args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:   # all at once: each one's shutdown (release, drain) overlaps the others'
        d.terminate()
    for d in started:
        d.reap()


SHAPE = ModelShape(n_vocab=128, n_embd=128, n_ff=256, n_layer=2, n_head=4)
CTX = 64   # DaemonProc's --ctx


def planned(model: Path, ctx: int = CTX, **kw):
    """What a daemon serving `model` allocates (vramd/model/footprint.py, as `vramd plan`
    says; test_footprint.py holds it to a daemon's breakdown): no probe daemon needed.
    Its KV cache holds the default --parallel's slots (n_seq=1 for a `--parallel 1` daemon)."""
    from vramd.model.footprint import footprint
    from vramd.model.gguf_check import validate_gguf
    from vramd.server.slots import DEFAULT_PARALLEL
    kw.setdefault("n_seq", DEFAULT_PARALLEL)
    return footprint(validate_gguf(model), ctx, **kw)


@pytest.fixture
def models(tmp_path):
    a = write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE)
    b = write_model(tmp_path / "beta.gguf", seed=2, shape=SHAPE)
    return a, b


@pytest.fixture
def arena(tmp_path):
    return tmp_path / "arena"

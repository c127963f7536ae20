"""Regressions for defects found in review: each test failed before its fix."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from vramd.arena.arbiter import Participant
from vramd.arena.layout import Arena
from vramd.arena.members import Registry
from vramd.arena.token import Token
from vramd.errors import VramdError

from .conftest import ROOT, DaemonProc, daemon_env


def test_an_infinite_timeout_waits_instead_of_leaking_the_token(tmp_path):
    arena = Arena.open(tmp_path / "arena")
    holder = Token(arena.token_path)
    assert holder.try_acquire()
    with Participant(arena, "waiter") as p:
        t = threading.Thread(target=p.ensure_warm, kwargs={"timeout": float("inf")})
        t.start()
        time.sleep(0.3)
        holder.release()
        t.join(10)
        assert p.holds_token
        p.go_cold()
        assert Token(arena.token_path).try_acquire(), "the token stayed held after going cold"


def test_huge_timeouts_are_refused_as_usage_errors(tmp_path, models, daemons):
    env = daemon_env(VRAMD_ARENA=str(tmp_path / "arena"))
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "exec", "--timeout", "inf", "--", "true"],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    d = daemons(tmp_path / "arena", models[0], "alpha")
    with pytest.raises(VramdError, match="between 0 and 86400"):
        d.ask("wake", timeout=1e300)
    assert d.ask("status")["holds_token"]


def test_a_failed_publish_while_going_cold_still_releases_the_token(tmp_path):
    arena = Arena.open(tmp_path / "arena")
    p = Participant(arena, "p").start()
    try:
        p.ensure_warm()
        os.rename(arena.members_dir, tmp_path / "gone")   # every publish now fails
        p.go_cold()
        assert not p.holds_token
        assert Token(arena.token_path).try_acquire()
    finally:
        os.rename(tmp_path / "gone", arena.members_dir)
        p.close()


def test_concurrent_publishes_never_tear_the_record(tmp_path):
    arena = Arena.open(tmp_path / "arena")
    p = Participant(arena, "p")
    stop = threading.Event()
    errors = []

    def publish():
        try:
            for _ in range(300):
                p.publish()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=publish) for _ in range(3)]
    for t in threads:
        t.start()
    torn = 0
    path = Registry(arena.members_dir).path_for(os.getpid())
    while any(t.is_alive() for t in threads):
        try:
            json.loads(path.read_bytes())
        except FileNotFoundError:
            pass
        except ValueError:
            torn += 1
    stop.set()
    assert errors == [] and torn == 0


def test_a_planted_fifo_in_members_does_not_block_a_publish(tmp_path):
    arena = Arena.open(tmp_path / "arena")
    for name in (f".{os.getpid()}.json.tmp", f".{os.getpid()}.tmp"):
        os.mkfifo(arena.members_dir / name)
    p = Participant(arena, "p")
    done = threading.Event()
    threading.Thread(target=lambda: (p.publish(), done.set()), daemon=True).start()
    assert done.wait(5), "publishing blocked on a planted FIFO"


def test_sigterm_while_waiting_for_the_token_at_start_up(tmp_path, models):
    arena = tmp_path / "arena"
    Arena.open(arena)
    holder = subprocess.Popen(["flock", str(arena / "token.lock"), "sleep", "30"])
    try:
        time.sleep(0.3)
        d = DaemonProc(arena, models[0], "alpha", wait_ready=False)
        deadline = time.monotonic() + 30
        while not (arena / "queue").exists() or not any(n[0].isdigit() for n in os.listdir(arena / "queue")):
            assert time.monotonic() < deadline, d.output
            time.sleep(0.05)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0, d.output
        assert time.monotonic() - t0 < 3, "the daemon ignored SIGTERM while waiting for the token"
        assert Registry(arena / "members").list() == []
        assert not any(n[0].isdigit() for n in os.listdir(arena / "queue"))
    finally:
        holder.kill()
        holder.wait()


def test_two_daemons_cannot_share_a_name(tmp_path, models, daemons):
    arena = tmp_path / "arena"
    daemons(arena, models[0], "alpha")
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "serve", str(models[1]), "--name", "alpha", "--arena",
                        str(arena), "--port", "0"], capture_output=True, text=True, env=daemon_env(), cwd=ROOT)
    assert r.returncode in (2, 8) and "alpha" in r.stderr and "Traceback" not in r.stderr


def test_exec_sends_one_sigint_to_its_child(tmp_path):
    script = tmp_path / "count.py"
    script.write_text("import signal, time, sys\n"
                      "n = []\n"
                      "signal.signal(signal.SIGINT, lambda *a: n.append(1))\n"
                      "print('ready', flush=True)\n"
                      "t = time.time()\n"
                      "while time.time() - t < 1.5: time.sleep(0.05)\n"
                      "print(len(n), flush=True)\n")
    env = daemon_env(VRAMD_ARENA=str(tmp_path / "arena"))
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "exec", "--", sys.executable, str(script)],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
                         start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    os.killpg(p.pid, signal.SIGINT)   # what a supervisor signalling the whole group does
    assert p.stdout.readline().strip() == "1"
    p.wait(10)

"""The `vramd` command as a user runs it: a real process, real exit codes, real signals."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from vramd.arena.layout import Arena
from vramd.arena.members import Registry
from vramd.arena.token import Token

from .conftest import ROOT, wait_until


def vramd(*args, arena=None, timeout=30, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if arena is not None:
        env["VRAMD_ARENA"] = str(arena)
    return subprocess.run([sys.executable, "-m", "vramd.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, **kw)


def start_vramd(*args, arena):
    env = dict(os.environ, PYTHONPATH=str(ROOT), VRAMD_ARENA=str(arena))
    return subprocess.Popen([sys.executable, "-m", "vramd.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_status_json_names_holder_waiter_and_members(arena_dir, peers):
    a = peers(arena_dir, "alpha")
    b = peers(arena_dir, "beta")
    assert a.ask("warm").startswith("warm")
    b.send("warm")
    wait_until(lambda: b.pid in Token(arena_dir / "token.lock").waiters())
    r = vramd("status", "--json", arena=arena_dir)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["arena"] == str(arena_dir)
    assert s["holder_pid"] == a.pid and s["holder_is_member"]
    rows = {m["name"]: m for m in s["members"]}
    assert rows["alpha"]["holds_token"] and rows["alpha"]["state"] == "warm"
    assert not rows["beta"]["holds_token"] and rows["beta"]["state"] == "warming"
    assert [w["pid"] for w in s["waiting"]] == [b.pid]
    for m in s["members"]:
        assert set(m["device_bytes"]) == {"weights", "state", "encoder", "scratch"}
        assert "host_bytes" in m and "since" in m and "switches" in m
    text = vramd("status", arena=arena_dir).stdout
    assert "alpha" in text and "beta" in text and f"holder  pid {a.pid}" in text


def test_status_names_a_holder_that_is_not_a_member(arena_dir):
    Arena.open(arena_dir)
    # flock(1) takes the lock, then its child `sleep` inherits the fd: the
    # pid /proc/locks names is flock's own.
    holder = subprocess.Popen(["flock", str(arena_dir / "token.lock"), "sleep", "30"])
    try:
        wait_until(lambda: Token(arena_dir / "token.lock").holders())
        s = json.loads(vramd("status", "--json", arena=arena_dir).stdout)
        assert s["holder_pid"] == holder.pid
        assert not s["holder_is_member"] and s["holder_name"] == "flock"
        # Kill flock itself: the inherited fd in `sleep` still holds the token,
        # and status must name the real holder, not the dead taker.
        child = int(subprocess.check_output(["pgrep", "-P", str(holder.pid)]).split()[0])
        holder.kill()
        holder.wait()
        s = json.loads(vramd("status", "--json", arena=arena_dir).stdout)
        assert s["holder_pid"] == child and s["holder_name"] == "sleep"
        os.kill(child, signal.SIGKILL)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_yield_wait_makes_the_holder_go_cold(arena_dir, peers):
    a = peers(arena_dir, "alpha", quantum=0.1)
    assert a.ask("warm").startswith("warm")
    a.send("serve 20")
    r = vramd("yield", "alpha", "--wait", "--timeout", "10", arena=arena_dir)
    assert r.returncode == 0, r.stderr
    assert "alpha yielded" in r.stdout
    assert a.read().startswith("cold")
    assert Token(arena_dir / "token.lock").holders() == []
    r = vramd("yield", "alpha", arena=arena_dir)
    assert r.returncode == 0 and "already cold" in r.stdout


def test_yield_wait_times_out_with_exit_1(arena_dir):
    holder = start_vramd("exec", "--name", "batch", "--", "sleep", "30", arena=arena_dir)
    try:
        wait_until(lambda: Token(arena_dir / "token.lock").holders() if (arena_dir / "token.lock").exists() else None)
        r = vramd("yield", "--all", "--wait", "--timeout", "0.3", arena=arena_dir)
        assert r.returncode == 1
        assert r.stderr.startswith("vramd: batch did not yield within 0.3 s")
        assert "Traceback" not in r.stderr
    finally:
        holder.terminate()
        holder.wait()


def test_yield_unknown_member_is_exit_8(arena_dir):
    Arena.open(arena_dir)
    r = vramd("yield", "nobody-by-that-name", arena=arena_dir)
    assert r.returncode == 8 and r.stderr.strip().startswith("vramd: no member named")


def test_exec_passes_exit_code_and_releases(arena_dir):
    r = vramd("exec", "--name", "job", "--", sys.executable, "-c",
              "import json,subprocess,sys,os;"
              "s=json.loads(subprocess.check_output([sys.executable,'-m','vramd.cli','status','--json']));"
              "sys.exit(7 if s['holder_pid']==os.getppid() and s['members'][0]['name']=='job' else 1)",
              arena=arena_dir)
    assert r.returncode == 7, r.stderr
    assert Token(arena_dir / "token.lock").holders() == []
    assert Registry(arena_dir / "members").list() == []


def test_exec_missing_command_is_127_without_traceback(arena_dir):
    r = vramd("exec", "--", "/nonexistent/tool", arena=arena_dir)
    assert r.returncode == 127
    assert r.stderr.strip() == "vramd: /nonexistent/tool: command not found"


def test_exec_forwards_sigterm_and_cleans_up(arena_dir):
    p = start_vramd("exec", "--name", "job", "--", "sleep", "30", arena=arena_dir)
    token = Token
    wait_until(lambda: (arena_dir / "token.lock").exists() and token(arena_dir / "token.lock").holders())
    child = int(wait_until(lambda: subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                                  text=True).stdout.split() or None)[0])
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 128 + signal.SIGTERM

    def child_gone():
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False
    # Gone within moments (a full run once still saw its pid at the instant vramd exited).
    wait_until(child_gone, timeout=5.0)
    assert Token(arena_dir / "token.lock").holders() == []
    assert os.listdir(arena_dir / "members") == []


def test_exec_timeout_exits_1(arena_dir):
    holder = start_vramd("exec", "--", "sleep", "30", arena=arena_dir)
    try:
        wait_until(lambda: (arena_dir / "token.lock").exists() and Token(arena_dir / "token.lock").holders())
        t0 = time.monotonic()
        r = vramd("exec", "--timeout", "0.3", "--", "true", arena=arena_dir)
        assert r.returncode == 1 and "not free after" in r.stderr and "timeout 0.3 s" in r.stderr
        assert time.monotonic() - t0 < 10
    finally:
        holder.terminate()
        holder.wait()


def test_ring_rings_as_the_calling_process(arena_dir):
    r = vramd("ring", arena=arena_dir)
    assert r.returncode == 0
    assert (arena_dir / "doorbell" / str(os.getpid())).read_text() == "1"


def test_user_errors_are_one_line_with_their_exit_code(tmp_path):
    open_arena = tmp_path / "open"
    open_arena.mkdir()
    os.chmod(open_arena, 0o777)
    r = vramd("status", "--arena", str(open_arena / "x"), "--json")
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr
    r = vramd("ring", "--arena", str(open_arena))
    assert r.returncode == 3 and "world-writable" in r.stderr and "Traceback" not in r.stderr
    r = vramd("ring", "--arena", str(open_arena), "--allow-shared-arena")
    assert r.returncode == 0
    r = vramd("yield", "--bogus-flag")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = vramd("yield", "x", "--all", "--arena", str(tmp_path / "a"))
    assert r.returncode == 2 and r.stderr.strip() == "vramd: give a NAME or --all, not both"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a group-owned arena")
def test_system_arena_lets_ringers_ring_but_not_take_the_token():
    # Outside pytest's 0700 tmp tree, so that `nobody` can reach it.
    base = tempfile.mkdtemp(prefix="vramd-sys-", dir="/dev/shm")
    os.chmod(base, 0o755)
    try:
        check_system_arena(Path(base) / "arena")
    finally:
        shutil.rmtree(base)


def check_system_arena(path):
    r = vramd("arena", "init", "--path", str(path), "--group", "daemon", "--ring-group", "nogroup")
    assert r.returncode == 0, r.stderr
    assert oct(os.stat(path / "token.lock").st_mode & 0o7777) == "0o660"
    assert oct(os.stat(path / "doorbell").st_mode & 0o7777) == "0o1770"

    def as_nobody(script):
        # A shell script, as a ringer would be; Python's venv may not be
        # readable by nobody.
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, user="nobody",
                              group="nogroup", extra_groups=[], cwd="/")

    ring = as_nobody(f"echo 1 > {path / 'doorbell'}/$$")
    assert ring.returncode == 0, ring.stderr
    take = as_nobody(f"flock -n {path / 'token.lock'} true")
    assert take.returncode != 0 and "Permission denied" in take.stderr

"""Two `vramd serve` daemons time-sharing one (lavapipe) device through a real arena."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from vramd.arena.token import Token
from vramd.errors import VramdError
from vramd.server.control import request

from .conftest import daemon_env, planned


def breakdown_device(member):
    return {k: v["device"] for k, v in member.breakdown.items()}


def test_two_daemons_alternate_100_times_bit_exact(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--evict-state", "always", "--residency", "exclusive")
    b = daemons(arena, models[1], "beta", "--evict-state", "always", "--residency", "exclusive")
    token = Token(arena / "token.lock")
    weights = {d.name: d.member().breakdown["weights"]["host"] for d in (a, b)}
    for i in range(100):
        warm, cold = (a, b) if i % 2 == 0 else (b, a)
        reply = warm.ask("wake")
        assert reply["state"] == "warm"
        assert token.holders() == [warm.proc.pid]
        mw, mc = warm.member(), cold.member()
        assert mw.state == "warm" and mc.state == "cold"
        assert breakdown_device(mw)["weights"] == weights[warm.name]
        assert breakdown_device(mw)["state"] == mw.breakdown["state"]["host"] > 0
        assert breakdown_device(mc) == {"weights": 0, "state": 0, "encoder": 0, "scratch": 0}
    for d in (a, b):
        v = d.ask("verify")
        assert v["weights_ok"], v["mismatched"]
        m = d.member()
        assert m.switches >= 50 and m.bytes_h2d >= 50 * weights[d.name]
    status = json.loads(subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--json", "--arena", str(arena)],
                                       capture_output=True, text=True, env=daemon_env()).stdout)
    assert status["holder_pid"] == b.proc.pid  # beta verified last
    assert {m["name"] for m in status["members"]} == {"alpha", "beta"}


def test_idle_sleep_releases_and_a_request_wakes(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--idle-sleep", "0.3")
    deadline = time.monotonic() + 10
    while a.member().state != "cold" and time.monotonic() < deadline:
        time.sleep(0.05)
    m = a.member()
    assert m.state == "cold" and breakdown_device(m)["weights"] == 0
    assert Token(arena / "token.lock").holders() == []
    # A request while cold wakes it (it rings and takes the free token).
    v = a.ask("verify")
    assert v["weights_ok"]
    assert a.member().state == "warm"


def test_wake_on_request_without_idle_sleep_after_a_peer_took_it(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")          # idle sleep off (-1)
    b = daemons(arena, models[1], "beta")           # its start made alpha yield (and park)
    assert a.member().state == "parked" and not a.ask("status")["holds_token"]
    assert a.ask("verify")["weights_ok"]            # a request wakes alpha anyway
    assert b.member().state == "parked"


def test_kv_stays_on_device_while_cold_unless_the_budget_needs_it(arena, tmp_path, models, daemons):
    # Exclusive residency (llama.cpp's rule), evict-state auto, no budget: room for both.
    a = daemons(arena, models[0], "alpha", "--residency", "exclusive")
    b = daemons(arena, models[1], "beta", "--residency", "exclusive")
    m = a.member()
    assert m.state == "parked"  # not holding the token, KV still on the device
    assert breakdown_device(m)["weights"] == 0
    assert breakdown_device(m)["state"] == m.breakdown["state"]["host"] > 0  # KV kept on the device
    kv = a.ask("verify")["kv_sha256"]   # wakes alpha again: nothing lost
    assert a.ask("verify")["kv_sha256"] == kv
    b.stop()
    a.stop()


def test_vram_budget_smaller_than_both_forces_real_switches(arena, models, daemons):
    plan = planned(models[0])   # what a daemon of it holds in host memory (both are the same shape)
    one, kv = plan.host["weights"] + plan.host["state"], plan.host["state"]
    # One model fits with room to spare, but not one model plus the other's KV cache.
    budget = str(one + kv // 2)
    a = daemons(arena, models[0], "alpha", "--vram-budget", budget, "--residency", "exclusive")
    b = daemons(arena, models[1], "beta", "--vram-budget", budget, "--residency", "exclusive")
    for _ in range(5):
        for warm, cold in ((a, b), (b, a)):
            warm.ask("wake")
            mw, mc = warm.member(), cold.member()
            assert sum(breakdown_device(mc).values()) == 0, "the cold daemon kept its KV over budget"
            assert sum(breakdown_device(mw).values()) + sum(breakdown_device(mc).values()) <= int(budget)
    assert a.member().bytes_d2h > 0 and b.member().bytes_d2h > 0  # KV really went to the host and back
    assert a.ask("verify")["weights_ok"] and b.ask("verify")["weights_ok"]


def test_sigkill_of_a_warm_daemon_lets_the_other_warm_within_1s(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    b = daemons(arena, models[1], "beta")
    a.ask("wake")
    killed = time.monotonic()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    b.ask("wake", timeout=5)
    assert time.monotonic() - killed < 1.0
    assert Token(arena / "token.lock").holders() == [b.proc.pid]
    # The dead daemon's leftovers block nothing: it restarts under the same name.
    a2 = daemons(arena, models[0], "alpha")
    assert a2.ask("verify")["weights_ok"]


def test_restore_that_does_not_fit_is_a_clear_error(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--vram-budget", "1000", wait_ready=False)
    assert a.proc.wait(60) == 6, a.output
    assert "vramd: " in a.output and "Traceback" not in a.output
    assert os.listdir(arena / "members") == [] and [n for n in os.listdir(arena / "control") if n.endswith(".sock")] == []
    assert Token(arena / "token.lock").holders() == []


def test_sigterm_releases_and_cleans_up(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    assert a.stop() == 0
    assert Token(arena / "token.lock").holders() == []
    assert os.listdir(arena / "members") == []
    assert [n for n in os.listdir(arena / "control") if n.endswith(".sock")] == []


def test_shutdown_request_fails_queued_work_cleanly(arena, models, daemons):
    from .test_shutdown import hold_token_elsewhere, in_thread, post, wait_queued
    a = daemons(arena, models[0], "alpha", "--wake-timeout", "30")
    a.ask("yield")
    blocker = hold_token_elsewhere(arena)   # the queued work waits for the GPU
    try:
        url = a.member().endpoint + "/v1/completions"
        waits = [in_thread(post, url, {"prompt": [1, 2], "max_tokens": 2}) for _ in range(2)]
        wait_queued(a, 2)
        t0 = time.monotonic()
        assert a.ask("shutdown")["state"] == "stopping"
        assert a.proc.wait(30) == 0
        for w in waits:
            w["thread"].join(10)
            assert w["result"][0] == 503 and w["at"] - t0 < 2.0, w
    finally:
        blocker.kill()
        blocker.wait()
    with pytest.raises(VramdError, match="no daemon answers"):
        request(a.socket, "status", wait=2)


def test_control_socket_refuses_a_foreign_uid(arena, models, daemons):
    if os.getuid() != 0:
        pytest.fail("this test switches to uid nobody: run the suite as root (CI does)")
    a = daemons(arena, models[0], "alpha")
    # Open the path up so the kernel lets `nobody` connect: the daemon's own
    # SO_PEERCRED check must still refuse it.
    os.chmod(arena, 0o755)
    os.chmod(arena / "control", 0o755)
    os.chmod(a.socket, 0o666)
    for parent in arena.parents:
        if str(parent).startswith("/tmp/pytest-of"):
            os.chmod(parent, os.stat(parent).st_mode | 0o005)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(a.socket))
            try:
                s.sendall(b'{"cmd": "shutdown"}\n')
            except BrokenPipeError:
                pass  # the daemon may refuse (and close) before reading
            os.write(w, s.recv(4096))
        except BaseException as e:
            os.write(w, f"child error: {e!r}".encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    reply = os.read(r, 4096).decode()
    assert "permission denied" in reply, reply
    assert a.proc.poll() is None  # still serving
    assert a.ask("status")["state"] == "warm"


def test_status_asks_each_daemon_over_its_control_socket(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--evict-state", "always")

    def status():
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--json", "--arena", str(arena)],
                           capture_output=True, text=True, env=daemon_env(), timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["members"][0]

    row = status()
    assert row["daemon"]["endpoint"] == a.member().endpoint
    assert row["daemon"]["evict_state"] == "always"    # configuration only the daemon knows
    assert row["state"] == "warm" and row["device_total"] > 0
    a.proc.send_signal(signal.SIGSTOP)                 # alive, but it cannot answer
    try:
        t0 = time.monotonic()
        row = status()
        assert row["daemon"] is None and row["state"] == "warm"   # its published record, marked
        assert time.monotonic() - t0 < 30
    finally:
        a.proc.send_signal(signal.SIGCONT)

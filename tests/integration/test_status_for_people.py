"""Issue 21, item 4: `vramd status` as a person reads it (real daemons, the real CLI).

Each member's endpoint and model, the legend only when someone holds the
token, header totals that are the sum of the rows, `stopping` for a daemon
that drains its replies, and the system arena found when the units run
there and the per-user arena is empty.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from click.testing import CliRunner

from vramd.cli import cli

from .conftest import ROOT, daemon_env


def status(*args, **env):
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "status", *args], capture_output=True, text=True,
                       env=daemon_env(**env), cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_rows_name_endpoint_and_model_and_the_header_adds_them_up(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--vram-budget", "1GiB")
    b = daemons(arena, models[1], "beta", "--vram-budget", "1GiB")
    b.ask("wake")
    text = status("--arena", str(arena))
    for d, model in ((a, models[0]), (b, models[1])):
        row = next(line for line in text.splitlines() if d.name in line.split()[:2] and "." in line)
        assert d.member().endpoint.removeprefix("http://") in row and model.name in row, text
    assert "(* holds the token)" in text
    report = json.loads(status("--arena", str(arena), "--json"))
    assert report["device_bytes_used"] == sum(m["device_total"] for m in report["members"])
    assert report["free_bytes"] == report["budget_bytes"] - report["device_bytes_used"]
    from vramd.cli import human_bytes
    assert f"vram    {human_bytes(report['device_bytes_used'])} used" in text
    a.ask("yield")
    b.ask("yield")
    text = status("--arena", str(arena))
    assert "holder  none" in text and "holds the token" not in text, text


def test_a_daemon_draining_its_replies_is_stopping(arena, tmp_path, daemons):
    from tests.ggufgen.llama import write_llama
    model = write_llama(tmp_path / "chat.gguf", seed=7, n_vocab=384, vocab="spm")   # greedy: no EOS for long
    a = daemons(arena, model, "alpha", "--context-overflow", "shift", "--request-timeout", "30")
    host, port = a.member().endpoint.removeprefix("http://").split(":")
    # A streamed reply nobody reads (a tiny receive window): the daemon's write blocks, and
    # shutting down waits for it (REPLY_GRACE) with the control socket still answering.
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect((host, int(port)))
    body = json.dumps({"prompt": [1, 5, 6], "max_tokens": 1 << 20, "stream": True, "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        deadline = time.monotonic() + 30
        while (st := a.ask("status"))["engine"]["generated_tokens"] < 100:
            assert time.monotonic() < deadline and st["inflight"] <= 1, st
            time.sleep(0.05)
        assert st["inflight"] == 1, st
        a.proc.send_signal(signal.SIGTERM)
        seen = set()
        while a.proc.poll() is None and "stopping" not in seen:
            r = CliRunner().invoke(cli, ["status", "--arena", str(arena), "--json"])
            if r.exit_code == 0:
                seen |= {m["state"] for m in json.loads(r.output)["members"]}
        assert "stopping" in seen, (seen, a.output)
        r = CliRunner().invoke(cli, ["status", "--arena", str(arena)])
        assert r.exit_code != 0 or "stopping" in r.output or "members none" in r.output
    finally:
        s.close()
    assert a.reap() == 0


def test_the_system_arena_is_found_when_the_per_user_one_is_empty(tmp_path, models, daemons):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    system = tmp_path / "system-arena"
    env = {"XDG_RUNTIME_DIR": str(runtime), "VRAMD_SYSTEM_ARENA": str(system)}
    os.environ.pop("VRAMD_ARENA", None)
    # A per-user arena that something once made, and is empty now.
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "exec", "--arena", str(runtime / "vramd" / "default"),
                        "--", "true"], capture_output=True, text=True, env=daemon_env(**env), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    # The units' arena, with a daemon in it (the unit's --arena, here not /run/vramd).
    a = daemons(system, models[0], "chat", env=daemon_env(**env))
    text = status(**env)
    assert f"arena   {system}" in text and " chat " in text, text
    assert f"(also {runtime / 'vramd' / 'default'}: empty)" in text, text
    # ... and so do the commands that take an arena by default.
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "yield", "chat", "--wait"], capture_output=True,
                       text=True, env=daemon_env(**env), cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "chat yielded" in r.stdout, r.stderr
    assert a.member().state != "warm"

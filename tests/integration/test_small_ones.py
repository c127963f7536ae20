"""The smaller failures of issue 19, item 9: request shapes, junk rings, a forged record, a stopped holder.

Real daemons, real files.  (A daemon that is shutting down answers 503 with
/health saying so: tests/integration/test_shutdown.py; the 503 quotes the
time waited: tests/integration/test_waits.py; `vramd status` marks a stopped
member: tests/integration/test_split_brain.py.)
"""

import os
import subprocess
import time

from vramd.arena.members import Member, Registry, process_start_time

from .test_bad_requests import raw_post


def test_wrong_json_types_are_400s_not_500s_nor_truthy(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    url = a.member().endpoint + "/v1/completions"
    for raw, says in [('{"prompt": [1], "model": ["x"]}', "'model' must be a string"),
                      ('{"prompt": [1], "model": {}}', "'model' must be a string"),
                      ('{"prompt": [1], "stream": "false"}', "'stream' must be true or false"),
                      ('{"prompt": [1], "stream": 1}', "'stream' must be true or false"),
                      ('{"prompt": [1], "echo": "yes"}', "'echo' must be true or false"),
                      ('{"prompt": [1], "stream": true, "stream_options": {"include_usage": "no"}}',
                       "'include_usage' must be true or false"),
                      ('{"prompt": [1], "stream_options": []}', "'stream_options' must be an object")]:
        status, body = raw_post(url, raw.encode())
        assert status == 400 and says in body["error"]["message"], (raw, body)
    status, body = raw_post(url, b'{"prompt": [1], "max_tokens": 1, "stream": false, "echo": false}')
    assert status == 200, body
    assert "Traceback" not in a.output


def test_junk_names_in_the_doorbell_are_cleaned_by_the_next_scan(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    b = daemons(arena, models[1], "beta")
    doorbell = arena / "doorbell"
    for i in range(3000):   # what a ring-group user can plant: names that are no pid
        (doorbell / f"junk-{i}").touch()
    os.symlink("/etc/passwd", doorbell / "link")
    os.mkdir(doorbell / "adir")
    for _ in range(2):
        assert a.ask("wake")["state"] == "warm" and b.ask("wake")["state"] == "warm"
    left = sorted(os.listdir(doorbell))
    assert left == ["adir"], left[:5]            # the directory is not ours to remove
    assert os.path.exists("/etc/passwd")


def test_a_forged_record_naming_a_daemons_own_socket_does_not_deadlock_it(arena, models, daemons, tmp_path):
    a = daemons(arena, models[0], "alpha")
    one = a.member().wants_bytes
    assert a.stop() == 0
    a = daemons(arena, models[0], "alpha", "--vram-budget", str(one + one // 2), "--wake-timeout", "20")
    b = daemons(arena, models[1], "beta", "--vram-budget", str(one + one // 2))   # a parks... or is evicted
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        # A record under a live pid, parked with most of the budget, whose control socket is a's own.
        breakdown = {k: {"device": 0, "host": 0} for k in ("weights", "state", "scratch", "encoder")}
        breakdown["weights"]["device"] = one
        Registry(arena / "members").write(Member(
            name="forged", pid=sleeper.pid, start_time=process_start_time(sleeper.pid), state="parked",
            breakdown=breakdown, control=str(a.socket), last_used=1.0))
        t0 = time.monotonic()
        status, body = raw_post(a.member().endpoint + "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 1}')
        took = time.monotonic() - t0
        assert took < 10.0, (took, body)              # before: frozen 120 s asking itself
        assert status in (200, 503), body
        assert "forged" in a.output, a.output[-2000:]
        assert a.ask("status", timeout=5)["name"] == "alpha"   # its control plane answers
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_non_streamed_request_whose_client_hung_up_stops_generating(arena, models, daemons):
    """Issue 19, item 7: before, an abandoned non-streamed request generated on (6 -> 612 tokens in 10 s)."""
    import json
    import socket
    a = daemons(arena, models[0], "alpha", "--ctx", "4096")
    host, port = a.member().endpoint.rsplit("/", 1)[1].split(":")
    gen = lambda: a.ask("status")["engine"]["generated_tokens"]
    before = gen()
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 60
    while gen() == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.close()                                    # the client hangs up mid-generation
    time.sleep(1.0)
    stopped_at = gen()
    time.sleep(1.0)
    assert gen() == stopped_at, (before, stopped_at, gen())   # nothing more is generated for nobody
    assert stopped_at - before < 4000
    assert "went away" in a.output


def test_exec_killed_by_sigkill_takes_its_child_with_it(arena, tmp_path):
    """Issue 19, item 7: the child of a SIGKILLed `vramd exec` gets SIGKILL too (PR_SET_PDEATHSIG)."""
    import signal
    import sys
    from .conftest import ROOT, daemon_env
    from .test_shutdown import hold_token_elsewhere   # noqa: F401 (same arena helpers)
    pidfile = tmp_path / "child.pid"
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "exec", "--", "sh", "-c", f"echo $$ > {pidfile}; "
                          "exec sleep 60"], env=daemon_env(VRAMD_ARENA=str(arena)), cwd=ROOT)
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    child = int(pidfile.read_text())
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 2
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break                              # dead (a zombie until init reaps it)
        time.sleep(0.02)
    alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the command kept running after its vramd exec was killed"


def test_serve_under_a_small_address_space_limit_is_one_line(tmp_path, models):
    """Issue 19, item 9: under `ulimit -v` the daemon crashed in vkCreateDevice (a segfault) or
    printed a traceback (can't start new thread); now one line and exit 5 before the device."""
    import resource
    import sys
    from .conftest import ROOT, daemon_env

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (600 << 20, resource.RLIM_INFINITY))
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "serve", str(models[0]), "--arena", str(tmp_path / "a"),
                        "--port", "0", "--ctx", "64"], capture_output=True, text=True, env=daemon_env(), cwd=ROOT,
                       timeout=60, preexec_fn=limit)
    assert r.returncode == 5, (r.returncode, r.stderr[-2000:])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ulimit -v" in lines[0] and "600 MiB" in lines[0], r.stderr

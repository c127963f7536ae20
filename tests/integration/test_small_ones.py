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

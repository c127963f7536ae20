"""A replaced token and a wiped arena (issue 19, items 1 and 2): never two computing holders.

Real daemons, real files: `mv token.lock token.old; touch token.lock` while
a daemon streams a long generation, and `rm -rf` of the whole arena while
two daemons run.  The promise (docs/reliability.md, "A replaced or unlinked
token"): the daemon that holds the orphaned inode stops computing within a
few hundred ms (its generation ends, a 503-class finish), releases, and
exits 4; `/proc/locks` never shows two members computing for long; a
daemon whose arena is gone exits 4 for systemd to restart it in the new one.
"""

import json
import os
import shutil
import signal
import threading
import time
import urllib.request

from vramd.arena import proclocks

from .test_shutdown import in_thread, stream_lines


def token_flocks(pids):
    """(pid, inode) of every WRITE flock the given processes hold, from /proc/locks."""
    out = []
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
                continue
            pid = int(parts[4])
            if pid in pids:
                out.append((pid, parts[5]))
    return out


def test_a_replaced_token_stops_its_holder_at_the_next_step_and_exits_4(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--ctx", "4096")
    b = daemons(arena, models[1], "beta", "--wake-timeout", "30")
    a.ask("wake")
    url = a.member().endpoint + "/v1/completions"
    lines, ready = [], threading.Event()
    streamed = in_thread(stream_lines, url, {"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0,
                                             "stream": True}, lines, ready)
    assert ready.wait(60), a.output
    os.rename(arena / "token.lock", arena / "token.old")       # the hostile (or careless) operator
    (arena / "token.lock").touch(mode=0o660)
    t0 = time.monotonic()
    served = in_thread(lambda: urllib.request.urlopen(urllib.request.Request(
        b.member().endpoint + "/v1/completions", b'{"prompt": [4, 5], "max_tokens": 4}',
        {"Content-Type": "application/json"}), timeout=60))
    both = 0
    while a.proc.poll() is None and time.monotonic() - t0 < 10:
        held = token_flocks({a.proc.pid, b.proc.pid})
        both += len({pid for pid, _ino in held}) > 1
        time.sleep(0.005)
    assert a.proc.wait(10) == 4, a.output
    assert time.monotonic() - t0 < 3.0
    assert "replaced or unlinked" in a.output and "Traceback" not in a.output
    streamed["thread"].join(10)
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert len(events) < 3000 and events[-1]["error"]["type"] == "service_unavailable", events[-2:]
    served["thread"].join(60)
    assert "result" in served and served["result"].status == 200, (served, b.output)          # the peer computes on the arena's token
    assert both * 0.005 < 1.0, both                 # two holders at once for well under a second
    assert token_flocks({a.proc.pid}) == []


def test_a_wiped_arena_makes_its_daemons_exit_4_and_a_new_arena_works(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    b = daemons(arena, models[1], "beta")
    a.ask("wake")
    t0 = time.monotonic()
    shutil.rmtree(arena)                            # $XDG_RUNTIME_DIR wiped at logout
    assert a.proc.wait(10) == 4, a.output
    assert b.proc.wait(10) == 4, b.output
    assert time.monotonic() - t0 < 5.0
    assert "was removed" in a.output and "Traceback" not in a.output + b.output
    # What systemd does next (Restart=on-failure): both start afresh in a new arena and take turns.
    a2 = daemons(arena, models[0], "alpha")
    b2 = daemons(arena, models[1], "beta")
    assert b2.ask("wake", timeout=10)["state"] == "warm"
    assert a2.ask("wake", timeout=10)["state"] == "warm"
    assert proclocks.flock_holders(proclocks.file_key(os.stat(arena / "token.lock"))) == [a2.proc.pid]
    for d in (a2, b2):
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0


def test_status_flags_two_members_that_claim_the_gpu_and_a_stopped_holder(arena, models, daemons):
    import subprocess
    import sys
    from .conftest import ROOT, daemon_env
    a = daemons(arena, models[0], "alpha")
    b = daemons(arena, models[1], "beta")
    a.ask("wake")
    a.proc.send_signal(signal.SIGSTOP)              # a stopped holder cannot see the replacement
    try:
        os.rename(arena / "token.lock", arena / "token.old")
        (arena / "token.lock").touch(mode=0o660)
        assert b.ask("wake", timeout=10)["state"] == "warm"   # takes the new inode beside it

        def status(*flags):
            r = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena), *flags],
                               capture_output=True, text=True, env=daemon_env(), timeout=60, cwd=ROOT)
            assert r.returncode == 0, r.stderr
            return r.stdout
        report = json.loads(status("--json"))
        assert report["split_brain"] and sorted(report["claims_gpu"]) == ["alpha", "beta"]
        assert {m["name"]: m["stopped"] for m in report["members"]} == {"alpha": True, "beta": False}
        text = status()
        assert "SPLIT" in text and "(stopped)" in text
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert a.proc.wait(10) == 4, a.output            # running again: it sees the replacement and leaves

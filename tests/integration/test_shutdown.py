"""Stopping a daemon (issue 19, item 5): SIGTERM with work queued and a generation in flight.

Real daemons, real signals.  The promise (docs/reliability.md, "Shutdown"):
new requests get 503 and /health 503 "stopping" at once, every queued
request fails at once (503), the generation in flight ends at its next step
with a finish the client can see, the daemon exits 0 well inside systemd's
TimeoutStopSec=30, and a second signal exits at once.
"""

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from vramd.arena.token import Token

from .conftest import ROOT, daemon_env


def post(url: str, body: dict, timeout: float = 120):
    """(status, parsed JSON body or the raw stream lines) of one POST."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def in_thread(fn, *args):
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            out["result"] = fn(*args)
        except Exception as e:  # noqa: BLE001 - recorded, asserted on
            out["error"] = e
        out["at"] = time.monotonic()
        out["took"] = out["at"] - t0
    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def hold_token_elsewhere(arena):
    """`vramd exec` holding the token for a minute: the daemon's requests must wait for it."""
    p = subprocess.Popen([sys.executable, "-m", "vramd.cli", "exec", "--", "sleep", "60"],
                         env=daemon_env(VRAMD_ARENA=str(arena)), cwd=ROOT)
    deadline = time.monotonic() + 20
    while Token(arena / "token.lock").holders() != [p.pid]:
        assert time.monotonic() < deadline, "the blocker never got the token"
        time.sleep(0.02)
    return p


@contextlib.contextmanager
def held_elsewhere(d, arena):
    """Daemon `d` cold and the token held by `vramd exec` for the block: its requests wait."""
    d.ask("yield")
    blocker = hold_token_elsewhere(arena)
    try:
        yield blocker
    finally:
        if blocker.poll() is None:
            blocker.kill()
        blocker.wait()


def wait_queued(d, n, timeout=10):
    """Until n requests are in the daemon's hands (its HTTP threads submitted them)."""
    deadline = time.monotonic() + timeout
    if "inflight" not in d.ask("status"):   # a daemon before issue 19: give the requests a second
        time.sleep(1.0)
        return
    while d.ask("status")["inflight"] < n:
        assert time.monotonic() < deadline, d.output
        time.sleep(0.02)


def test_sigterm_fails_every_queued_request_at_once_and_exits(arena, models, daemons):
    d = daemons(arena, models[0], "alpha", "--wake-timeout", "30")
    with held_elsewhere(d, arena):
        url = d.member().endpoint + "/v1/completions"
        waits = [in_thread(post, url, {"prompt": [1, 2, 3], "max_tokens": 4}) for _ in range(3)]
        wait_queued(d, 3)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        for w in waits:
            w["thread"].join(10)
        assert d.proc.wait(10) == 0, d.output
        exited = time.monotonic() - t0
        for w in waits:
            status, body = w["result"]
            assert status == 503 and body["error"]["type"] == "service_unavailable", body
            assert w["at"] - t0 < 2.0, w["at"] - t0   # at once, not one wake-timeout each
        assert exited < 5.0, d.output
        assert "Traceback" not in d.output


def stream_lines(url, body, lines, ready):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            if raw.strip():
                lines.append(raw.decode().strip())
                ready.set()
    return r.status


def test_sigterm_ends_the_generation_in_flight_cleanly_and_fails_the_queued(arena, models, daemons):
    d = daemons(arena, models[0], "alpha", "--ctx", "4096", "--wake-timeout", "30")
    url = d.member().endpoint + "/v1/completions"
    lines, ready = [], threading.Event()
    streamed = in_thread(stream_lines, url, {"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0,
                                             "stream": True}, lines, ready)
    assert ready.wait(60), d.output
    queued = in_thread(post, url, {"prompt": [4, 5, 6], "max_tokens": 4})
    wait_queued(d, 2)
    health = []

    def poll_health():
        while d.proc.poll() is None:
            try:
                with urllib.request.urlopen(d.member().endpoint + "/health", timeout=2) as r:
                    health.append((time.monotonic() - t0, r.status, json.loads(r.read())["status"]))
            except urllib.error.HTTPError as e:
                health.append((time.monotonic() - t0, e.code, json.loads(e.read())["status"]))
            except Exception:
                return   # the daemon is gone (or its record is)
    poller = threading.Thread(target=poll_health, daemon=True)
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    poller.start()
    streamed["thread"].join(20)
    queued["thread"].join(20)
    assert d.proc.wait(20) == 0, d.output
    assert time.monotonic() - t0 < 10.0
    # The stream: cut short (far fewer than 4000 tokens), with a finish, the reason, and its end.
    assert "error" not in streamed, streamed
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert events[-1]["error"]["type"] == "service_unavailable" and "shutting down" in events[-1]["error"]["message"]
    assert len(events) < 3000
    status, body = queued["result"]
    assert status == 503 and body["error"]["type"] == "service_unavailable", body
    assert queued["at"] - t0 < 2.0
    # The signal is handled by the main thread a moment after it is sent: /health may say
    # "ok" until then, but never again once it has said "stopping", and not for long.
    said = [(status, what) for _t, status, what in health]
    first = said.index((503, "stopping")) if (503, "stopping") in said else len(said)
    assert all(h == (503, "stopping") for h in said[first:]), health     # never "ok" once stopping
    assert all(t < 0.5 for t, _s, _w in health[:first]), health           # and "ok" only at first
    assert "Traceback" not in d.output and "stuck" not in d.output


def test_a_non_streamed_request_in_flight_gets_503_and_a_second_signal_exits_at_once(arena, models, daemons):
    d = daemons(arena, models[0], "alpha", "--ctx", "4096")
    url = d.member().endpoint + "/v1/completions"
    before = d.ask("status")["engine"]["generated_tokens"]
    flight = in_thread(post, url, {"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0})
    deadline = time.monotonic() + 60
    while d.ask("status")["engine"]["generated_tokens"] == before:
        assert time.monotonic() < deadline, d.output
        time.sleep(0.01)
    d.proc.send_signal(signal.SIGTERM)
    flight["thread"].join(20)
    assert d.proc.wait(20) == 0, d.output
    status, body = flight["result"]
    assert status == 503 and body["error"]["type"] == "service_unavailable", body
    assert "shutting down" in body["error"]["message"]

    # Two signals back to back: whichever Python runs second finds the daemon stopping
    # (its shutdown takes far longer than two kill(2)s) and exits at once with 128 + its number.
    d2 = daemons(arena, models[1], "beta")
    d2.proc.send_signal(signal.SIGTERM)
    d2.proc.send_signal(signal.SIGINT)
    assert d2.proc.wait(10) in (128 + signal.SIGINT, 128 + signal.SIGTERM), d2.output
    assert "while stopping: exiting now" in d2.output
    assert "Traceback" not in d2.output

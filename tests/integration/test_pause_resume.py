"""A generation that survives a switch, the queue bound, a disconnect (issue 16), real daemons.

Daemon A streams a long generation while daemon B (same arena) is woken again and again:
A pauses between two of its steps (cold, its K/V kept: on the device, or copied to the host
and back under `--residency exclusive --evict-state always`), B gets the GPU within one of A's
steps instead of after A's whole generation, and A resumes where it stopped: the text equals
its unswitched text, greedy and seeded.  While A waits for B, its status shows the paused slot.
"""

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from tests.ggufgen.check import write_model

from .conftest import ROOT, SHAPE, daemon_env
from .test_shutdown import hold_token_elsewhere, in_thread, post, wait_queued

CTX = 512
N = 400   # tokens: long enough on lavapipe for several wakes of B inside it


def stream(url: str, body: dict, seen: list | None = None) -> tuple[str, list[str]]:
    """A streamed completion: its text and every SSE line (comments included)."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    text, lines = [], seen if seen is not None else []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            lines.append(line)
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    assert "data: [DONE]" in lines, lines[-5:]
    return "".join(text), lines


def status(d) -> dict:
    return d.ask("status")["slots"]


@pytest.mark.parametrize("flags", [(), ("--residency", "exclusive", "--evict-state", "always")],
                         ids=["cache", "exclusive-always"])
def test_a_generation_pauses_for_a_peer_and_resumes_to_the_same_text(arena, tmp_path, daemons, flags):
    a_model = write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE)
    b_model = write_model(tmp_path / "beta.gguf", seed=2, shape=SHAPE)
    a = daemons(arena, a_model, "alpha", *flags, ctx=CTX)
    b = daemons(arena, b_model, "beta", *flags)
    url = a.member().endpoint + "/v1/completions"
    bodies = [{"prompt": [1, 2, 3], "max_tokens": N, "temperature": 0},
              {"prompt": [1, 2, 3], "max_tokens": N, "temperature": 1.0, "seed": 7}]
    for body in bodies:
        a.ask("wake")
        t0 = time.monotonic()
        alone, _ = stream(url, body)
        whole = time.monotonic() - t0
        assert len(alone) > 0
        pauses = status(a)["pauses_total"]
        out = in_thread(stream, url, body)
        waits = []
        while "at" not in out:
            r = b.ask("wake")   # B's hand-over: within one of A's steps, not A's whole generation
            if r["was_cold"]:
                waits.append(r["wait_ms"] / 1000)
            time.sleep(0.05)
        assert "error" not in out, out.get("error")
        assert out["result"][0] == alone, "the paused and resumed generation gave another text"
        assert status(a)["pauses_total"] - pauses >= 2 and len(waits) >= 2, (waits, a.output)
        assert max(waits) < whole, (waits, whole)   # no wake waited for A's whole generation
    assert a.ask("verify")["weights_ok"]


def test_a_paused_generation_shows_in_status_and_streams_keep_alives(arena, tmp_path, daemons):
    a_model = write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE)
    b_model = write_model(tmp_path / "beta.gguf", seed=2, shape=SHAPE)
    a = daemons(arena, a_model, "alpha", ctx=CTX)
    # B holds the GPU 2.5 s before it yields to A's ring: A's stream waits longer than a keep-alive's period.
    b = daemons(arena, b_model, "beta", "--quantum", "2.5", "--max-hold", "5")
    url = a.member().endpoint + "/v1/completions"
    body = {"prompt": [1, 2, 3], "max_tokens": N, "temperature": 0}
    a.ask("wake")
    alone, _ = stream(url, body)
    lines: list[str] = []
    out = in_thread(stream, url, body, lines)
    while not any(x.startswith("data: {") for x in lines):
        time.sleep(0.01)
    woke = in_thread(b.ask, "wake")
    deadline = time.monotonic() + 10
    while (st := status(a))["paused"] == 0:
        assert time.monotonic() < deadline and "at" not in out, a.output
        time.sleep(0.02)
    row = st["slots"][0]
    assert row["state"] == "paused" and row["request"] == "completion" and row["pauses"] == 1 and st["busy"] == 1
    metrics = urllib.request.urlopen(a.member().endpoint + "/metrics", timeout=10).read().decode()
    assert 'vramd_paused_requests{name="alpha"} 1' in metrics
    people = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena)],
                            capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=60).stdout
    assert "slots   alpha: slot 0 paused for" in people, people
    woke["thread"].join(30)
    out["thread"].join(60)
    assert out["result"][0] == alone
    comments = [x for x in lines if x.startswith(":")]
    assert comments, "no keep-alive while the stream was paused"
    st = status(a)
    assert st["paused"] == 0 and st["busy"] == 0 and st["slots"][0]["state"] == "idle"
    metrics = urllib.request.urlopen(a.member().endpoint + "/metrics", timeout=10).read().decode()
    assert 'vramd_paused_requests{name="alpha"} 0' in metrics
    assert 'vramd_generation_pauses_total{name="alpha"} 1' in metrics


def test_the_queue_bound_is_a_503_with_retry_after(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--max-queue", "1", "--wake-timeout", "30")
    a.ask("yield")
    blocker = hold_token_elsewhere(arena)   # requests wait for the GPU: the first in the loop, one queued
    try:
        url = a.member().endpoint + "/v1/completions"
        waits = [in_thread(post, url, {"prompt": [1, 2], "max_tokens": 2})]
        wait_queued(a, 1)   # (the loop takes it and waits for the GPU: it is not queued)
        deadline = time.monotonic() + 10
        while a.ask("status")["slots"]["queued"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        waits.append(in_thread(post, url, {"prompt": [1, 2], "max_tokens": 2}))
        while a.ask("status")["slots"]["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        req = urllib.request.Request(url, json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
        assert "--max-queue 1" in json.loads(e.value.read())["error"]["message"]
    finally:
        blocker.kill()
        blocker.wait()
    for w in waits:
        w["thread"].join(30)
        assert w["result"][0] == 200, w
    metrics = urllib.request.urlopen(a.member().endpoint + "/metrics", timeout=10).read().decode()
    assert 'vramd_queue_full_total{name="alpha"} 1' in metrics


def test_a_client_that_hangs_up_mid_stream_frees_the_slot_at_the_next_step(arena, tmp_path, daemons):
    a_model = write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE)
    a = daemons(arena, a_model, "alpha", ctx=CTX)
    u = urllib.parse.urlsplit(a.member().endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": N, "stream": True,
                                                        "temperature": 0}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    while not r.readline().startswith(b"data: {"):
        pass
    conn.sock.close()   # hang up after the first piece
    conn.close()
    deadline = time.monotonic() + 10
    while status(a)["busy"]:
        assert time.monotonic() < deadline, a.output
        time.sleep(0.02)
    made = a.ask("status")["engine"]["generated_tokens"]
    assert made < N, made   # stopped, not generated to the end
    time.sleep(0.3)
    assert a.ask("status")["engine"]["generated_tokens"] == made
    assert post(a.member().endpoint + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("n", ["0", "17"])
def test_parallel_outside_what_the_engine_holds_is_refused_by_name(arena, models, n):
    out = subprocess.run([sys.executable, "-m", "vramd.cli", "serve", str(models[0]), "--arena", str(arena),
                          "--parallel", n], capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"parallel {n}: between 1 and 16 slots" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_qwen35_generation_resumes_with_its_recurrent_state_after_going_to_the_host(arena, tmp_path, daemons):
    """The hybrid model's slot is K/V and a DeltaNet state: both go to the host and back mid-generation."""
    from tests.engine.conformance.cases import write_case
    flags = ("--residency", "exclusive", "--evict-state", "always")
    q = daemons(arena, write_case("qwen35", "Q4_K", tmp_path / "qwen35.gguf"), "qwen", *flags, ctx=256)
    b = daemons(arena, write_model(tmp_path / "beta.gguf", seed=2, shape=SHAPE), "beta", *flags)
    url = q.member().endpoint + "/v1/completions"
    body = {"prompt": [1, 2, 3], "max_tokens": 120, "temperature": 0}
    q.ask("wake")
    alone, _ = stream(url, body)
    assert alone
    out = in_thread(stream, url, body)
    while "at" not in out:
        b.ask("wake")
        time.sleep(0.05)
    assert "error" not in out, out.get("error")
    assert out["result"][0] == alone
    assert status(q)["pauses_total"] >= 1, q.output


def test_a_client_that_hangs_up_while_paused_ends_the_generation(arena, tmp_path, daemons):
    a = daemons(arena, write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE), "alpha", ctx=CTX)
    b = daemons(arena, write_model(tmp_path / "beta.gguf", seed=2, shape=SHAPE), "beta", "--quantum", "8",
                "--max-hold", "8")   # B keeps the GPU long after A rings: A stays paused
    u = urllib.parse.urlsplit(a.member().endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": N, "stream": True,
                                                        "temperature": 0}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    while not r.readline().startswith(b"data: {"):
        pass
    woke = in_thread(b.ask, "wake")
    deadline = time.monotonic() + 10
    while status(a)["paused"] == 0:
        assert time.monotonic() < deadline, a.output
        time.sleep(0.02)
    made = a.ask("status")["engine"]["generated_tokens"]
    conn.sock.close()   # hang up while paused: found at the stream's next keep-alive (2 s)
    conn.close()
    deadline = time.monotonic() + 10
    while status(a)["busy"]:
        assert time.monotonic() < deadline, a.output
        time.sleep(0.05)
    st = a.ask("status")
    assert st["engine"]["generated_tokens"] == made and not st["holds_token"]   # ended cold: not resumed
    woke["thread"].join(30)

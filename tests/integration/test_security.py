"""The HTTP API's defences, against real daemons: loopback by default, the API key, request limits.

Driven by the official `openai` client where a client would be, and by raw
sockets where a hostile one would be (no Content-Length, chunked bodies,
huge heads, a client that trickles its request a byte at a time).
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from tests.ggufgen.llama import write_llama

from .conftest import ROOT, daemon_env

KEY = "vk-test-0123456789abcdef"


@pytest.fixture
def llama(tmp_path):
    return write_llama(tmp_path / "a.gguf", seed=21, n_vocab=384, vocab="spm")


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "api.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (KEY + "\n").encode())
    os.close(fd)
    return path


def endpoint(d) -> str:
    return d.member().endpoint


def client(d, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint(d) + "/v1", api_key=key, max_retries=0, timeout=120)


def get(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def raw(d, data: bytes, wait: float = 30.0) -> bytes:
    """Send `data` on a fresh connection; everything the daemon answers until it closes."""
    host, port = endpoint(d).removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # refused before we finished: its answer is still there to read
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def error_of(reply: bytes) -> dict:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]


def test_http_listens_on_loopback_and_every_route_but_health_needs_the_key(arena, llama, key_file, daemons):
    d = daemons(arena, llama, "a", "--api-key-file", str(key_file))
    # Bound to 127.0.0.1, and nowhere else.
    listening = [c.laddr for c in psutil.Process(d.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening
    assert endpoint(d).startswith("http://127.0.0.1:")
    # The key is not on the command line (ps shows that to everyone).
    assert KEY not in open(f"/proc/{d.proc.pid}/cmdline", "rb").read().decode(errors="replace")

    good = client(d, KEY)
    assert {m.id for m in good.models.list().data} == {"a"}   # listed once (issue 18); the file name is still taken
    r = good.completions.create(model="a", prompt="hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4

    with pytest.raises(openai.AuthenticationError) as e:
        client(d, "vk-wrong").completions.create(model="a", prompt="hello", max_tokens=4)
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "invalid_request_error"
    assert "vk-wrong" not in e.value.body["message"]  # a refused key is never echoed
    with pytest.raises(openai.AuthenticationError):
        client(d, "vk-wrong").models.list()

    # /health stays open (systemd, probes); the rest needs the key.
    assert get(endpoint(d) + "/health")[0] == 200
    for path in ("/v1/models", "/metrics", "/vramd/status", "/no/such/route"):
        code, body, headers = get(endpoint(d) + path)
        assert code == 401, path
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(endpoint(d) + "/metrics", KEY)[0] == 200
    assert get(endpoint(d) + "/vramd/status", KEY)[0] == 200
    reply = raw(d, b"GET /v1/models HTTP/1.1\r\nAuthorization: Basic " + KEY.encode() + b"\r\n\r\n")
    assert status_of(reply) == 401
    # Refused before its body is read: a client without the key cannot make the daemon read 1 GB.
    reply = raw(d, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n{")
    assert status_of(reply) == 401


def test_the_key_from_the_environment_or_the_config_file(arena, llama, daemons, tmp_path):
    d = daemons(arena, llama, "a", env=daemon_env(VRAMD_API_KEY=KEY))
    assert KEY not in open(f"/proc/{d.proc.pid}/cmdline", "rb").read().decode(errors="replace")
    assert {m.id for m in client(d, KEY).models.list().data} == {"a"}   # listed once (issue 18); the file name is still taken
    with pytest.raises(openai.AuthenticationError):
        client(d, "nope").models.list()
    d.stop()

    conf = tmp_path / "a.toml"
    conf.write_text(f'api_key = "{KEY}"\n')
    os.chmod(conf, 0o600)
    d = daemons(arena, llama, "a", "--config", str(conf))
    assert client(d, KEY).models.list().data
    assert get(endpoint(d) + "/v1/models")[0] == 401


def serve_refused(*args, env=None):
    """`vramd serve` that must refuse its configuration before loading anything."""
    return subprocess.run([sys.executable, "-m", "vramd.cli", "serve", *args], capture_output=True, text=True,
                          env=env or daemon_env(), cwd=ROOT, timeout=60)


def test_key_configuration_errors_are_one_line_exit_2(llama, key_file, tmp_path):
    os.chmod(key_file, 0o644)
    r = serve_refused(str(llama), "--api-key-file", str(key_file))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"vramd: {key_file}: the API key file is open to other users (mode 0644); chmod o-rwx it"
    os.chmod(key_file, 0o600)
    r = serve_refused(str(llama), "--api-key", KEY, "--api-key-file", str(key_file))
    assert r.returncode == 2 and r.stderr.strip() == "vramd: flags: give an API key or an API key file, not both"
    r = serve_refused(str(llama), "--api-key-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot open the API key file" in r.stderr
    r = serve_refused(str(llama), "--api-key", "has a space")
    assert r.returncode == 2 and "printable ASCII characters, no spaces" in r.stderr
    conf = tmp_path / "open.toml"
    conf.write_text(f'api_key = "{KEY}"\n')
    os.chmod(conf, 0o644)
    r = serve_refused("--config", str(conf), str(llama))
    assert r.returncode == 2 and "holds api_key but other users can read it" in r.stderr
    r = serve_refused(str(llama), "--max-request-bytes", "10")
    assert r.returncode == 2 and "max_request_bytes 10" in r.stderr
    assert KEY not in r.stderr


def test_request_limits_refuse_oversize_chunked_and_slow_requests(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--max-request-bytes", "4KiB", "--request-timeout", "1")
    c = openai.OpenAI(base_url=endpoint(d) + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert c.completions.create(model="a", prompt="hello", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="a", prompt="x " * 4096, max_tokens=2)
    assert e.value.status_code == 413 and "at most 4096" in e.value.body["message"]

    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    body = b'{"prompt": "hi", "max_tokens": 1}'
    assert status_of(raw(d, post + b"Content-Length: %d\r\n\r\n" % len(body) + body)) == 200
    reply = raw(d, post + b"\r\n" + body)
    assert status_of(reply) == 411 and error_of(reply)["message"] == "Content-Length required"
    reply = raw(d, post + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    assert status_of(reply) == 411 and "chunked" in error_of(reply)["message"]
    for bad in (b"-1", b"12abc", b"3, 4"):
        reply = raw(d, post + b"Content-Length: " + bad + b"\r\n\r\n" + body)
        assert status_of(reply) == 400 and "bad Content-Length" in error_of(reply)["message"], bad
    reply = raw(d, post + b"Content-Length: 5000\r\n\r\n" + body)  # over the limit: refused unread
    assert status_of(reply) == 413 and error_of(reply)["code"] == "request_too_large"
    reply = raw(d, b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 70000 + b"\r\n\r\n")
    assert status_of(reply) == 431
    reply = raw(d, b"GET /health HTTP/1.1\r\n" + b"X-Pad: 1\r\n" * 8000 + b"\r\n")  # many small lines
    assert status_of(reply) == 431
    deep = b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    reply = raw(d, post + b"Content-Length: %d\r\n\r\n" % len(deep) + deep)
    assert status_of(reply) == 400 and "nested too deeply" in error_of(reply)["message"]

    # A body that stops short is given up on after --request-timeout (408).
    t0 = time.monotonic()
    reply = raw(d, post + b"Content-Length: 100\r\n\r\n{")
    assert status_of(reply) == 408 and time.monotonic() - t0 < 10

    # Slowloris: clients trickling their heads a byte at a time are cut off at
    # the deadline, and a real client is served meanwhile.
    host, port = endpoint(d).removeprefix("http://").rsplit(":", 1)
    cut_after: list[float] = []

    def trickle():
        t = time.monotonic()
        with socket.create_connection((host, int(port))) as s:
            try:
                for _ in range(600):  # a minute, if nobody stopped it
                    s.sendall(b"G")
                    time.sleep(0.1)
            except OSError:
                pass
        cut_after.append(time.monotonic() - t)

    slow = [threading.Thread(target=trickle) for _ in range(8)]
    for t in slow:
        t.start()
    time.sleep(0.3)
    assert c.completions.create(model="a", prompt="hello", max_tokens=2).usage.completion_tokens == 2
    for t in slow:
        t.join(60)
    assert len(cut_after) == 8 and max(cut_after) < 10, cut_after
    assert get(endpoint(d) + "/health")[0] == 200

    # At most 64 connections at once: the next is told so (503) and closed.
    held = [socket.create_connection((host, int(port))) for _ in range(64)]
    try:
        reply = raw(d, b"GET /health HTTP/1.1\r\n\r\n")
        assert status_of(reply) == 503 and "more than 64 connections" in error_of(reply)["message"]
    finally:
        for s in held:
            s.close()
    wait_until_ok = time.monotonic() + 10
    while get(endpoint(d) + "/health")[0] != 200:
        assert time.monotonic() < wait_until_ok
        time.sleep(0.1)
    assert d.proc.poll() is None


def test_connections_that_never_send_a_head_are_dropped_after_the_head_timeout(arena, llama, key_file, daemons):
    """The key is checked once the head is in: until then a client without it holds a connection
    slot, for at most the head timeout (5 s), not --request-timeout (30 s by default)."""
    d = daemons(arena, llama, "a", "--api-key-file", str(key_file))
    host, port = endpoint(d).removeprefix("http://").rsplit(":", 1)
    held = [socket.create_connection((host, int(port))) for _ in range(64)]
    try:
        t0 = time.monotonic()
        reply = raw(d, b"GET /health HTTP/1.1\r\n\r\n")
        assert status_of(reply) == 503 and "more than 64 connections" in error_of(reply)["message"]
        for s in held:
            s.settimeout(20)
            assert s.recv(1) == b""  # closed by the daemon, nothing sent
        dropped = time.monotonic() - t0
    finally:
        for s in held:
            s.close()
    assert dropped < 10, f"idle connections held for {dropped:.1f} s"
    wait_until_ok = time.monotonic() + 10
    while get(endpoint(d) + "/health")[0] != 200:
        assert time.monotonic() < wait_until_ok
        time.sleep(0.1)
    assert client(d, KEY).models.list().data
    # A connection that sends part of a head is cut at the same deadline.
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(20)
        t0 = time.monotonic()
        s.sendall(b"GET /v1/models HTTP/1.1\r\n")
        assert s.recv(1) == b"" and time.monotonic() - t0 < 10


def test_an_empty_api_key_variable_refuses_to_start(llama, tmp_path):
    # click would take the empty variable for an unset one, and serve without a key.
    r = serve_refused(str(llama), "--arena", str(tmp_path / "arena"), "--port", "0",
                      env=daemon_env(VRAMD_API_KEY=""))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("vramd: VRAMD_API_KEY is set but empty, which would leave the API open; "
                                "give it the key, or unset it")


def test_failpoints_armed_from_the_environment_are_announced(arena, llama, daemons):
    """VRAMD_FAILPOINTS left in a shell must not silently arm SIGKILLs in a production daemon."""
    armed = "warm.after_token=kill@1000,encode.mid=log"
    d = daemons(arena, llama, "a", env=daemon_env(VRAMD_FAILPOINTS=armed))
    warning = [line for line in d.lines if "WARNING" in line and "VRAMD_FAILPOINTS" in line]
    assert len(warning) == 1 and "encode.mid=log@1,warm.after_token=kill@1000" in warning[0], d.output
    status = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena)],
                            capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "failpoints a: encode.mid=log@1,warm.after_token=kill@1000 armed" in status.stdout, status.stdout
    d.stop()
    d = daemons(arena, llama, "a")  # nothing armed: nothing said
    assert "VRAMD_FAILPOINTS" not in d.output
    status = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena), "--json"],
                            capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=60)
    assert [m["failpoints"] for m in json.loads(status.stdout)["members"]] == [""]

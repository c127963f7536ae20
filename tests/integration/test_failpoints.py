"""Fault injection at every step of going warm and going cold, in real daemons.

For each failpoint of vramd/failpoints.py and each action (SIGKILL, an
exception), two daemons share a real arena: alpha carries the failpoint
(VRAMD_FAILPOINTS), beta is its peer.  The switch that passes the failpoint is
driven for real; afterwards:

- the token is free or held by a live process;
- beta serves a request (peers make progress);
- killed: alpha restarts under the same name, rejoins and serves the output it
  served before; raised: alpha is still up, healthy, not holding the token,
  its KV cache what it was (the state shadow was never torn), and its next
  request succeeds with the same output;
- no orphaned member record, ring, ticket or control socket of a dead pid.

Both daemons run `--residency exclusive --evict-state always`, so every
switch releases everything (the KV cache copied to its shadow) and restores
everything: each failpoint is on the path of every switch.
"""

import base64
import io
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import psutil
import pytest

from tests.ggufgen.llama import write_llama
from vramd.arena.token import Token
from vramd.failpoints import POINTS

from .conftest import DaemonProc, daemon_env

FLAGS = ("--residency", "exclusive", "--evict-state", "always", "--ctx", "128")
PROMPT = "the quick brown fox"

# Which hit of each failpoint is the switch under test: the going-warm points
# are passed once by the start-up's first upload, encode.mid once by the
# reference image request; the going-cold ones strike at alpha's first yield.
AT = {"warm.before_token": 2, "warm.after_token": 2, "restore.mid": 2, "warm.restored": 2,
      "evict.mid": 1, "evict.copied": 1, "release.mid": 1, "cold.before_unlock": 1, "encode.mid": 2}
COLD_SIDE = {"evict.mid", "evict.copied", "release.mid", "cold.before_unlock"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.ggufgen.vision import write_mmproj
    d = tmp_path_factory.mktemp("fp-models")
    return {"alpha": write_llama(d / "alpha.gguf", seed=31, n_embd=96, n_head=4, n_vocab=384, vocab="spm"),
            "beta": write_llama(d / "beta.gguf", seed=32, n_vocab=384, vocab="spm"),
            "mmproj": write_mmproj(d / "mm.gguf", "mlp")}


def post(d: DaemonProc, path: str, body: dict, timeout: float = 120) -> tuple[int, dict, dict]:
    req = urllib.request.Request(d.member().endpoint + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def complete(d: DaemonProc, model: str) -> tuple[int, dict]:
    status, body, _ = post(d, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                  "temperature": 0})
    return status, body


def png_uri() -> str:
    from PIL import Image
    img = Image.new("RGB", (40, 28), (70, 90, 120))
    img.putpixel((3, 4), (255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def describe_image(d: DaemonProc) -> tuple[int, dict]:
    status, body, _ = post(d, "/v1/chat/completions", {
        "model": "alpha", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_uri()}}, {"type": "text", "text": "what is this?"}]}]})
    return status, body


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def assert_token_sane(arena):
    holders = Token(arena / "token.lock").holders()
    assert all(alive(p) for p in holders), f"the token is held by a dead process: {holders}"


def assert_no_orphans(arena):
    """Every member record, ring, ticket and control socket belongs to a live process."""
    members = arena / "members"
    for name in os.listdir(members):
        assert not name.endswith(".tmp"), f"leftover temp record {name}"
        assert alive(int(name.split(".")[0])), f"member record of a dead pid: {name}"
    for name in os.listdir(arena / "doorbell"):
        assert alive(int(name)), f"ring of a dead pid: {name}"
    for name in os.listdir(arena / "queue"):
        if not name.startswith("."):
            assert alive(int(name.split("-")[1])), f"ticket of a dead pid: {name}"
    for name in os.listdir(arena / "control"):
        if name.endswith(".sock"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(arena / "control" / name))   # a socket nobody answers on is an orphan
            finally:
                s.close()


def wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("action", ["kill", "raise"])
@pytest.mark.parametrize("point", list(POINTS))
def test_failpoint(point, action, arena, files, daemons):
    image = point == "encode.mid"
    extra = ("--mmproj", str(files["mmproj"])) if image else ()
    ask = describe_image if image else (lambda d: complete(d, "alpha"))
    env = daemon_env(VRAMD_FAILPOINTS=f"{point}={action}@{AT[point]}")
    a = daemons(arena, files["alpha"], "alpha", *FLAGS, *extra, env=env)
    status, body = ask(a)
    assert status == 200, body
    want = text_of(body)
    kv_before = a.ask("verify")["kv_sha256"]

    if point in COLD_SIDE:
        # beta's start makes alpha yield: alpha's first go-cold passes the failpoint.
        b = daemons(arena, files["beta"], "beta", *FLAGS)
    else:
        b = daemons(arena, files["beta"], "beta", *FLAGS)
        assert a.member().state == "cold"
        if action == "kill":
            try:
                ask(a)   # alpha goes warm: it dies on the way
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
        else:
            status, body = ask(a)
            assert status == 500 and f"failpoint {point}: injected fault" in body["error"]["message"], body
            if image:   # the failed encode took its encoder off the device again
                assert a.ask("status")["breakdown"]["encoder"]["device"] == 0

    if action == "kill":
        assert a.proc.wait(30) == -signal.SIGKILL, a.output
        wait_for(lambda: f"vramd: failpoint {point}: SIGKILL" in a.output, 10, "the failpoint's line")
    assert_token_sane(arena)

    # The peer makes progress.
    status, body = complete(b, "beta")
    assert status == 200, body

    if action == "kill":
        a = daemons(arena, files["alpha"], "alpha", *FLAGS, *extra)   # restarted, same name
    else:
        assert a.proc.poll() is None, a.output
        wait_for(lambda: f"vramd: failpoint {point}: injected fault" in a.output, 10, "the failpoint's line")
        with urllib.request.urlopen(a.member().endpoint + "/health", timeout=30) as r:
            health = json.loads(r.read())
        assert health["status"] == "ok"
        st = a.ask("status")
        assert not st["holds_token"]
        if point not in COLD_SIDE:
            assert st["state"] == "cold"     # a failed warm-up went cold again, as a yield would
        # The KV cache is what it was: evicted or not, its copy was never torn.
        assert a.ask("verify")["kv_sha256"] == kv_before
    status, body = ask(a)
    assert status == 200, body
    assert text_of(body) == want
    status, body = complete(b, "beta")
    assert status == 200, body
    assert_token_sane(arena)
    assert_no_orphans(arena)


def test_every_failpoint_is_reached_by_a_real_switch(arena, files, daemons):
    """`log` on every failpoint: one switch each way and one image request pass them all.
    A renamed or moved step that no switch passes any more fails here."""
    env = daemon_env(VRAMD_FAILPOINTS=",".join(f"{p}=log" for p in POINTS))
    a = daemons(arena, files["alpha"], "alpha", *FLAGS, "--mmproj", str(files["mmproj"]), env=env)
    assert describe_image(a)[0] == 200
    daemons(arena, files["beta"], "beta", *FLAGS)          # alpha yields
    assert complete(a, "alpha")[0] == 200                # alpha comes back
    wait_for(lambda: all(f"vramd: failpoint {p} reached" in a.output for p in POINTS), 10, "every failpoint")

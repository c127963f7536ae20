"""`vramd gateway` in front of two real daemons, driven by the official `openai` and `ollama` clients.

The gateway runs as its own process (`vramd gateway`), the daemons as theirs
(`vramd serve`), on small synthetic llama models in one arena: requests
switch between the models by name, and what comes back through the gateway
is what the daemon gives directly.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import ollama
import openai
import pytest

from tests.ggufgen.llama import write_llama

from .conftest import DaemonProc, daemon_env

GW_KEY = "gateway-key-123"
A_KEY = "daemon-a-key-456"


class GatewayProc:
    def __init__(self, arena, *flags):
        self.proc = subprocess.Popen([sys.executable, "-m", "vramd.cli", "gateway", "--arena", str(arena),
                                      "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=daemon_env())
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(x.rstrip()) for x in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + 30
        while not (m := next((re.search(r"on (http://\S+)", x) for x in self.lines if "serving" in x), None)):
            assert self.proc.poll() is None and time.monotonic() < deadline, "\n".join(self.lines)
            time.sleep(0.02)
        self.url = m.group(1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(30)


def get(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def states(gw) -> dict:
    _, body = get(gw.url + "/v1/models", GW_KEY)
    return {m["id"]: m["status"]["value"] for m in body["data"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Daemons a (with its own API key) and b, and a gateway with a key, a's key and an alias."""
    tmp = tmp_path_factory.mktemp("gw")
    arena = tmp / "arena"
    a = write_llama(tmp / "a.gguf", seed=21, n_vocab=384, vocab="spm")
    b = write_llama(tmp / "b.gguf", seed=22, n_vocab=384, vocab="spm")
    key_file = tmp / "a.key"
    key_file.write_text(A_KEY + "\n")
    key_file.chmod(0o600)
    da = DaemonProc(arena, a, "a", "--api-key-file", str(key_file), ctx=256)
    db = DaemonProc(arena, b, "b", ctx=256)
    gw = GatewayProc(arena, "--api-key", GW_KEY, "--member-key-file", f"a={key_file}", "--alias", "gpt=a")
    yield {"arena": arena, "a": da, "b": db, "gw": gw, "key_file": key_file}
    gw.stop()
    for d in (da, db):
        d.terminate()
    for d in (da, db):
        d.reap()


def oai(url, key=GW_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(c, model, n=8, **kw):
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                  max_tokens=n, temperature=0, **kw)
    return r.choices[0].message.content


def test_openai_sdk_switches_between_two_daemons_by_model(setup):
    gw, a, b = setup["gw"], setup["a"], setup["b"]
    c = oai(gw.url)
    direct_a = chat(oai(a.member().endpoint, A_KEY), "a")
    direct_b = chat(oai(b.member().endpoint, "unused"), "b")
    assert direct_a != direct_b
    for _ in range(2):   # a, b, a, b: each request wakes its daemon, which makes the other yield
        assert chat(c, "a") == direct_a
        assert states(gw)["a"] == "warm" and states(gw)["b"] in ("parked", "cold")
        assert chat(c, "b") == direct_b
        assert states(gw)["b"] == "warm" and states(gw)["a"] in ("parked", "cold")
    assert chat(c, "gpt") == direct_a            # the alias
    assert chat(c, "b.gguf") == direct_b         # the file name
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0,
        stream=True) if ch.choices)
    assert streamed == direct_b
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="a", prompt="one two", max_tokens=6, temperature=0, stream=True) if ch.choices)
    assert text == oai(a.member().endpoint, A_KEY).completions.create(
        model="a", prompt="one two", max_tokens=6, temperature=0).choices[0].text
    listed = c.models.list().data
    assert [m.id for m in listed] == ["a", "b", "gpt"]   # each member once, the alias as its own entry
    assert c.models.retrieve("a").id == "a"
    assert c.models.retrieve("gpt").model_extra["alias_of"] == "a"


def test_a_stream_is_relayed_as_it_is_generated(setup):
    """The first chunk reaches the client while the daemon is still generating: not buffered."""
    gw, b = setup["gw"], setup["b"]
    n = 120
    before = b.ask("status")["engine"]["generated_tokens"]
    stream = oai(gw.url).completions.create(model="b", prompt="one", max_tokens=n, temperature=0, stream=True,
                                            extra_body={"stop": []})
    first = next(iter(stream))
    made_then = b.ask("status")["engine"]["generated_tokens"] - before
    rest = list(stream)
    made = b.ask("status")["engine"]["generated_tokens"] - before
    assert first.choices and made == n, (made, len(rest))
    assert made_then < n, f"the first chunk came only after all {n} tokens were generated"


def test_ollama_client_lists_shows_and_chats_streamed(setup):
    gw, a = setup["gw"], setup["a"]
    o = ollama.Client(host=gw.url, headers={"Authorization": f"Bearer {GW_KEY}"})
    assert sorted(m.model for m in o.list().models) == ["a", "b", "gpt"]
    tags = {m.model: m for m in o.list().models}
    assert tags["a"].details.family == "llama" and tags["a"].details.format == "gguf"
    for name in ("a", "b", "a"):
        parts = list(o.chat(model=name, messages=[{"role": "user", "content": "hello there"}], stream=True,
                            options={"num_predict": 8, "temperature": 0}))
        assert parts[-1].done and parts[-1].done_reason == "length" and parts[-1].eval_count == 8
        assert not any(p.done for p in parts[:-1])
        direct = chat(oai(a.member().endpoint, A_KEY) if name == "a" else oai(setup["b"].member().endpoint),
                      name)
        assert "".join(p.message.content for p in parts) == direct
        running = {m.model: m for m in o.ps().models}
        assert running[name].size_vram > 0
    whole = o.chat(model="b", messages=[{"role": "user", "content": "hello there"}],
                   options={"num_predict": 8, "temperature": 0})
    assert whole.done and whole.message.content == chat(oai(setup["b"].member().endpoint), "b")
    gen = o.generate(model="a:latest", prompt="one two", raw=True, options={"num_predict": 6, "temperature": 0})
    assert gen.response == oai(a.member().endpoint, A_KEY).completions.create(
        model="a", prompt="one two", max_tokens=6, temperature=0).choices[0].text
    assert o.show("a").modelinfo["general.architecture"] == "llama"
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="a", messages=[{"role": "user", "content": "hi"}], options={"repeat_penalty": 1.1})
    assert e.value.status_code == 400 and "repeat_penalty" in str(e.value)
    assert o._client.get("/api/version").json()["version"]


def test_unknown_model_is_404_naming_the_known_ones(setup):
    c = oai(setup["gw"].url)
    with pytest.raises(openai.NotFoundError) as e:
        chat(c, "nope")
    assert "nope" in str(e.value) and "a, a.gguf, b, b.gguf, gpt" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    o = ollama.Client(host=setup["gw"].url, headers={"Authorization": f"Bearer {GW_KEY}"})
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "known models" in str(e.value)


def test_api_key_of_the_gateway_and_of_the_members(setup):
    gw, a = setup["gw"], setup["a"]
    assert get(gw.url + "/health") == (200, {"status": "ok", "members": 2})   # open, like the daemons'
    with pytest.raises(openai.AuthenticationError):
        chat(oai(gw.url, key="wrong"), "a")
    assert get(gw.url + "/v1/models")[0] == 401
    assert get(gw.url + "/api/tags")[0] == 401
    # A gateway without member keys passes the client's Authorization on: a's key reaches a.
    open_gw = GatewayProc(setup["arena"])
    try:
        assert chat(oai(open_gw.url, key=A_KEY), "a") == chat(oai(a.member().endpoint, A_KEY), "a")
        with pytest.raises(openai.AuthenticationError) as e:
            chat(oai(open_gw.url, key="not-a-key"), "a")   # a's own refusal, relayed
        assert "incorrect API key" in str(e.value)
    finally:
        assert open_gw.stop() == 0


def test_dead_member_restart_of_the_gateway_and_a_member_joining(tmp_path, daemons):
    arena = tmp_path / "arena"
    a = write_llama(tmp_path / "a.gguf", seed=21, n_vocab=384, vocab="spm")
    b = write_llama(tmp_path / "b.gguf", seed=22, n_vocab=384, vocab="spm")
    da = daemons(arena, a, "a", ctx=256)
    db = daemons(arena, b, "b", ctx=256)
    gw = GatewayProc(arena)
    try:
        c = oai(gw.url, "unused")
        want_b = chat(c, "b")
        os.kill(db.proc.pid, signal.SIGKILL)
        db.proc.wait(30)
        with pytest.raises(openai.APIStatusError) as e:
            chat(c, "b")
        assert e.value.status_code == 503 and "not running" in str(e.value) and "'b'" in str(e.value)
        assert [m.id for m in c.models.list().data] == ["a"]
        # The gateway restarts; a keeps serving meanwhile, and the new gateway knows b is dead too.
        a_pid = da.proc.pid
        assert gw.stop() == 0
        assert chat(oai(da.member().endpoint, "unused"), "a")
        gw = GatewayProc(arena)
        c = oai(gw.url, "unused")
        assert chat(c, "a") and da.proc.pid == a_pid and da.proc.poll() is None
        stale = (arena / "members" / f"{db.proc.pid}.json").exists()   # unless a peer cleaned it up meanwhile
        with pytest.raises(openai.APIStatusError) as e:
            chat(c, "b")
        assert e.value.status_code == (503 if stale else 404), str(e.value)
        # b comes back (a new process): seen without restarting the gateway.
        daemons(arena, b, "b", ctx=256)
        assert chat(c, "b") == want_b
        assert states(gw).keys() == {"a", "b"}
    finally:
        gw.stop()

"""`vramd gateway` in front of two real daemons, driven by the official `openai` and `ollama` clients.

The gateway runs as its own process (`vramd gateway`), the daemons as theirs
(`vramd serve`), on small synthetic llama models in one arena: requests
switch between the models by name, and what comes back through the gateway
is what the daemon gives directly, embeddings too (b runs with --pooling
mean).  Ollama's keep_alive 0 and load requests reach the member's control
socket: the member is seen cold with its device memory freed, or warm.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np

import ollama
import openai
import pytest

from tests.ggufgen.llama import write_llama

from .conftest import DaemonProc, daemon_env, gpu_held_elsewhere

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
    """Daemons a (with its own API key) and b (with an alias of its own), and a gateway with a key,
    a's key and an alias."""
    tmp = tmp_path_factory.mktemp("gw")
    arena = tmp / "arena"
    a = write_llama(tmp / "a.gguf", seed=21, n_vocab=384, vocab="spm")
    b = write_llama(tmp / "b.gguf", seed=22, n_vocab=384, vocab="spm")
    key_file = tmp / "a.key"
    key_file.write_text(A_KEY + "\n")
    key_file.chmod(0o600)
    da = DaemonProc(arena, a, "a", "--api-key-file", str(key_file), ctx=256)
    db = DaemonProc(arena, b, "b", "--pooling", "mean", "--alias", "bee", ctx=256)   # b: embeddings, an alias
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
    assert chat(c, "bee") == direct_b            # b's own --alias, from its member record
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0,
        stream=True) if ch.choices)
    assert streamed == direct_b
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="a", prompt="one two", max_tokens=6, temperature=0, stream=True) if ch.choices)
    assert text == oai(a.member().endpoint, A_KEY).completions.create(
        model="a", prompt="one two", max_tokens=6, temperature=0).choices[0].text
    listed = c.models.list().data
    # Each member once, then b's own alias and the gateway's, each as its own entry (as a daemon lists its own).
    assert [m.id for m in listed] == ["a", "b", "bee", "gpt"]
    assert [m.model_extra["aliases"] for m in listed[:2]] == [["gpt"], ["bee"]]
    assert c.models.retrieve("a").id == "a"
    assert c.models.retrieve("gpt").model_extra["alias_of"] == "a"
    assert c.models.retrieve("bee").model_extra["alias_of"] == "b"


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
    assert sorted(m.model for m in o.list().models) == ["a", "b", "bee", "gpt"]
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
    # Ollama's penalty options are the daemon's fields of the same names (vramd/engine/penalties.py).
    pen = {"repeat_penalty": 1.5, "repeat_last_n": 16, "presence_penalty": 1.5, "frequency_penalty": 1.0}
    direct_b = oai(setup["b"].member().endpoint)
    penalised = chat(direct_b, "b", 24, extra_body=pen)
    assert penalised != chat(direct_b, "b", 24)           # they change this answer: a dropped one would show
    assert o.chat(model="b", messages=[{"role": "user", "content": "hello there"}],
                  options={"num_predict": 24, "temperature": 0, **pen}).message.content == penalised
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="a", messages=[{"role": "user", "content": "hi"}], options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in str(e.value)
    assert o._client.get("/api/version").json()["version"]


def test_unknown_model_is_404_naming_the_known_ones(setup):
    c = oai(setup["gw"].url)
    with pytest.raises(openai.NotFoundError) as e:
        chat(c, "nope")
    assert "nope" in str(e.value) and "a, a.gguf, b, b.gguf, bee, gpt" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    assert get(setup["gw"].url + "/api/nope", GW_KEY)[0] == 404   # not Ollama's "/" (a prefix route)
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


TEXTS = ["The river ran past the old mill.", "the miller's daughter", "12 sacks on Monday"]


def test_openai_sdk_embeddings_through_the_gateway_equal_the_daemons(setup):
    gw, b = setup["gw"], setup["b"]
    c, direct = oai(gw.url), oai(b.member().endpoint, "unused")
    want = direct.embeddings.create(model="b", input=TEXTS, encoding_format="float")
    assert len(want.data) == 3 and len(want.data[0].embedding) == 128
    default = c.embeddings.create(model="b", input=TEXTS)          # the SDK asks for base64 and decodes it
    floats = c.embeddings.create(model="b.gguf", input=TEXTS, encoding_format="float")
    for got in (default, floats):
        assert [x.index for x in got.data] == [0, 1, 2]
        assert [x.embedding for x in got.data] == [x.embedding for x in want.data]   # bit for bit
        assert got.usage.prompt_tokens == want.usage.prompt_tokens and got.model == "b"
    ids = [[1, 17, 42, 99, 7], [3, 5, 8]]                           # token ids, as LangChain sends them
    assert [x.embedding for x in c.embeddings.create(model="b", input=ids).data] == \
        [x.embedding for x in direct.embeddings.create(model="b", input=ids).data]
    assert c.embeddings.create(model="b", input=ids[0]).data[0].embedding == \
        direct.embeddings.create(model="b", input=ids[0]).data[0].embedding
    with pytest.raises(openai.BadRequestError, match="pooling type is none.*--pooling mean"):
        c.embeddings.create(model="a", input="hello")                # a has no pooling: its own 400, relayed
    with pytest.raises(openai.BadRequestError, match="'dimensions' 64"):
        c.embeddings.create(model="b", input="hello", dimensions=64)


def test_ollama_client_embed_through_the_gateway(setup):
    gw, b = setup["gw"], setup["b"]
    o = ollama.Client(host=gw.url, headers={"Authorization": f"Bearer {GW_KEY}"})
    want = oai(b.member().endpoint, "unused").embeddings.create(model="b", input=TEXTS, encoding_format="float")
    vectors = [x.embedding for x in want.data]
    r = o.embed(model="b", input=TEXTS)
    assert r.model == "b" and [list(v) for v in r.embeddings] == vectors
    assert r.prompt_eval_count == want.usage.prompt_tokens
    assert abs(np.linalg.norm(r.embeddings[0]) - 1) < 1e-5
    assert [list(v) for v in o.embed(model="b:latest", input=TEXTS[1], truncate=True, dimensions=128,
                                     keep_alive="5m").embeddings] == [vectors[1]]
    assert list(o.embeddings(model="b", prompt=TEXTS[2]).embedding) == vectors[2]   # the older /api/embeddings
    long = " ".join(["word"] * 400)                                  # more than b's context of 256 holds
    with pytest.raises(ollama.ResponseError) as e:
        o.embed(model="b", input=long)
    assert e.value.status_code == 400 and "context of 256 tokens" in str(e.value) and "'truncate'" in str(e.value)
    with pytest.raises(ollama.ResponseError) as e:
        o.embed(model="b", input=long, truncate=False)                # asked not to cut: the plain refusal
    assert e.value.status_code == 400 and "context of 256" in str(e.value) and "truncate" not in str(e.value)
    for kw, word in (({"dimensions": 64}, "'dimensions' 64"), ({"options": {"num_ctx": 512}}, "'num_ctx'"),
                     ({"options": {"temperature": 0}}, "'temperature'"), ({"keep_alive": "soon"}, "'keep_alive'")):
        with pytest.raises(ollama.ResponseError) as e:
            o.embed(model="b", input="hello", **kw)
        assert e.value.status_code == 400 and word in str(e.value), (kw, str(e.value))
    with pytest.raises(ollama.ResponseError) as e:
        o.embeddings(model="b", prompt="hi", options={"num_thread": 2})
    assert e.value.status_code == 400 and "'num_thread'" in str(e.value)


def wait_for(member_of, want, timeout=30.0):
    """The member record once `want(record)` holds (the unload runs after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        m = member_of()
        if want(m):
            return m
        assert time.monotonic() < deadline, f"member {m.name}: state {m.state}, {m.device_bytes()} device bytes"
        time.sleep(0.05)


def test_ollama_keep_alive_0_unloads_and_load_requests_load(setup):
    gw, a, b = setup["gw"], setup["a"], setup["b"]
    o = ollama.Client(host=gw.url, headers={"Authorization": f"Bearer {GW_KEY}"})
    cold_and_empty = lambda m: m.state == "cold" and m.device_bytes() == 0   # noqa: E731
    # A chat with keep_alive 0: the answer as usual, then a goes cold with its device memory freed.
    direct = chat(oai(a.member().endpoint, A_KEY), "a")
    r = o.chat(model="a", messages=[{"role": "user", "content": "hello there"}], keep_alive=0,
               options={"num_predict": 8, "temperature": 0})
    assert r.message.content == direct
    wait_for(a.member, cold_and_empty)
    assert "a" not in {m.model for m in o.ps().models}
    r = o.chat(model="a", messages=[{"role": "user", "content": "hello there"}], keep_alive="0s",
               options={"num_predict": 8, "temperature": 0}, stream=True)   # it wakes (restored), then unloads
    assert "".join(p.message.content for p in r) == direct
    wait_for(a.member, cold_and_empty)
    assert chat(oai(gw.url), "a") == direct and a.member().state == "warm"   # and serves the next as ever
    # Ollama's load request (no prompt): b is woken, nothing is generated.
    generated = b.ask("status")["engine"]["generated_tokens"]
    r = o.generate(model="b")
    assert r.done and r.done_reason == "load" and r.response == ""
    assert b.member().state == "warm" and b.ask("status")["engine"]["generated_tokens"] == generated
    # ... and the unload request (`ollama stop b`): cold, its memory freed, before the reply.
    r = o.generate(model="b", keep_alive="0m")
    assert r.done_reason == "unload" and cold_and_empty(b.member())
    assert o.chat(model="b", messages=[], keep_alive=-1).done_reason == "load" and b.member().state == "warm"
    assert o.embed(model="b", input=[], keep_alive=0).embeddings == [] and cold_and_empty(b.member())
    # An embedding with keep_alive 0: the vectors, then cold.
    assert len(o.embed(model="b", input="hello", keep_alive=0).embeddings[0]) == 128
    wait_for(b.member, cold_and_empty)
    with pytest.raises(ollama.ResponseError) as e:
        o.chat(model="b", messages=[{"role": "user", "content": "hi"}], keep_alive="0x")
    assert e.value.status_code == 400 and "'keep_alive'" in str(e.value)


def upstream_ports(gw, daemon) -> set:
    """The gateway's own ports of its open connections to `daemon`'s endpoint."""
    import psutil
    port = int(daemon.member().endpoint.rsplit(":", 1)[1])
    return {c.laddr.port for c in psutil.Process(gw.proc.pid).net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


def test_keep_alive_client_to_gateway_and_gateway_to_daemon(setup):
    """One client connection carries several requests, streams among them (chunked); the gateway's
    connection to the daemon is kept and reused, and one a client drops mid-stream is not."""
    import http.client
    gw, b = setup["gw"], setup["b"]
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    auth = {"Authorization": f"Bearer {GW_KEY}", "Content-Type": "application/json"}
    ask = {"model": "b", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
           "temperature": 0}
    want = chat(oai(b.member().endpoint), "b")
    conn.connect()
    mine = conn.sock.getsockname()
    seen = []
    for i in range(3):
        conn.request("POST", "/v1/chat/completions", json.dumps(ask), auth)
        r = conn.getresponse()
        assert r.status == 200 and not r.will_close
        assert json.loads(r.read())["choices"][0]["message"]["content"] == want
        conn.request("POST", "/v1/chat/completions", json.dumps({**ask, "stream": True}), auth)
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Transfer-Encoding") == "chunked" and not r.will_close
        events = [json.loads(x[5:]) for x in r.read().decode().split("\n\n") if x.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == want
        conn.request("POST", "/api/chat", json.dumps({"model": "b", "messages": ask["messages"],
                                                      "options": {"num_predict": 8, "temperature": 0}}), auth)
        r = conn.getresponse()
        lines = [json.loads(x) for x in r.read().splitlines()]   # Ollama's NDJSON stream, chunked too
        assert lines[-1]["done"] and "".join(x["message"]["content"] for x in lines) == want
        conn.request("GET", "/v1/models", headers=auth)
        assert conn.getresponse().read()
        seen.append(upstream_ports(gw, b))
    assert conn.sock is not None and conn.sock.getsockname() == mine    # never reconnected
    conn.close()
    # The gateway's connection to b stayed the same one from request to request (it was pooled), not
    # a new one each time (none would be open between requests then).
    assert len(seen[0]) == 1 and seen[0] == seen[1] == seen[2], seen
    # A client that hangs up mid-stream: that upstream connection is closed, not pooled (b sees its
    # client gone and stops generating).
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"model": "b", "prompt": "one", "max_tokens": 200,
                                                     "temperature": 0, "stream": True, "stop": []}), auth)
    r = c.getresponse()
    assert r.status == 200 and r.readline()
    busy = upstream_ports(gw, b)
    assert busy, "no connection to b while it streams"
    c.close()
    deadline = time.monotonic() + 30
    while upstream_ports(gw, b) & busy:
        assert time.monotonic() < deadline, "the broken-off stream's upstream connection stayed open"
        time.sleep(0.05)


def test_ollama_think_and_thinking_through_the_gateway(tmp_path, daemons):
    """DeepSeek-R1's template (its generation prompt opens <think>, so a random model's whole answer
    is reasoning): Ollama's `think` picks the daemon's split, `reasoning_content` comes back as
    `thinking`, streamed or not, for /api/chat and /api/generate; and a tool-call history with
    content null renders through R1's own tool-call format."""
    from tests.engine.test_tool_templates import TEMPLATES
    model = write_llama(tmp_path / "r1.gguf", arch="qwen3", n_embd=64, n_ff=128, n_layer=1, seed=12,
                        chat_template=(TEMPLATES / "deepseek-r1-distill-qwen-32b.jinja").read_text())
    d = daemons(tmp_path / "arena", model, "r1", ctx=1024, wait_ready=False)
    d.wait_ready(120)
    gw = GatewayProc(tmp_path / "arena")
    try:
        direct = oai(d.member().endpoint, "unused")
        msgs = [{"role": "user", "content": "How many sacks came on Monday?"}]
        args = dict(model="r1", messages=msgs, max_tokens=10, temperature=0)
        raw = direct.chat.completions.create(extra_body={"reasoning_format": "none"}, **args).choices[0].message
        split = direct.chat.completions.create(extra_body={"reasoning_format": "deepseek"}, **args).choices[0].message
        assert split.reasoning_content and split.content == "" and raw.content.strip() == split.reasoning_content
        o = ollama.Client(host=gw.url)
        opts = {"num_predict": 10, "temperature": 0}
        for think in (True, None):   # asked for, or the daemon's default (auto: R1's is a thinking template)
            kw = {} if think is None else {"think": think}
            r = o.chat(model="r1", messages=msgs, options=opts, **kw)
            assert r.message.thinking == split.reasoning_content and r.message.content == "", think
            parts = list(o.chat(model="r1", messages=msgs, options=opts, stream=True, **kw))
            assert "".join(p.message.thinking or "" for p in parts) == split.reasoning_content
            assert "".join(p.message.content for p in parts) == "" and parts[-1].done
        r = o.chat(model="r1", messages=msgs, options=opts, think=False)   # no split: what it wrote is content
        assert r.message.content == raw.content and not r.message.thinking
        g = o.generate(model="r1", prompt=msgs[0]["content"], options=opts, think=True)
        assert g.thinking == split.reasoning_content and g.response == ""
        parts = list(o.generate(model="r1", prompt=msgs[0]["content"], options=opts, think=True, stream=True))
        assert "".join(p.thinking or "" for p in parts) == split.reasoning_content
        with pytest.raises(ollama.ResponseError) as e:
            o.chat(model="r1", messages=msgs, think="high")
        assert e.value.status_code == 400 and "think levels" in str(e.value)
        # A tool-call history (Ollama's: the call without content), thinking included: R1's template renders
        # the call in its own format, not a JSON text the template never wrote.
        history = msgs + [{"role": "assistant", "content": "", "thinking": "I should look it up.",
                           "tool_calls": [{"function": {"name": "sacks", "arguments": {"day": "Monday"}}}]},
                          {"role": "tool", "tool_name": "sacks", "content": "12"}]
        r = o.chat(model="r1", messages=history, options=opts, think=True)
        # The same history as an OpenAI client sends it (content null, the tool message's call id):
        # the same prompt, the same answer.  (What R1's template makes of it: tests/engine/test_tool_templates.py.)
        same = direct.chat.completions.create(
            model="r1", max_tokens=10, temperature=0, extra_body={"reasoning_format": "deepseek"},
            messages=msgs + [{"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
                              "tool_calls": [{"id": "c1", "type": "function", "function": {
                                  "name": "sacks", "arguments": '{"day": "Monday"}'}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": "12"}])
        assert r.prompt_eval_count == same.usage.prompt_tokens
        assert r.message.thinking == same.choices[0].message.reasoning_content
    finally:
        gw.stop()


def test_a_late_error_of_a_daemon_is_an_error_through_every_streamed_route(tmp_path, daemons):
    """The daemon's headers go out at once, so the GPU not had within --wake-timeout comes after them,
    as an SSE error event: through the gateway, Ollama's clients get Ollama's mid-stream error line
    (the `ollama` client raises with the message), the openai SDK the event (it raises), never an
    empty answer that says it is done."""
    arena = tmp_path / "arena"
    d = daemons(arena, write_llama(tmp_path / "w.gguf", seed=23, n_vocab=384, vocab="spm"), "w",
                "--wake-timeout", "3", ctx=256)
    gw = GatewayProc(arena)
    try:
        o, c = ollama.Client(host=gw.url), oai(gw.url, "unused")
        msgs = [{"role": "user", "content": "hi"}]
        d.ask("yield")
        with gpu_held_elsewhere(arena, 40):
            with pytest.raises(ollama.ResponseError, match="for the GPU"):
                list(o.chat(model="w", messages=msgs, stream=True, options={"num_predict": 2}))
            with pytest.raises(ollama.ResponseError, match="for the GPU"):
                list(o.generate(model="w", prompt="hi", stream=True, options={"num_predict": 2}))
            with pytest.raises(ollama.ResponseError, match="for the GPU"):
                list(o.generate(model="w", prompt="hi", raw=True, stream=True, options={"num_predict": 2}))
            with pytest.raises(openai.APIError, match="for the GPU"):
                list(c.chat.completions.create(model="w", messages=msgs, max_tokens=2, stream=True))
            # The NDJSON itself: the error is the last line, no "done" line before it.
            req = urllib.request.Request(gw.url + "/api/chat", data=json.dumps(
                {"model": "w", "messages": msgs, "options": {"num_predict": 2}}).encode())
            with urllib.request.urlopen(req, timeout=60) as r:
                lines = [json.loads(x) for x in r.read().splitlines() if x.strip()]
            assert r.status == 200 and lines and "for the GPU" in lines[-1]["error"], lines
            assert not any(x.get("done") for x in lines), lines
        parts = list(o.chat(model="w", messages=msgs, stream=True, options={"num_predict": 2}))
        assert parts[-1].done and parts[-1].eval_count == 2   # fine again once the GPU is free
        assert any(re.search(r"status=200 .*error_status=503", x) for x in gw.lines), "\n".join(gw.lines)
    finally:
        gw.stop()


def raw_request(url, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_path_no_daemon_could_have_is_a_404_naming_it(setup):
    gw, b = setup["gw"], setup["b"]
    body = json.dumps({"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    before = upstream_ports(gw, b)
    for path in (b"/v1/chat/completions\x7f", "/v1/chat/completions\u00e9".encode(), b"/v1/chat/completions\x01"):
        out = raw_request(gw.url, b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          b"Authorization: Bearer " + GW_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head, _, reply = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404"), out
        assert "no such route" in json.loads(reply)["error"]["message"], out
    assert upstream_ports(gw, b) <= before, "a refused request left a connection to the daemon open"
    assert not any("Traceback" in x for x in gw.lines), "\n".join(gw.lines)
    assert chat(oai(gw.url), "b")   # and the gateway serves on


def test_cors_on_the_gateway_for_allowed_origins_only(setup):
    ok, other = "http://ui.example:8080", "http://evil.example"
    gw = GatewayProc(setup["arena"], "--api-key", GW_KEY, "--cors-origin", ok)
    try:
        def ask(method, path, headers, data=None):
            req = urllib.request.Request(gw.url + path, method=method, headers=headers, data=data)
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, r.headers, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.headers, e.read()
        pre = {"Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        status, h, _ = ask("OPTIONS", "/v1/chat/completions", {"Origin": ok, **pre})   # no key: a preflight has none
        assert status == 204 and h["Access-Control-Allow-Origin"] == ok, h
        assert "POST" in h["Access-Control-Allow-Methods"] and h["Access-Control-Allow-Headers"] == pre[
            "Access-Control-Request-Headers"]
        status, h, _ = ask("OPTIONS", "/v1/chat/completions", {"Origin": other, **pre})
        assert status == 204 and h["Access-Control-Allow-Origin"] is None
        # The real requests: a stream, a reply, an error, Ollama's routes: allowed origin only.
        body = json.dumps({"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           "stream": True}).encode()
        key = {"Authorization": f"Bearer {GW_KEY}", "Content-Type": "application/json"}
        for origin, want in ((ok, ok), (other, None)):
            status, h, data = ask("POST", "/v1/chat/completions", {"Origin": origin, **key}, body)
            assert status == 200 and b"[DONE]" in data and h["Access-Control-Allow-Origin"] == want, h
            status, h, _ = ask("GET", "/api/tags", {"Origin": origin, **key})
            assert status == 200 and h["Access-Control-Allow-Origin"] == want
            status, h, _ = ask("GET", "/v1/models", {"Origin": origin})   # no key: 401, still readable
            assert status == 401 and h["Access-Control-Allow-Origin"] == want
        # Without --cors-origin (the module's gateway): none.
        req = urllib.request.Request(setup["gw"].url + "/v1/chat/completions", method="OPTIONS",
                                     headers={"Origin": ok, **pre})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] is None
    finally:
        assert gw.stop() == 0

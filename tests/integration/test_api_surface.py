"""The API surface clients touch (issue 18, items 3 and 6), against real daemons on a small synthetic model:
every request field taken or refused (the table against the installed openai SDK and against the docs),
penalties and logit_bias through the API, models.retrieve and aliases, n > 1 and lists of prompts
(streamed and not), OPTIONS/CORS and HEAD, HTTP/1.1 keep-alive (http.client and the SDK's pooled
httpx client), and a stream's headers and keep-alive comments while it waits for the GPU."""

import asyncio
import concurrent.futures
import http.client
import json
import re
import socket
import subprocess
import sys
import time
import typing
from collections import Counter
from pathlib import Path

import httpx2 as httpx   # the openai SDK's own HTTP client (its fork of httpx)
import openai
import pytest

from tests.ggufgen.llama import write_llama
from vramd.server import api_fields

from .conftest import ROOT, daemon_env, gpu_held_elsewhere

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
NO_EOG = {"2": -100}   # the synthetic vocabulary's end-of-generation token banned: max_tokens tokens, whatever the draw


@pytest.fixture
def llama(tmp_path):
    return write_llama(tmp_path / "a.gguf", seed=21, n_vocab=384, vocab="spm")


def client(d, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)


def conn(d) -> http.client.HTTPConnection:
    host, port = d.member().endpoint.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=60)


def post(d, path: str, body: dict) -> tuple[int, dict]:
    c = conn(d)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


# -- the field table ---------------------------------------------------------------------------

def sdk_fields(module) -> set[str]:
    """Every body field the installed openai SDK can send to the endpoint (its TypedDict's keys)."""
    return set(typing.get_type_hints(module.CompletionCreateParamsBase).keys())


def test_every_field_of_the_sdk_is_in_the_table_and_the_docs_show_the_table():
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    for kind, module in (("chat", chat_params), ("completion", completion_create_params)):
        missing = sorted(f for f in sdk_fields(module) - {"stream"} if getattr(api_fields.FIELDS.get(f), kind, None)
                         is None)
        assert missing == [], f"{kind}: fields of the OpenAI API with no row for this endpoint: {missing}"
    for f in api_fields.FIELDS.values():
        assert f.chat in api_fields.STATUSES + (None,) and f.completion in api_fields.STATUSES + (None,)
        # A refused field or one taken for some values says why when refused (its check raises).
        if "refused" in (f.chat, f.completion):
            with pytest.raises(api_fields.FieldError, match=f"'{f.name}'"):
                api_fields.check("chat" if f.chat == "refused" else "completion", {f.name: {"x": 1}})
    # docs/operations.md carries the table as the code renders it.
    text = DOCS.read_text()
    assert api_fields.markdown() in text, "docs/operations.md's request-field table differs from " \
                                          "vramd/server/api_fields.py's (paste api_fields.markdown())"


def test_fields_are_taken_or_refused_with_a_400_naming_them(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--ctx", "128")
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, message in [({"frobnicate": 1}, "unknown field 'frobnicate' for /v1/chat/completions"),
                           ({"echo": True}, "it is a field of /v1/completions"),
                           ({"audio": {"voice": "x"}}, "'audio' is not supported: vramd generates text only"),
                           ({"modalities": ["text", "audio"]}, "only [\"text\"]"),
                           ({"store": True}, "'store': True is not supported, only false"),
                           ({"service_tier": "flex"}, "one service tier"),
                           ({"web_search_options": {}}, "'web_search_options' is not supported"),
                           ({"functions": [{"name": "f"}]}, "send 'tools'"),
                           ({"stream_options": {"include_obfuscation": True}}, "include_obfuscation"),
                           ({"stream_options": {"chunk_size": 3}}, "'stream_options.chunk_size'"),
                           ({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs': true"),
                           ({"metadata": {"k": 5}}, "'metadata' must be an object of at most 16 string values"),
                           ({"user": "u" * 300}, "'user' must be a string of at most 256"),
                           ({"cache_prompt": False}, "always reuses the cached prefix"),
                           ({"n_predict": 5, "max_tokens": 3}, "'n_predict' 5 and 'max_tokens' 3 disagree"),
                           ({"logit_bias": {"384": 1}}, "token id 384 is outside the vocabulary"),
                           ({"logit_bias": {"3": 500}}, "must be between -100 and 100"),
                           ({"frequency_penalty": 3}, "'frequency_penalty' must be between -2.0 and 2.0"),
                           ({"n": 17}, "'n' must be between 1 and 16"),
                           ({"grammar": "root ::= \"a\""}, "send 'response_format'"),
                           ({"mirostat": 2}, "'mirostat': 2 is not supported, only 0: vramd's sampler chain"),
                           ({"mirostat": True}, "'mirostat': True is not supported"),
                           ({"samplers": ["top_k"]}, "'samplers' is not supported")]:
        status, body = post(d, "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and message in body["error"]["message"], (extra, body)
        if "unknown" in message or "not supported" in message:
            assert body["error"]["param"] == next(iter(extra))
    # A number or a flag of the wrong kind or range: the error object's `param` names the field too.
    for extra, param in [({"temperature": 3}, "temperature"), ({"top_k": 1.5}, "top_k"), ({"seed": -1}, "seed"),
                         ({"frequency_penalty": "x"}, "frequency_penalty"), ({"stream": "yes"}, "stream"),
                         ({"logprobs": 1}, "logprobs"),
                         ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage")]:
        status, body = post(d, "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and body["error"]["param"] == param, (extra, body)
    status, body = post(d, "/v1/completions", {"model": "a", "prompt": "x", "echo": "no"})
    assert status == 400 and body["error"]["param"] == "echo", body
    with pytest.raises(openai.BadRequestError) as bad:
        client(d).chat.completions.create(model="a", messages=chat["messages"], max_tokens=2, top_p=7)
    assert bad.value.param == "top_p" and "'top_p' must be between" in bad.value.message
    for extra, message in [({"suffixes": "x"}, "unknown field 'suffixes' for /v1/completions"),
                           ({"messages": []}, "it is a field of /v1/chat/completions"),
                           ({"best_of": 3}, "'best_of' 3 with 'n' 1 is not supported"),
                           ({"prompt": ["a"] * 9, "n": 2}, "9 prompts x 'n' 2 = 18 choices: at most 16"),
                           ({"prompt": [["a"]]}, "'prompt' must be a string, a list of token ids")]:
        status, body = post(d, "/v1/completions", {"model": "a", "prompt": "x", **extra})
        assert status == 400 and message in body["error"]["message"], (extra, body)
    # Every field taken for its value, through the SDK, in one request; nulls are "not given".
    c = client(d)
    r = c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3,
                                  temperature=0, store=False, metadata={"app": "test"}, user="someone",
                                  service_tier="auto", modalities=["text"], prompt_cache_key="k",
                                  safety_identifier="s", frequency_penalty=0.5, presence_penalty=0.5,
                                  logit_bias={"5": -1}, seed=3, stream_options=None, top_logprobs=None,
                                  extra_body={"top_k": 5, "min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 16,
                                              "cache_prompt": True, "audio": None, "prompt_cache_retention":
                                              "in_memory", "mirostat": 0, "typical_p": 1, "n_probs": 0,
                                              "ignore_eos": False, "id_slot": -1, "top_n_sigma": -1})
    assert r.usage.completion_tokens == 3
    r = c.completions.create(model="a.gguf", prompt="x", best_of=1, user="u", extra_body={"n_predict": 2},
                             logit_bias=NO_EOG)
    assert r.usage.completion_tokens == 2
    # The request's log line names the user.
    deadline = time.monotonic() + 10
    while not any("user=someone" in line for line in d.lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("user=someone" in line and "/v1/chat/completions" in line for line in d.lines)


def test_logit_bias_and_penalties_change_what_is_generated(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--ctx", "128")
    c = client(d)

    def tokens(**kw) -> list[str]:
        """12 greedy tokens' texts; the end-of-generation token (2) banned, so that all 12 come."""
        bias = {"2": -100, **kw.pop("logit_bias", {})}
        r = c.completions.create(model="a", prompt=[1, 40, 41], max_tokens=12, temperature=0, logprobs=0,
                                 logit_bias=bias, **kw)
        return r.choices[0].logprobs.tokens

    plain = tokens()
    assert len(plain) == 12
    forced = tokens(logit_bias={"77": 100})
    assert len(set(forced)) == 1 and forced != plain
    # Ban every token but two: the answer is made of those two only.
    pair = {tokens(logit_bias={"77": 100})[0], tokens(logit_bias={"78": 100})[0]}
    only = tokens(logit_bias={str(t): -100 for t in range(384) if t not in (77, 78)})
    assert set(only) <= pair and only != plain
    # A bias of +20 on token 77 makes greedy repeat it; the penalties that grow with the repeats (or
    # divide its logit) make it come less often.
    t77 = tokens(logit_bias={"77": 100})[0]
    favoured = tokens(logit_bias={"77": 20}).count(t77)
    assert favoured == 12
    for kw in ({"frequency_penalty": 2.0}, {"extra_body": {"repeat_penalty": 3.0}}):
        assert tokens(logit_bias={"77": 20}, **kw).count(t77) < favoured, kw
    # A negative presence penalty makes greedy repeat what it said (it does not here, unpenalised).
    assert tokens(presence_penalty=-2.0) != plain
    assert tokens(extra_body={"repeat_penalty": 1.0}) == plain   # the defaults change nothing


# -- models -----------------------------------------------------------------------------------

def test_models_are_listed_once_with_aliases_and_retrieved(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--ctx", "128", "--alias", "gpt-4o-mini", "--alias", "local")
    c = client(d)
    assert [m.id for m in c.models.list().data] == ["a", "gpt-4o-mini", "local"]
    assert c.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    assert c.models.retrieve("a").owned_by == "vramd"
    assert c.models.retrieve("a.gguf").id == "a.gguf"   # the file's name: taken, not listed
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        c.models.retrieve("nope")
    r = c.chat.completions.create(model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  logit_bias=NO_EOG)
    assert r.usage.completion_tokens == 2
    # Without --cors-origin: no CORS header on any reply, the preflight included.
    h = conn(d)
    h.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://app.example",
                                                          "Access-Control-Request-Method": "POST"})
    r = h.getresponse()
    r.read()
    assert r.status == 204 and r.getheader("Allow") == "OPTIONS, POST"
    assert not [k for k in r.headers if k.lower().startswith("access-control")]
    h.request("GET", "/v1/models", headers={"Origin": "http://app.example"})
    r = h.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") is None


# -- n > 1 and several prompts ----------------------------------------------------------------

def test_n_choices_and_prompt_lists_streamed_and_not(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--ctx", "256")
    c = client(d)
    kw = dict(model="a", max_tokens=6, temperature=1.0, top_p=1.0)

    def one(prompt, seed):
        return c.completions.create(prompt=prompt, seed=seed, **kw)

    r = c.completions.create(prompt="hello", n=3, seed=5, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    # Choice i samples with seed + i: each is what n=1 gives with that seed.
    singles = [one("hello", 5 + i) for i in range(3)]
    assert [ch.text for ch in r.choices] == [s.choices[0].text for s in singles]
    assert len({ch.text for ch in r.choices}) > 1
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens          # the prompt once
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # A list of prompts: n choices each, prompt by prompt.
    r = c.completions.create(prompt=["hello", [1, 50, 51]], n=2, seed=9, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    want = [one("hello", 9).choices[0].text, one("hello", 10).choices[0].text,
            one([1, 50, 51], 11).choices[0].text, one([1, 50, 51], 12).choices[0].text]
    assert [ch.text for ch in r.choices] == want
    assert r.usage.prompt_tokens == one("hello", 1).usage.prompt_tokens + 3
    # Streamed: every chunk names its choice; the texts by index are the non-streamed ones.
    texts, finishes, usage = {}, {}, None
    for chunk in c.completions.create(prompt=["hello", [1, 50, 51]], n=2, seed=9, stream=True,
                                      stream_options={"include_usage": True}, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
        usage = chunk.usage or usage
    assert [texts[i] for i in range(4)] == want and sorted(finishes) == [0, 1, 2, 3]
    assert usage.completion_tokens == r.usage.completion_tokens
    # Chat: n choices, each with its message; streamed, each choice's first delta has the role.
    messages = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="a", messages=messages, n=2, seed=4, max_tokens=5, temperature=1.0)
    assert [ch.index for ch in r.choices] == [0, 1] and all(ch.message.role == "assistant" for ch in r.choices)
    got, roles = {}, Counter()
    for chunk in c.chat.completions.create(model="a", messages=messages, n=2, seed=4, max_tokens=5,
                                           temperature=1.0, stream=True):
        for ch in chunk.choices:
            got[ch.index] = got.get(ch.index, "") + (ch.delta.content or "")
            roles[ch.index] += ch.delta.role == "assistant"
    assert [got[0], got[1]] == [ch.message.content for ch in r.choices] and roles == {0: 1, 1: 1}


# -- HTTP: OPTIONS, CORS, HEAD, keep-alive ----------------------------------------------------

def test_cors_preflight_and_headers_for_allowed_origins_and_head(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--ctx", "128", "--cors-origin", "http://app.example",
                "--cors-origin", "https://ui.example:8443", "--api-key", "vk-cors")
    h = conn(d)
    h.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://ui.example:8443", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    r = h.getresponse()
    assert r.read() == b"" and r.status == 204   # no key needed: a preflight never carries one
    assert r.getheader("Access-Control-Allow-Origin") == "https://ui.example:8443"
    assert "POST" in r.getheader("Access-Control-Allow-Methods")
    assert r.getheader("Access-Control-Allow-Headers") == "authorization, content-type, x-stainless-os"
    assert r.getheader("Vary") == "Origin"
    # The real request: its reply carries the header too, an error's as well.
    body = json.dumps({"model": "a", "prompt": "x", "max_tokens": 1, "logit_bias": NO_EOG})
    h.request("POST", "/v1/completions", body, {"Origin": "http://app.example", "Authorization": "Bearer vk-cors",
                                                "Content-Type": "application/json"})
    r = h.getresponse()
    assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 1
    assert r.getheader("Access-Control-Allow-Origin") == "http://app.example"
    h.request("POST", "/v1/completions", json.dumps({"model": "zzz", "prompt": "x"}),
              {"Origin": "http://app.example", "Authorization": "Bearer vk-cors"})
    r = h.getresponse()
    assert r.status == 404 and r.getheader("Access-Control-Allow-Origin") == "http://app.example"
    r.read()
    # Another origin: answered, without the header (the browser then withholds the reply).
    h.request("GET", "/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer vk-cors"})
    r = h.getresponse()
    r.read()
    assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") is None
    # HEAD: a GET route's headers, no body; then the connection carries on.
    h.request("HEAD", "/v1/models", headers={"Authorization": "Bearer vk-cors"})
    r = h.getresponse()
    assert r.status == 200 and int(r.getheader("Content-Length")) > 10 and r.read() == b""
    h.request("HEAD", "/health")
    r = h.getresponse()
    assert r.status == 200 and r.read() == b""
    h.request("HEAD", "/v1/completions", headers={"Authorization": "Bearer vk-cors"})
    r = h.getresponse()
    assert r.status == 405 and r.read() == b"" and r.getheader("Allow") == "OPTIONS, POST"
    h.request("GET", "/health")
    r = h.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    # curl's `Expect: 100-continue` (a large body): the interim 100, without CORS headers, then the reply.
    host, port = d.member().endpoint.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n"
                     b"Authorization: Bearer vk-cors\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        interim = sock.recv(4096)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n") and b"Access-Control" not in interim, interim
        sock.sendall(body.encode())
        reply = b""
        while b"completion_tokens" not in reply:
            reply += sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200 ") and b"Access-Control-Allow-Origin: http://app.example" in reply
    # A bad --cors-origin is refused at start.
    bad = subprocess.run([sys.executable, "-m", "vramd.cli", "serve", str(llama), "--arena", str(arena),
                          "--name", "b", "--cors-origin", "http://x.example/path"], env=daemon_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cors origin 'http://x.example/path'" in bad.stderr + bad.stdout


def test_one_connection_carries_many_requests(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--ctx", "128")
    h = conn(d)
    body = json.dumps({"model": "a", "prompt": "x", "max_tokens": 2, "temperature": 0, "logit_bias": NO_EOG})
    first = None
    for i in range(6):
        h.request("GET", "/health")
        r = h.getresponse()
        assert r.status == 200 and r.read()
        first = first or h.sock
        h.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = h.getresponse()
        assert json.loads(r.read())["usage"]["completion_tokens"] == 2
        # A stream over HTTP/1.1 is chunked: the connection outlives it.
        h.request("POST", "/v1/completions", json.dumps({**json.loads(body), "stream": True}),
                  {"Content-Type": "application/json"})
        r = h.getresponse()
        assert r.getheader("Transfer-Encoding") == "chunked"
        events = [line for line in r.read().decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        assert h.sock is first, f"request {i}: http.client had to open a new connection"
    # Idle past the head timeout (5 s): a connection that served a request waits longer (20 s).
    time.sleep(6.5)
    h.request("GET", "/health")
    r = h.getresponse()
    assert r.status == 200 and r.read() and h.sock is first
    # The openai SDK's pooled httpx client: many requests, one TCP connection.  (Its sync client
    # closes a stream's connection after [DONE] without reading the body's end; its async client
    # drains it for HTTP/1.1 reuse: streams are counted there.)
    connects = []

    def trace(event, info):
        if event == "connection.connect_tcp.complete":
            connects.append(info)

    def hook(request):
        request.extensions["trace"] = trace
    with httpx.Client(event_hooks={"request": [hook]}) as http_client:
        c = client(d, http_client=http_client)
        for _ in range(5):
            assert c.completions.create(model="a", prompt="x", max_tokens=2,
                                        logit_bias=NO_EOG).usage.completion_tokens == 2
            assert [m.id for m in c.models.list().data] == ["a"]
            assert c.models.retrieve("a").id == "a"
    assert len(connects) == 1, f"{len(connects)} connections for 15 requests"

    async def async_hook(request):
        request.extensions["trace"] = async_trace

    async def async_trace(event, info):
        trace(event, info)

    async def many():
        async with httpx.AsyncClient(event_hooks={"request": [async_hook]}) as http_client:
            ac = openai.AsyncOpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0,
                                    timeout=120, http_client=http_client)
            for _ in range(5):
                r = await ac.completions.create(model="a", prompt="x", max_tokens=2, logit_bias=NO_EOG)
                assert r.usage.completion_tokens == 2
                text = ""
                async for chunk in await ac.chat.completions.create(
                        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True):
                    text += "".join(ch.delta.content or "" for ch in chunk.choices)
                assert isinstance(text, str)
    connects.clear()
    asyncio.run(many())
    assert len(connects) == 1, f"{len(connects)} connections for 10 requests (5 streamed)"


def test_a_stream_sends_headers_and_keep_alives_while_it_waits_and_then_its_error(arena, llama, daemons):
    d = daemons(arena, llama, "a", "--ctx", "128", "--wake-timeout", "5")
    d.ask("yield")
    def stream() -> tuple[float, list[str], list[float]]:
        h = conn(d)
        t0 = time.monotonic()
        h.request("POST", "/v1/chat/completions", json.dumps({
            "model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}),
            {"Content-Type": "application/json"})
        r = h.getresponse()   # the headers, while the GPU is someone else's
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        headers_after = time.monotonic() - t0
        lines, stamps = [], []
        while True:
            line = r.readline()
            if not line:
                break
            if line.strip():
                lines.append(line.decode().strip())
                stamps.append(time.monotonic() - t0)
            if line.strip() == b"data: [DONE]":
                break
        return headers_after, lines, stamps

    with gpu_held_elsewhere(arena):
        # Two streams: the first waits in the loop for the token, the second in the queue behind it
        # (each path sends its own keep-alives, and gives its own error after the headers).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(stream)
            time.sleep(0.5)
            second = pool.submit(stream)
            results = [first.result(60), second.result(60)]
    for headers_after, lines, stamps in results:
        assert headers_after < 2.0
        comments = [t for line, t in zip(lines, stamps) if line == ": keep-alive"]
        assert len(comments) >= 2 and comments[0] < 3.0, (lines, stamps)
        data = [line for line in lines if line.startswith("data: ")]
        error = json.loads(data[0].removeprefix("data: "))["error"]
        assert "for the GPU" in error["message"] and error["type"] == "service_unavailable", error
        assert data[-1] == "data: [DONE]" and len(data) == 2
    # The daemon is fine once the GPU is free; its log line says what the stream's error was.
    r = client(d).chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logit_bias=NO_EOG)
    assert r.usage.completion_tokens == 2
    assert sum(bool(re.search(r"status=200 .*error_status=503", line)) for line in d.lines) == 2, d.output


def test_aliases_and_cors_origins_from_a_config_file_and_their_checks(tmp_path, llama):
    from vramd.errors import UsageError
    from vramd.server.config import build
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'model = "{llama}"\naliases = ["gpt-4o-mini", "local"]\ncors-origins = ["*"]\n')
    c = build(cfg, {"aliases": None, "cors_origins": None})
    assert c.aliases == ["gpt-4o-mini", "local"] and c.cors_origins == ["*"]
    assert build(cfg, {"aliases": ["flag"]}).aliases == ["flag"]     # the flags replace the file's list
    for text, message in [('aliases = ["no spaces"]', "alias 'no spaces'"),
                          ('aliases = "one"\ncors_origins = ["https://x.example/"]', "cors origin 'https://x.example/'"),
                          ("aliases = [1]", "expected a list of strings"),
                          ("aliases = [" + ", ".join(f'"a{i}"' for i in range(17)) + "]", "17 aliases: at most 16")]:
        cfg.write_text(f'model = "{llama}"\n{text}\n')
        with pytest.raises(UsageError, match=re.escape(message)):
            build(cfg, {})


def test_ignore_eos_runs_past_the_end_of_generation_token_to_max_tokens(arena, llama, daemons):
    """llama.cpp's ignore_eos (fixed-length benchmark runs): the end-of-generation token (2), made
    greedy's first pick by a bias, ends the generation at once without it; with it, the generation
    goes on to max_tokens (completions and chat, streamed and not)."""
    d = daemons(arena, llama, "a", "--ctx", "128")
    c = client(d)
    eos_first = {"2": 100}
    r = c.completions.create(model="a", prompt=[1, 40, 41], max_tokens=6, temperature=0, logit_bias=eos_first)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="a", prompt=[1, 40, 41], max_tokens=6, temperature=0, logit_bias=eos_first,
                             logprobs=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].logprobs.tokens) == 6
    # Unbiased: the same tokens with or without it up to where greedy would have ended.
    plain = c.completions.create(model="a", prompt=[1, 40, 41], max_tokens=12, temperature=0, logprobs=0)
    free = c.completions.create(model="a", prompt=[1, 40, 41], max_tokens=12, temperature=0, logprobs=0,
                                extra_body={"ignore_eos": True})
    assert free.usage.completion_tokens == 12
    assert free.choices[0].logprobs.tokens[:plain.usage.completion_tokens] == plain.choices[0].logprobs.tokens
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="a", messages=msgs, max_tokens=5, temperature=0, logit_bias=eos_first)
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model="a", messages=msgs, max_tokens=5, temperature=0, logit_bias=eos_first,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    status, body = post(d, "/v1/completions", {"model": "a", "prompt": "x", "ignore_eos": "yes"})
    assert status == 400 and body["error"]["param"] == "ignore_eos", body

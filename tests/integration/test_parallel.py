"""Parallel slots and continuous batching in the daemon (`--parallel N`, issue 16), real daemons.

N clients at once (the openai client, streamed and not, greedy and seeded) each get the text
their request gives alone, and they were generated together (the slots were busy at once);
a request that joins a running generation; a streamed client that hangs up leaves the others
untouched and frees its slot; the queue bound counts what waits for a slot; two streams
paused by a peer's wakes resume to their unswitched texts.  The alone texts come from a
`--parallel 1` daemon of the same file: the one-slot path (Engine.generate), not the batch.
"""

import http.client
import json
import threading
import time
import urllib.parse
import urllib.request

import openai
import pytest

from tests.ggufgen.check import write_model

from .conftest import SHAPE
from .test_pause_resume import stream
from .test_shutdown import in_thread, post

CTX = 256
PROMPTS = [[1, 2, 3], [5, 9, 14, 2], [7], [3, 3, 8, 1, 60], [11, 4], [2, 40, 41]]


def client(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=300)


def body(i: int, n: int = 24) -> dict:
    """Request i: greedy for even i, seeded sampling for odd i."""
    b = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": n + 3 * i, "temperature": 0}
    if i % 2:
        b.update(temperature=0.9, seed=100 + i, top_k=20)
    return b


def complete(d, b: dict, streamed: bool) -> str:
    c = client(d)
    extra = {k: b[k] for k in ("seed",) if k in b}
    kw = dict(model=d.name, prompt=b["prompt"], max_tokens=b["max_tokens"], temperature=b["temperature"],
              extra_body={"top_k": b["top_k"]} if "top_k" in b else None, **extra)
    if streamed:
        return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)
    return c.completions.create(**kw).choices[0].text


class BusyWatch:
    """The most slots `vramd status` saw busy at once while the block ran."""

    def __init__(self, d):
        self.d, self.most, self._stop = d, 0, threading.Event()

    def __enter__(self):
        def watch():
            while not self._stop.is_set():
                self.most = max(self.most, self.d.ask("status")["slots"]["busy"])
                time.sleep(0.01)
        self._t = threading.Thread(target=watch, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)


@pytest.fixture
def pair(arena, tmp_path, daemons):
    """(alone, batched): daemons of one file, --parallel 1 and --parallel 4."""
    model = write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE)
    return (daemons(arena, model, "solo", "--parallel", "1", ctx=CTX),
            daemons(arena, model, "many", "--parallel", "4", ctx=CTX))


def test_concurrent_clients_each_get_their_solo_text(pair):
    solo, many = pair
    n = 6   # more requests than slots: two wait for a slot and join as others leave
    alone = [complete(solo, body(i), streamed=False) for i in range(n)]
    assert len(set(alone)) > 1
    many.ask("wake")
    outs = [in_thread(complete, many, body(i), i % 3 != 0) for i in range(n)]
    with BusyWatch(many) as watch:
        for o in outs:
            o["thread"].join(300)
    for i, o in enumerate(outs):
        assert "error" not in o, o.get("error")
        assert o["result"] == alone[i], f"request {i} gave another text batched than alone"
    assert watch.most >= 2, "the requests were not generated together"
    st = many.ask("status")["slots"]
    assert st["parallel"] == 4 and st["busy"] == 0 and st["queued"] == 0


def test_a_request_that_joins_a_running_generation(pair):
    solo, many = pair
    long, short = {**body(0), "max_tokens": 200}, body(1)
    alone_long, _ = stream(solo.member().endpoint + "/v1/completions", long)
    alone_short = complete(solo, short, streamed=False)
    many.ask("wake")
    lines: list[str] = []
    first = in_thread(stream, many.member().endpoint + "/v1/completions", long, lines)
    while sum(x.startswith("data: {") for x in lines) < 5:   # it is generating
        assert "at" not in first
        time.sleep(0.01)
    joined = complete(many, short, streamed=True)
    assert "at" not in first, "the short request waited for the long one's whole generation"
    first["thread"].join(300)
    assert joined == alone_short
    assert first["result"][0] == alone_long


def test_a_client_that_hangs_up_leaves_the_others_untouched(pair):
    solo, many = pair
    b = {**body(2), "max_tokens": 120}
    alone = complete(solo, b, streamed=False)
    many.ask("wake")
    u = urllib.parse.urlsplit(many.member().endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body(0), "max_tokens": 200, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    other = in_thread(complete, many, b, True)
    seen = 0
    while seen < 3:
        seen += r.readline().startswith(b"data: {")
    conn.sock.close()   # hang up mid-stream
    conn.close()
    other["thread"].join(300)
    assert other["result"] == alone
    deadline = time.monotonic() + 10
    while many.ask("status")["slots"]["busy"]:
        assert time.monotonic() < deadline, many.output
        time.sleep(0.02)
    assert many.ask("status")["engine"]["generated_tokens"] < 200 + 120


def test_the_queue_bound_counts_requests_waiting_for_a_slot(arena, tmp_path, daemons):
    model = write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE)
    a = daemons(arena, model, "alpha", "--parallel", "2", "--max-queue", "1", ctx=512)
    url = a.member().endpoint + "/v1/completions"
    a.ask("wake")
    lines = [[], []]
    running = [in_thread(stream, url, {"prompt": [1, 2, 3 + i], "max_tokens": 480, "temperature": 0}, lines[i])
               for i in range(2)]
    deadline = time.monotonic() + 30
    while a.ask("status")["slots"]["busy"] < 2:   # both slots generate
        assert time.monotonic() < deadline and all("at" not in r for r in running), a.output
        time.sleep(0.01)
    third = in_thread(post, url, {"prompt": [1, 4], "max_tokens": 2})
    while a.ask("status")["slots"]["queued"] < 1:   # it waits for a slot
        assert time.monotonic() < deadline and all("at" not in r for r in running), a.output
        time.sleep(0.01)
    status, reply = post(url, {"prompt": [1, 5], "max_tokens": 2})
    assert status == 503 and "--max-queue 1" in reply["error"]["message"], reply
    third["thread"].join(120)
    assert third["result"][0] == 200, third
    for r in running:
        r["thread"].join(120)
        assert "error" not in r, r.get("error")


@pytest.mark.parametrize("flags", [(), ("--residency", "exclusive", "--evict-state", "always")],
                         ids=["cache", "exclusive-always"])
def test_two_streams_paused_by_a_peer_resume_to_their_texts(arena, tmp_path, daemons, flags):
    model = write_model(tmp_path / "alpha.gguf", seed=1, shape=SHAPE)
    solo = daemons(arena, model, "solo", "--parallel", "1", *flags, ctx=CTX)
    a = daemons(arena, model, "alpha", "--parallel", "2", *flags, ctx=CTX)
    b = daemons(arena, write_model(tmp_path / "beta.gguf", seed=2, shape=SHAPE), "beta", *flags)
    url = a.member().endpoint + "/v1/completions"
    bodies = [{**body(0), "max_tokens": 200}, {**body(1), "max_tokens": 200}]
    alone = [stream(solo.member().endpoint + "/v1/completions", x)[0] for x in bodies]
    a.ask("wake")
    pauses = a.ask("status")["slots"]["pauses_total"]
    outs = [in_thread(stream, url, x) for x in bodies]
    wakes = 0
    while any("at" not in o for o in outs):
        wakes += b.ask("wake")["was_cold"]
        time.sleep(0.05)
    for o, text in zip(outs, alone):
        assert "error" not in o, o.get("error")
        assert o["result"][0] == text, "a paused and resumed batched generation gave another text"
    assert wakes >= 2 and a.ask("status")["slots"]["pauses_total"] - pauses >= 2, a.output
    metrics = urllib.request.urlopen(a.member().endpoint + "/metrics", timeout=10).read().decode()
    assert 'vramd_slots{name="alpha"} 2' in metrics

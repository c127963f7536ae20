"""The OpenAI-compatible API of real daemons, driven by the official `openai` client."""

import json
import threading
import time
import urllib.request

import openai
import pytest

from tests.ggufgen.llama import write_llama

from .conftest import DaemonProc, gpu_held_elsewhere


@pytest.fixture
def llamas(tmp_path):
    a = write_llama(tmp_path / "a.gguf", seed=21, n_vocab=384, vocab="spm")
    b = write_llama(tmp_path / "b.gguf", seed=22, n_vocab=384, vocab="spm")
    return a, b


def client(d: DaemonProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(c, prompt, n=16, **kw):
    r = c.completions.create(model=kw.pop("model", "a"), prompt=prompt, max_tokens=n, temperature=0, **kw)
    return r.choices[0].text, r


def test_models_completions_chat_stream_logprobs_echo(arena, llamas, daemons):
    d = daemons(arena, llamas[0], "a", "--ctx", "256")
    c = client(d)
    # The model once (issue 18: UIs showed the name and the file name as two models); the file's name
    # is still taken as a request's model.
    assert [m.id for m in c.models.list().data] == ["a"]
    text, r = greedy(c, "hello there", n=8, logprobs=3)
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason == "length"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 8 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)  # a dict: equal texts merge
    assert all(v <= 0 for v in lp.token_logprobs)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="a", prompt="hello there", max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert streamed == text
    echo, _ = greedy(c, "hello there", n=4, echo=True)
    assert echo.startswith("hello there")
    ids_prompt, _ = greedy(c, [1, 40, 41, 42], n=6)
    assert isinstance(ids_prompt, str)
    chat = c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                     temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    chunks = list(c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_errors_have_openai_shape_and_status(arena, llamas, daemons, tmp_path):
    d = daemons(arena, llamas[0], "a", "--ctx", "64", "--wake-timeout", "1")
    c = client(d)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="a", prompt="x", temperature=7)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="a", prompt=[5] * 100)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        c.completions.create(model="a", prompt=[10**6])
    # A holder that never yields: the request gets 503 after --wake-timeout.
    d.ask("yield")
    with gpu_held_elsewhere(arena):
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="a", prompt="x", max_tokens=2)
        assert e.value.status_code == 503
    assert greedy(c, "x", n=2)[1].usage.completion_tokens == 2   # fine again once the GPU is free


def test_concurrent_requests_queue_and_none_is_lost(arena, llamas, daemons):
    d = daemons(arena, llamas[0], "a", "--ctx", "128")
    c = client(d)
    want, _ = greedy(c, "the same prompt", n=6)
    results, errors = [], []

    def one():
        try:
            results.append(greedy(c, "the same prompt", n=6)[0])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and results == [want] * 6


def test_a_client_that_disconnects_mid_stream_frees_the_slot(arena, llamas, daemons):
    d = daemons(arena, llamas[0], "a", "--ctx", "512")
    url = d.member().endpoint + "/v1/completions"
    body = json.dumps({"model": "a", "prompt": "go", "max_tokens": 400, "temperature": 0, "stream": True}).encode()
    resp = urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=60)
    assert resp.readline().startswith(b"data: ")
    resp.close()   # hang up after the first token
    t0 = time.monotonic()
    text, _ = greedy(client(d), "next", n=2)   # served as soon as the abandoned generation stops
    assert time.monotonic() - t0 < 60
    assert d.ask("status")["state"] == "warm"


def test_outputs_unchanged_by_50_switches_and_prefix_reuse(arena, llamas, daemons):
    a = daemons(arena, llamas[0], "a", "--ctx", "256", "--residency", "exclusive", "--evict-state", "always")
    b = daemons(arena, llamas[1], "b", "--ctx", "256", "--residency", "exclusive", "--evict-state", "always")
    ca, cb = client(a), client(b)
    prompt = "one two three four"
    want_a, _ = greedy(ca, prompt, n=12, model="a")
    want_b, _ = greedy(cb, prompt, n=12, model="b")
    assert want_a != want_b   # two different models
    for _ in range(25):   # 50 switches, each evicting the KV cache to the host and back
        assert greedy(cb, prompt, n=12, model="b")[0] == want_b
        assert greedy(ca, prompt, n=12, model="a")[0] == want_a
    assert a.member().switches >= 25 and b.member().switches >= 25
    # Prefix reuse: a follow-up that extends the cached prompt computes only the new part,
    # and gives what a fresh daemon computes from scratch.
    follow = prompt + want_a + " and more"
    reused_before = a.ask("status")["engine"]["reused_tokens"]
    got, _ = greedy(ca, follow, n=8, model="a")
    assert a.ask("status")["engine"]["reused_tokens"] > reused_before
    a.stop()
    fresh = daemons(arena, llamas[0], "a2", "--ctx", "256")
    assert greedy(client(fresh), follow, n=8, model="a2")[0] == got


def test_a_qwen2_model_with_a_bpe_vocabulary_chats(arena, tmp_path, daemons):
    path = write_llama(tmp_path / "q.gguf", arch="qwen2", vocab="bpe", seed=5, n_vocab=384)
    d = daemons(arena, path, "q", "--ctx", "256")
    c = client(d)
    r = c.chat.completions.create(model="q", messages=[{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "hello, world"}],
                                  max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens > 4 and r.usage.completion_tokens >= 1
    again = c.chat.completions.create(model="q", messages=[{"role": "user", "content": "hello, world"}],
                                      max_tokens=6, temperature=0, seed=3)
    assert isinstance(again.choices[0].message.content, str)


def test_stop_strings_seed_and_sampling_through_the_api(arena, llamas, daemons):
    d = daemons(arena, llamas[0], "a", "--ctx", "256")
    c = client(d)
    full, _ = greedy(c, "hello there", n=16)
    cut = full[len(full) // 2:len(full) // 2 + 2]
    assert cut
    text, r = greedy(c, "hello there", n=16, stop=[cut])
    assert text == full[:full.index(cut)] and r.choices[0].finish_reason == "stop"

    def sampled(seed):
        return c.completions.create(model="a", prompt="hello there", max_tokens=12, temperature=1.0, top_p=0.9,
                                    seed=seed, extra_body={"top_k": 40, "min_p": 0.01}).choices[0].text
    assert sampled(7) == sampled(7)                     # the same seed, the same draw
    assert len({sampled(s) for s in range(6)}) > 1      # other seeds draw otherwise

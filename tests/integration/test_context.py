"""Issue 21, item 5: the context a daemon picks, and what a prompt or a generation longer than it gets.

Real daemons on small synthetic models (tests/ggufgen): --ctx defaults to the
file's context length capped by what fits, with one line saying so; a prompt
that does not fit is a 400 naming the way out; --context-overflow
truncate-oldest and shift cut what they say they cut, and say so in
usage.context (vramd/engine/overflow.py).
"""

import json
import urllib.error
import urllib.request

import pytest

from tests.ggufgen.llama import write_llama

from .conftest import planned


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


@pytest.fixture
def long_model(tmp_path):
    """A model whose file says 4096 (what a 32,768 file is to a real GPU)."""
    return write_llama(tmp_path / "long.gguf", seed=3, n_vocab=384, vocab="spm", context_length=4096)


def test_ctx_defaults_to_the_files_context_length_capped_by_what_fits(arena, long_model, daemons):
    d = daemons(arena, long_model, "whole", ctx=0)
    assert d.ask("status")["ctx"] == 4096
    assert "whole: --ctx 4096: the file's context length 4096; its KV cache fits" in d.output, d.output
    assert d.stop() == 0
    # A budget that holds the weights and a KV cache of 2048 positions, not of 2304.
    budget = planned(long_model, 2048, n_seq=1).device_bytes + 1024   # (then one slot: two do not fit)
    assert planned(long_model, 2304, n_seq=1).device_bytes > budget
    d = daemons(arena, long_model, "capped", "--vram-budget", str(budget), ctx=0)
    assert d.ask("status")["ctx"] == 2048
    assert "capped: --ctx 2048: the largest whose KV cache fits the budget" in d.output, d.output


def test_an_explicit_ctx_past_the_files_gets_a_word(arena, tmp_path, daemons):
    m = write_llama(tmp_path / "short.gguf", seed=4, n_vocab=384, vocab="spm", context_length=32)
    d = daemons(arena, m, "short", ctx=64)
    assert d.ask("status")["ctx"] == 64 and "more than the 32 the model was trained for" in d.output


@pytest.fixture
def chat_model(tmp_path):
    return write_llama(tmp_path / "chat.gguf", seed=7, n_vocab=384, vocab="spm", context_length=4096)


def history(turns):
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question number {i} about tok{i} and more words here"})
        msgs.append({"role": "assistant", "content": f"answer {i} with some words"})
    msgs.append({"role": "user", "content": "the last question"})
    return msgs


def test_a_prompt_longer_than_the_context_is_a_clear_400_by_default(arena, chat_model, daemons):
    d = daemons(arena, chat_model, "strict")   # --ctx 64
    url = d.member().endpoint
    status, body, _ = post(url + "/v1/completions", {"prompt": [1] + list(range(10, 110)), "max_tokens": 4})
    assert status == 400, body
    msg = body["error"]["message"]
    assert "the prompt has 101 tokens; the context holds 64" in msg and "--context-overflow" in msg, msg
    status, body, _ = post(url + "/v1/chat/completions", {"messages": history(12), "max_tokens": 4})
    assert status == 400 and "context of 64 tokens" in body["error"]["message"], body   # refused untokenized
    assert "--context-overflow truncate-oldest" in body["error"]["message"]
    status, body, _ = post(url + "/v1/chat/completions", {"messages": history(2), "max_tokens": 4})
    assert status == 400 and "the context holds 64" in body["error"]["message"], body


def test_truncate_oldest_drops_the_oldest_turns_and_says_so(arena, chat_model, daemons):
    d = daemons(arena, chat_model, "cut", "--context-overflow", "truncate-oldest")   # --ctx 64
    url = d.member().endpoint + "/v1/chat/completions"
    msgs = history(12)
    status, body, headers = post(url, {"messages": msgs, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    ctx_info = body["usage"]["context"]
    k = ctx_info["dropped_messages"]
    assert ctx_info["policy"] == "truncate-oldest" and k > 0 and ctx_info["dropped_tokens"] > 0
    assert body["usage"]["prompt_tokens"] + 4 <= 64
    assert headers["X-Vramd-Context-Dropped"].startswith(f"policy=truncate-oldest; messages={k}; ")
    # What it kept is the system message and the newest turns: asking with exactly those is the same
    # prompt (same tokens, same greedy reply) and drops nothing.
    kept = msgs[:1] + msgs[1 + k:]
    status, again, headers = post(url, {"messages": kept, "max_tokens": 4, "temperature": 0})
    assert status == 200 and "context" not in again["usage"] and "X-Vramd-Context-Dropped" not in headers
    assert again["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert again["choices"][0]["message"] == body["choices"][0]["message"]
    # Whole turns, so that the kept history starts with a user message; and the fewest: one turn
    # (a question and its answer) fewer dropped would not fit.
    assert kept[1]["role"] == "user" and k % 2 == 0
    status, more, _ = post(url, {"messages": msgs[:1] + msgs[k - 1:], "max_tokens": 4, "temperature": 0})
    assert status == 200 and more["usage"]["context"]["dropped_messages"] == 2


def test_truncate_oldest_cuts_a_completion_prompt_keeping_its_bos(arena, chat_model, daemons):
    d = daemons(arena, chat_model, "cut", "--context-overflow", "truncate-oldest")
    url = d.member().endpoint + "/v1/completions"
    ids = [1] + [10 + i % 300 for i in range(100)]
    status, body, _ = post(url, {"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 60 and body["usage"]["context"]["dropped_tokens"] == 41
    status, same, _ = post(url, {"prompt": ids[:1] + ids[-59:], "max_tokens": 4, "temperature": 0})
    assert same["choices"][0]["text"] == body["choices"][0]["text"] and "context" not in same["usage"]


def test_shift_generates_past_the_context_dropping_the_oldest_half(arena, chat_model, daemons):
    d = daemons(arena, chat_model, "shifty", "--context-overflow", "shift")   # --ctx 64
    url = d.member().endpoint + "/v1/completions"
    ids = [1] + [10 + i for i in range(39)]
    status, body, headers = post(url, {"prompt": ids, "max_tokens": 80, "temperature": 0})
    assert status == 200, body
    u = body["usage"]
    # Without a shift the context would stop it at 24 tokens (finish "length" at 64 positions).
    assert u["completion_tokens"] > 64 - 40, body
    c = u["context"]
    assert c["policy"] == "shift" and c["shifts"] >= 1 and c["dropped_tokens"] > 0 and c["dropped_messages"] == 0
    assert "shifts=" in headers["X-Vramd-Context-Dropped"]
    d2 = daemons(arena, chat_model, "plain")   # the same model without a policy stops at the context
    status, plain, _ = post(d2.member().endpoint + "/v1/completions",
                            {"prompt": ids, "max_tokens": 80, "temperature": 0})
    assert plain["usage"]["completion_tokens"] <= 24 and "context" not in plain["usage"]
    # Up to the first shift both generate the same greedy tokens (the prompt was not cut: it fits).
    assert u["prompt_tokens"] == 40
    assert body["choices"][0]["text"].startswith(plain["choices"][0]["text"])

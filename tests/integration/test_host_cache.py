"""The host prompt cache (--cache-ram, issue 16): a returning conversation after another one used the slot.

Real daemon, lavapipe.  Conversation A, then B in the one slot (A's tokens and K/V rows go to
the host), then A again: its prompt is not prefilled again but brought back from the host cache
(`usage.prompt_tokens_details.cached_tokens`, /metrics, `vramd status`), and its greedy text is
the text it had.  With two slots (the batch session's path) it takes A, B and C for C to reuse
A's slot; A then comes back into the least recently used slot (B's).  The bound evicts the
least recently used sequence.
"""

import json
import subprocess
import sys
import urllib.request

import pytest

from tests.ggufgen.check import ModelShape, write_model

from .conftest import ROOT, daemon_env
from .test_shutdown import post

# 4 KiB of K/V per token (2 layers, K and V, 512 wide, f16): a 150-token sequence is 600 KiB, so
# a 1 MiB cache holds one of them.
WIDE = ModelShape(n_vocab=128, n_embd=512, n_ff=512, n_layer=2, n_head=8)
CTX = 256
LEN = 150


def prompt(first: int) -> list[int]:
    return [first] + [(first * 7 + i * 13) % 120 + 4 for i in range(LEN - 1)]


def complete(url: str, ids: list[int]) -> dict:
    status, body = post(url, {"prompt": ids, "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    return body


def metric(d, name: str) -> int:
    text = urllib.request.urlopen(d.member().endpoint + "/metrics", timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith(f'{name}{{name="{d.name}"}}'))
    return int(float(line.split()[-1]))


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_returning_conversation_is_served_from_the_host_cache(arena, tmp_path, daemons, parallel):
    model = write_model(tmp_path / "wide.gguf", seed=3, shape=WIDE)
    d = daemons(arena, model, "wide", "--cache-ram", "8", "--parallel", str(parallel), ctx=CTX)
    url = d.member().endpoint + "/v1/completions"
    a, others = prompt(1), [prompt(2 + i) for i in range(parallel)]
    first = complete(url, a)
    assert cached(first) == 0
    for b in others:
        assert cached(complete(url, b)) == 0       # the last of them takes A's slot: A goes to the host
    again = complete(url, a)                        # and comes back: only its last token prefilled
    assert cached(again) == LEN - 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert metric(d, "vramd_host_cache_hits_total") == 1
    assert metric(d, "vramd_host_cache_tokens_total") >= LEN
    assert metric(d, "vramd_host_cache_bytes") >= 2 * LEN * 4096   # A (with its reply) and the slot it took saved
    status = json.loads(subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--json", "--arena", str(arena)],
                                       capture_output=True, text=True, env=daemon_env(), cwd=ROOT,
                                       timeout=60).stdout)
    hc = status["members"][0]["daemon"]["host_cache"]
    assert hc["hits"] == 1 and hc["entries"] == 2 and hc["limit_bytes"] == 8 << 20
    people = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena)],
                            capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=60).stdout
    assert "cache   wide: host prompt cache" in people and "1 hits" in people, people


def test_the_bound_evicts_the_least_recently_used_sequence(arena, tmp_path, daemons):
    model = write_model(tmp_path / "wide.gguf", seed=3, shape=WIDE)
    d = daemons(arena, model, "wide", "--cache-ram", "1", "--parallel", "1", ctx=CTX)
    url = d.member().endpoint + "/v1/completions"
    a, b, c = prompt(1), prompt(2), prompt(3)
    complete(url, a)
    complete(url, b)     # A saved
    complete(url, c)     # B saved: A is evicted for it (1 MiB holds one)
    assert metric(d, "vramd_host_cache_evictions_total") == 1
    # B was kept (C is not saved for it: that would evict the sequence this request brings back)
    assert cached(complete(url, b)) == LEN - 1
    assert cached(complete(url, a)) == 0            # A was the least recently used: prefilled again
    assert metric(d, "vramd_host_cache_evictions_total") == 1
    assert metric(d, "vramd_host_cache_bytes") <= 1 << 20


def test_cache_ram_zero_keeps_nothing(arena, tmp_path, daemons):
    model = write_model(tmp_path / "wide.gguf", seed=3, shape=WIDE)
    d = daemons(arena, model, "wide", "--cache-ram", "0", "--parallel", "1", ctx=CTX)
    url = d.member().endpoint + "/v1/completions"
    complete(url, prompt(1))
    complete(url, prompt(2))
    assert cached(complete(url, prompt(1))) == 0
    assert metric(d, "vramd_host_cache_entries") == 0

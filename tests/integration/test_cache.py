"""VRAM as a shared cache (--residency cache, the default): park, evict only what is needed."""

import json
import subprocess
import sys
import time

import pytest

from tests.arena.test_llama_peer import CPeer
from tests.ggufgen.check import write_model
from vramd.arena.members import Member
from vramd.arena.token import Token

from .conftest import ROOT, SHAPE, daemon_env, planned


def device(d) -> int:
    return d.member().device_bytes()


def total(d) -> int:
    return d.member().host_bytes()


def compute(d) -> None:
    """One real request, so the daemon's compute scratch is on the device too."""
    import openai
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    c.completions.create(model=d.name, prompt=[1, 2, 3], max_tokens=1, temperature=0)


def footprint(model) -> int:
    """What a model needs on the device to run: weights, KV cache and compute scratch
    (what it asks for when it first goes warm: its member record's wants_bytes)."""
    return planned(model).device_bytes


@pytest.fixture
def three(tmp_path):
    return [write_model(tmp_path / f"m{i}.gguf", seed=10 + i, shape=SHAPE) for i in range(3)]


def greedy_text(d) -> str:
    import openai
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.completions.create(model=d.name, prompt=[1, 7, 9], max_tokens=6, temperature=0).choices[0].text


def test_models_that_fit_together_switch_back_with_no_upload(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    before = greedy_text(a)
    b = daemons(arena, models[1], "beta")   # alpha parks, beta uploads
    assert a.member().state == "parked" and device(a) >= total(a)   # all of it stayed (scratch too)
    for _ in range(10):
        for d in (a, b):
            r = d.ask("wake")
            assert r["was_cold"] and r["moved_bytes"] == 0, r
    assert greedy_text(a) == before   # outputs unchanged by parking
    assert device(a) >= total(a) and device(b) >= total(b)
    assert a.ask("verify")["weights_ok"] and b.ask("verify")["weights_ok"]
    assert a.ask("status")["evictions"] == 0 and b.ask("status")["evictions"] == 0


def test_three_models_any_two_fit_evicts_exactly_the_lru(arena, three, daemons):
    one = footprint(three[0])   # the three are the same shape
    budget = str(2 * one + one // 2)
    a = daemons(arena, three[0], "a", "--vram-budget", budget)
    compute(a)
    b = daemons(arena, three[1], "b", "--vram-budget", budget)
    compute(b)
    c = daemons(arena, three[2], "c", "--vram-budget", budget)   # needs room: a is the LRU
    # Only a gave anything up, and only what c needed (scratch first, then state, then weights).
    assert device(a) < one and device(b) == one and device(c) == total(c)
    assert a.ask("status")["evictions"] == 1 and b.ask("status")["evictions"] == 0
    compute(b)                                                  # b was parked: nothing to upload
    assert device(b) == one and b.ask("status")["evictions"] == 0
    for d in (a, b, c):
        assert d.ask("verify")["weights_ok"]


def test_a_pinned_model_is_never_evicted(arena, three, daemons):
    one = footprint(three[0])   # the three are the same shape
    budget = str(2 * one + one // 2)
    a = daemons(arena, three[0], "a", "--vram-budget", budget, "--pin")
    compute(a)
    b = daemons(arena, three[1], "b", "--vram-budget", budget)
    compute(b)
    for _ in range(3):
        c = daemons(arena, three[2], "c", "--vram-budget", budget)   # a is the LRU but pinned
        compute(c)
        assert device(a) == one and device(b) < one
        compute(b)                                                   # now c must give, not a
        assert device(a) == one and device(c) < one
        assert c.stop() == 0
    assert a.ask("status")["evictions"] == 0


def test_priority_keeps_a_model_resident_over_a_more_recent_one(arena, three, daemons):
    one = footprint(three[0])   # the three are the same shape
    budget = str(2 * one + one // 2)
    a = daemons(arena, three[0], "a", "--vram-budget", budget, "--priority", "5")
    compute(a)
    b = daemons(arena, three[1], "b", "--vram-budget", budget)
    compute(b)
    c = daemons(arena, three[2], "c", "--vram-budget", budget)
    assert device(a) == one and device(b) < one   # a is older but worth 5 minutes more
    assert a.ask("status")["evictions"] == 0 and b.ask("status")["evictions"] == 1


def test_priority_ages():
    old_vip = Member(name="vip", pid=1, start_time=0, last_used=0.0, priority=5)
    recent = Member(name="recent", pid=2, start_time=0, last_used=100.0)
    stale = Member(name="stale", pid=3, start_time=0, last_used=1000.0)
    assert sorted([old_vip, recent], key=Member.eviction_key)[0] is recent
    assert sorted([old_vip, stale], key=Member.eviction_key)[0] is old_vip  # unused for long: its turn


def test_a_flock_only_peer_gets_an_empty_gpu(arena, models, daemons, llama_peer_bin):
    a = daemons(arena, models[0], "alpha")
    b = daemons(arena, models[1], "beta")   # alpha parked, beta warm
    assert device(a) > 0 and device(b) > 0
    c = CPeer(llama_peer_bin, arena)
    try:
        c.send("warm")
        assert c.read(timeout=30).startswith("warm")
        deadline = time.monotonic() + 10
        while (device(a) or device(b)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert device(a) == 0 and device(b) == 0, "a foreign peer got a GPU that was not empty"
        assert Token(arena / "token.lock").holders() == [c.pid]
        c.send("serve")
        assert a.ask("verify")["weights_ok"]   # everything comes back, nothing lost
        assert c.read().startswith("cold")
    finally:
        c.close()


def test_status_shows_parked_members_free_memory_and_eviction_order(arena, three, daemons):
    a = daemons(arena, three[0], "a", "--vram-budget", "64MiB")
    b = daemons(arena, three[1], "b", "--vram-budget", "64MiB", "--pin")
    c = daemons(arena, three[2], "c", "--vram-budget", "64MiB")
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--json", "--arena", str(arena)],
                       capture_output=True, text=True, env=daemon_env(), cwd=ROOT)
    s = json.loads(r.stdout)
    states = {m["name"]: m["state"] for m in s["members"]}
    assert states == {"a": "parked", "b": "parked", "c": "warm"}
    assert s["budget_bytes"] == 64 << 20
    assert s["free_bytes"] == s["budget_bytes"] - sum(m["device_total"] for m in s["members"])
    assert s["eviction_order"] == ["a"]   # b is pinned, c holds the token
    text = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena)],
                          capture_output=True, text=True, env=daemon_env(), cwd=ROOT).stdout
    assert "parked pinned" in text and "evicts  a" in text and "free" in text

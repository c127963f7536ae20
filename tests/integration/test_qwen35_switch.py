"""A qwen35 model's recurrent state survives 50 switches, in real `vramd serve` processes (issue 17).

A qwen35 daemon and a peer (a tiny llama) share one arena, both `--residency exclusive`;
with `--evict-state always` each time the peer wakes, the qwen35 daemon goes cold and its whole
`state` region (K/V of the attention layers, the DeltaNet layers' conv and delta-rule state
and their checkpoint) goes to host memory and its device copy is freed; its next request
brings it back (with `auto`, room for both, the state stays parked on the device while
the weights go and come back).  A 50-turn conversation, each turn continuing the recurrent state where
the last one left it (the prompt extends everything the state holds: no re-prefill), gives
the same text cycle by cycle as the same conversation with no switch; the state region is
bit for bit what it was before each cold/warm cycle; and after the switches a request
resumed from the checkpoint equals the same request computed from position 0.

The conversation is the numpy reference's greedy continuation of PROMPT (only to have
token ids the daemon's own greedy picks agree with, so each turn extends the state: the
daemon returns text, not ids); the oracle of the switched run is the unswitched run.
"""

import time

import numpy as np
import openai
import pytest

from tests.engine.conformance.cases import write_case
from tests.ggufgen.check import write_model

from .conftest import SHAPE

PROMPT = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2, 90, 91, 92, 300, 301, 7]
TURNS = 50


def forced_tokens(path, n: int) -> list[int]:
    from tests.engine.reference.qwen35 import Qwen35Reference
    ids, _ = Qwen35Reference(path).greedy_logits(PROMPT, n, kv_dtype=np.float16)
    return [int(t) for t in ids]


def engine_stats(d) -> dict:
    return d.ask("status")["engine"]


def device_state(d) -> int:
    return d.member().breakdown["state"]["device"]


def converse(c, qwen, ref, between=None) -> tuple[list[str], list[int]]:
    """TURNS turns; turn i's prompt is PROMPT + ref[:2i] (the last turn's prompt and its reply,
    when the daemon picked ref[2i-2], and one more token): one token each.  Returns the texts
    and the tokens each turn reused (the state's length when it continued)."""
    texts, reused = [], []
    for i in range(TURNS):
        if between:
            between(i)
        before = engine_stats(qwen)["reused_tokens"]
        r = c.completions.create(model="qwen", prompt=PROMPT + ref[:2 * i], max_tokens=1, temperature=0)
        texts.append(r.choices[0].text)
        reused.append(engine_stats(qwen)["reused_tokens"] - before)
    return texts, reused


@pytest.mark.parametrize("evict", ["always", "auto"])
def test_qwen35_state_survives_50_switches(arena, tmp_path, daemons, evict):
    """always: the state goes to the host and back each time; auto (room for both): it stays
    parked on the device while the weights go, and the decode step runs on weights uploaded again."""
    FLAGS = ("--residency", "exclusive", "--evict-state", evict)
    # One slot: the last part has another prompt take the slot and move its checkpoint away (with
    # several, a new prompt takes a free slot; tests/integration/test_pause_resume.py has a qwen35
    # generation paused and resumed in the batch of the default slots).
    path = write_case("qwen35", "Q4_K", tmp_path / "qwen35.gguf")
    ref = forced_tokens(path, 2 * TURNS)
    qwen = daemons(arena, path, "qwen", *FLAGS, "--parallel", "1", ctx=256, wait_ready=False)
    peer = daemons(arena, write_model(tmp_path / "peer.gguf", seed=3, shape=SHAPE), "peer", *FLAGS, wait_ready=False)
    qwen.wait_ready(120)
    peer.wait_ready(120)
    c = openai.OpenAI(base_url=qwen.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)

    qwen.ask("wake")
    switches = qwen.member().switches
    t0 = time.monotonic()
    want, want_reused = converse(c, qwen, ref)
    solo_s = time.monotonic() - t0
    assert qwen.member().switches == switches, "the unswitched run switched"
    # The turns really continued the state (the daemon agreed with the reference's picks), not re-prefilled.
    # (the state continued holds the last turn's prompt: its one-token reply ended it unfed)
    continued = [i for i in range(1, TURNS) if want_reused[i] == len(PROMPT) + 2 * i - 2]
    assert len(continued) >= TURNS - 5, want_reused

    d2h = qwen.member().bytes_d2h
    state_bytes = qwen.member().breakdown["state"]["host"]

    def switch(i):
        """The peer takes the GPU: the qwen35 daemon's state goes to the host; verify (which
        wakes it) reads the state region back: bit for bit what it was before going cold."""
        if i == 0:
            return
        before = qwen.ask("verify")["kv_sha256"]
        peer.ask("wake")
        m = qwen.member()
        assert m.breakdown["weights"]["device"] == 0
        if evict == "always":
            assert m.state == "cold" and device_state(qwen) == 0
        else:
            assert m.state == "parked" and device_state(qwen) == state_bytes
        assert qwen.ask("verify")["kv_sha256"] == before
        peer.ask("wake")   # cold again: the turn's request itself brings it back

    t0 = time.monotonic()
    got, got_reused = converse(c, qwen, ref, between=switch)
    switched_s = time.monotonic() - t0
    assert got == want
    assert got_reused[1:] == want_reused[1:]      # the same turns continued the state
    m = qwen.member()
    assert m.switches >= switches + 2 * (TURNS - 1)
    if evict == "always":   # the state really went to the host, twice a turn
        assert m.bytes_d2h - d2h >= 2 * (TURNS - 1) * state_bytes

    # After the switches: a prompt that leaves the last one at its last token (the state, after
    # all of it, cannot go back) resumes from the checkpoint after all but that token (restored
    # from the host with the rest) and equals the same prompt from position 0.
    last = PROMPT + ref[:2 * (TURNS - 1)]
    more = last[:-1] + [123, 45]
    peer.ask("wake")
    before = engine_stats(qwen)["reused_tokens"]
    resumed = c.completions.create(model="qwen", prompt=more, max_tokens=4, temperature=0).choices[0].text
    assert engine_stats(qwen)["reused_tokens"] - before == len(last) - 1   # from the checkpoint
    c.completions.create(model="qwen", prompt=[5, 6, 7], max_tokens=1, temperature=0)   # the checkpoint moves away
    before = engine_stats(qwen)["reused_tokens"]
    fresh = c.completions.create(model="qwen", prompt=more, max_tokens=4, temperature=0).choices[0].text
    assert engine_stats(qwen)["reused_tokens"] == before   # computed from position 0
    assert resumed == fresh
    assert qwen.ask("verify")["weights_ok"]
    print(f"\n--evict-state {evict}: {TURNS} turns ({len(continued)} continued the state): unswitched "
          f"{solo_s:.1f} s, switched ({2 * (TURNS - 1)} cold/warm cycles) {switched_s:.1f} s")

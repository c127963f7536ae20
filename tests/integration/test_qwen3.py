"""qwen3 end to end: `vramd serve` on a synthetic qwen3 file (QK-norm, NeoX RoPE,
GQA, Qwen3's own chat template with `enable_thinking`), driven by the official
`openai` client, and time-sharing the device with a gemma3 daemon with outputs
unchanged by switching.

Both daemons run with --residency exclusive --evict-state always, so every
switch really moves weights and KV cache off the device and back.
"""

import openai
import pytest

from tests.engine.models import write_llama
from tests.engine.models_gemma3 import write_gemma3

from .conftest import DaemonProc

READY_S = 120
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two three"}]


def client(d: DaemonProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(c, model, prompt, n=8):
    r = c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    return r.choices[0].text, r.usage


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    flags = ("--ctx", "256", "--residency", "exclusive", "--evict-state", "always")
    qwen = DaemonProc(d / "arena", write_llama(d / "qwen3.gguf", arch="qwen3", seed=5), "qwen", *flags,
                      wait_ready=False)
    gemma = None
    try:
        gemma = DaemonProc(d / "arena", write_gemma3(d / "gemma3.gguf", seed=6), "gemma", *flags, wait_ready=False)
        qwen.wait_ready(READY_S)
        gemma.wait_ready(READY_S)
        yield qwen, gemma
    finally:
        qwen.stop()
        if gemma is not None:
            gemma.stop()


def test_qwen3_answers_the_openai_client(pair):
    qwen, _ = pair
    c = client(qwen)
    assert "qwen" in {m.id for m in c.models.list().data}
    text, usage = complete(c, "qwen", "one two three", n=6)
    assert usage.completion_tokens == 6 and usage.prompt_tokens > 0
    r = c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    streamed = c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=6, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == r.choices[0].message.content


def test_qwen3s_template_takes_enable_thinking(pair):
    """Qwen3's template writes an empty <think></think> block when thinking is off:
    the prompt grows by its tokens, so the variable reached the template."""
    qwen, _ = pair
    c = client(qwen)
    on = c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=1, temperature=0)
    off = c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=1, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        c.chat.completions.create(model="qwen", messages=CHAT, max_tokens=1,
                                  extra_body={"chat_template_kwargs": {"messages": []}})


def test_qwen3_and_gemma3_time_share_with_outputs_unchanged(pair):
    qwen, gemma = pair
    cq, cg = client(qwen), client(gemma)
    want_q = complete(cq, "qwen", "one two three four", n=10)[0]
    want_g = complete(cg, "gemma", "one two three four", n=10)[0]
    switches = qwen.member().switches
    for _ in range(4):   # 8 switches, each moving weights and KV cache to the host and back
        assert complete(cq, "qwen", "one two three four", n=10)[0] == want_q
        assert complete(cg, "gemma", "one two three four", n=10)[0] == want_g
    assert qwen.member().switches >= switches + 4

"""`vramd serve` on qwen35 (Gated DeltaNet + gated attention), through the `openai` client.

The file is the conformance suite's (tests/engine/conformance/cases.py, Q4_K), which carries
Qwen3's chat template.  A greedy completion of a token-id prompt is the numpy reference's
greedy continuation (decoded by the file's tokenizer); asked again it comes out the same (the
second request resumes from the recurrent state's checkpoint); a chat goes through the file's
template, with thinking off (`chat_template_kwargs.enable_thinking`, as for Qwen3: the template
then closes an empty <think> block in the prompt, which the prompt's token count shows).
"""

import openai

from tests.engine.conformance.cases import write_case
from tests.integration.greedy_text import greedy_text

PROMPT = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2, 90, 91, 92, 300, 301, 7]
N = 6


def reference_text(path) -> str:
    from tests.engine.reference.qwen35 import Qwen35Reference
    return greedy_text(Qwen35Reference(path), path, PROMPT, N)


def test_qwen35_serves_the_openai_client(arena, tmp_path, daemons):
    path = write_case("qwen35", "Q4_K", tmp_path / "qwen35.gguf")
    d = daemons(arena, path, "qwen35")
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = reference_text(path)
    for _ in range(2):   # the second resumes from the checkpoint
        r = c.completions.create(model=d.name, prompt=PROMPT, max_tokens=N, temperature=0)
        assert r.choices[0].text == want
    messages = [{"role": "user", "content": "the river ran"}]
    on = c.chat.completions.create(model=d.name, messages=messages, max_tokens=4, temperature=0)
    off = c.chat.completions.create(model=d.name, messages=messages, max_tokens=4, temperature=0,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for r in (on, off):
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    assert off.usage.prompt_tokens > on.usage.prompt_tokens   # the closed <think></think> block

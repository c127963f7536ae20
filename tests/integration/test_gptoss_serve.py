"""`vramd serve` on a gpt-oss file (issue 17), through the `openai` client.

The file is the conformance suite's "gpt-oss" case in its real-file mix
(tests/engine/conformance/cases.py "Q8_0": MXFP4 experts, Q8_0 matrices):
attention sinks, sliding even layers (the prompt crosses the window of 8),
biases, the clamped SwiGLU, YaRN.  A greedy completion of a token-id prompt
must be the numpy reference's greedy continuation (decoded by the file's own
tokenizer); a chat request goes through the file's template.
"""

import openai

from tests.engine.conformance.cases import write_case
from tests.integration.greedy_text import greedy_text

PROMPT = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2]
N = 6


def reference_text(path) -> str:
    from tests.engine.reference.gptoss import GptOssReference
    return greedy_text(GptOssReference(path), path, PROMPT, N)


def test_gpt_oss_serves_the_openai_client(arena, tmp_path, daemons):
    path = write_case("gpt-oss", "Q8_0", tmp_path / "gpt-oss.gguf")
    d = daemons(arena, path, "gptoss")
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.completions.create(model=d.name, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == reference_text(path)
    chat = c.chat.completions.create(model=d.name, messages=[{"role": "user", "content": "the river ran"}],
                                     max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1

"""`vramd serve` and `vramd plan` on gemma4 with experts (the 26B-A4B's layout), through the `openai` client.

The model is the conformance case's (tests/engine/conformance/cases.py "gemma4-moe": fused
ffn_gate_up_exps, per-expert scales, the dense FFN beside the experts) in Q8_0, written with
Gemma 4's tokenizer and template.  A greedy completion of a token-id prompt must be the numpy
reference's (tests/engine/reference/gemma4_moe.py) greedy continuation, served with every expert
on the device and with --n-cpu-moe 1.5 (layer 0's experts and layer 1's fused gate_up on the
host: what `vramd plan` says, tensor by tensor, and the daemon's breakdown matches).
"""

from pathlib import Path

import openai

from tests.ggufgen.gemma4_moe import write_gemma4_moe
from tests.integration.greedy_text import greedy_text

from .test_footprint import plan, served

PROMPT = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2]
N = 6
TEMPLATE = Path(__file__).parents[1] / "ggufgen" / "templates" / "gemma-4.jinja"


def _complete(d) -> str:
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.completions.create(model=d.name, prompt=PROMPT, max_tokens=N, temperature=0).choices[0].text


def test_gemma4_moe_serves_the_reference_text_with_experts_on_device_or_host(arena, tmp_path, daemons):
    from tests.engine.reference.gemma4_moe import Gemma4MoEReference
    path = write_gemma4_moe(tmp_path / "g4moe.gguf", weight_type="Q8_0", seed=5, vocab="gemma4",
                            chat_template=TEMPLATE.read_text())
    want = greedy_text(Gemma4MoEReference(path), path, PROMPT, N)
    full = daemons(arena, path, "g4moe")
    assert _complete(full) == want
    c = openai.OpenAI(base_url=full.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = c.chat.completions.create(model=full.name, messages=[{"role": "user", "content": "the river ran"}],
                                     max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    full_weights = full.member().breakdown["weights"]["device"]
    assert full.stop() == 0

    planned = plan(path, "--n-cpu-moe", "1.5")
    assert sorted(t["name"] for t in planned["tensors"] if t["placement"] == "host") == [
        "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_up_exps.weight", "blk.1.ffn_gate_up_exps.weight"]
    part = daemons(arena, path, "g4moe-part", "--n-cpu-moe", "1.5")
    assert _complete(part) == want
    got = served(part)
    assert {k: got[k]["device"] for k in ("weights", "state", "scratch", "encoder")} == planned["device"]
    assert got["weights"]["host"] == planned["host"]["weights"] > 0
    assert got["weights"]["device"] < full_weights

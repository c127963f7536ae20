"""`vramd serve --n-cpu-moe`: a mixture-of-experts model served with experts on the host."""

import openai

from tests.ggufgen.moe import write_moe



def greedy(d, prompt):
    c = openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.completions.create(model=d.name, prompt=prompt, max_tokens=6, temperature=0).choices[0].text


def test_moe_daemon_with_host_experts_serves_the_same_text_in_less_vram(arena, tmp_path, daemons):
    path = write_moe(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=3, seed=2)
    full = daemons(arena, path, "full")
    want = greedy(full, [1, 10, 20, 30])
    full_weights = full.member().breakdown["weights"]["device"]
    assert full.stop() == 0
    part = daemons(arena, path, "part", "--n-cpu-moe", "1.5")
    assert greedy(part, [1, 10, 20, 30]) == want
    assert part.member().breakdown["weights"]["device"] < full_weights
    part.ask("yield", release=True)           # a cold/warm cycle: host experts stay where they are
    assert greedy(part, [1, 10, 20, 30]) == want


def test_a_dense_model_ignores_n_cpu_moe_with_a_notice(arena, models, daemons):
    d = daemons(arena, models[0], "dense", "--n-cpu-moe", "2")
    assert "no expert tensors" in d.output
    assert d.ask("verify")["weights_ok"]

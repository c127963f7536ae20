"""The qwen35 numpy reference (tests/engine/reference/qwen35.py) and the engine's refusal of qwen35.

The reference's agreement with llama.cpp is test_conformance.py's (case "qwen35"); here:
the chunked delta rule gives the recurrent one's numbers (chunk boundaries included), a
cache continued token by token or resumed from a checkpoint gives one prefill's logits,
a cache is never truncated, the choices the description leaves to llama.cpp (how value
heads share key heads, the attention's output gate) each decide its chain, and vramd
refuses a file its kernels cannot run, naming what, before any device is opened.
"""

import subprocess
import sys

import numpy as np
import pytest

from tests.engine.conformance.compare import compare
from tests.engine.conformance.peer import LlamaServer
from tests.engine.reference.qwen35 import CHUNK, Qwen35Reference, delta_rule_chunked, delta_rule_recurrent
from tests.ggufgen.qwen35 import write_qwen35
from vramd.engine.arch import spec_for
from vramd.errors import ModelError
from vramd.model.gguf_check import validate_gguf

PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 512, 72)]   # crosses CHUNK


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_qwen35(tmp_path_factory.mktemp("qwen35") / "q.gguf", weight_type="F32", seed=11)


@pytest.mark.parametrize("n", [1, 5, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 17])
def test_chunked_delta_rule_is_the_recurrent_one(n):
    rng = np.random.default_rng(n)
    s = 16
    q, k = (rng.standard_normal((n, s)) / np.sqrt(s) for _ in range(2))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((n, s))
    g = -rng.uniform(0.0, 0.3, n)
    beta = rng.uniform(0.1, 0.9, n)
    state = rng.standard_normal((s, s))
    o1, m1 = delta_rule_recurrent(q, k, v, g, beta, state)
    o2, m2 = delta_rule_chunked(q, k, v, g, beta, state)
    assert np.abs(o1 - o2).max() < 1e-10 and np.abs(m1 - m2).max() < 1e-10
    assert np.abs(o1).max() > 0.1   # not vacuous


def test_decoding_and_checkpoints_continue_the_prefill(model_file):
    ref = Qwen35Reference(model_file)
    whole = ref.forward(PROMPT, ref.new_kv(), 0)
    cache = ref.new_kv()
    ref.forward(PROMPT[:40], cache)
    checkpoint = cache.copy()
    rows = [ref.forward([t], cache)[-1] for t in PROMPT[40:]]
    assert np.abs(np.array(rows) - whole[40:]).max() < 1e-8
    resumed = ref.forward(PROMPT[40:], checkpoint)          # the checkpoint was not touched by the decode
    assert np.abs(resumed - whole[40:]).max() < 1e-8
    with pytest.raises(ValueError, match="cannot be truncated"):
        ref.forward(PROMPT[:3], cache, 10)
    assert np.abs(ref.forward(PROMPT[:8], cache, 0) - whole[:8]).max() < 1e-8   # pos0 0 restarts


@pytest.mark.parametrize("attr,off", [("head_broadcast", "block"), ("attn_gate", False)])
def test_each_choice_decides_llama_cpps_chain(model_file, attr, off):
    with LlamaServer(model_file, ctx=128) as peer:
        chain = peer.greedy_chain(PROMPT, 8, 8)
    tokens = PROMPT + chain.tokens[:-1]
    ref = Qwen35Reference(model_file)
    assert compare(chain, ref.forward(tokens, ref.new_kv(np.float16), 0)).worst() < 0.03
    setattr(ref, attr, off)
    assert compare(chain, ref.forward(tokens, ref.new_kv(np.float16), 0)).worst() > 0.15


def test_vramd_refuses_what_its_kernels_cannot_run(tmp_path):
    """A DeltaNet head larger than gated_delta.comp holds is refused before any device is opened,
    one line naming the key and the limit."""
    big = write_qwen35(tmp_path / "big.gguf", weight_type="F32", state_size=256, n_layer=2)
    with pytest.raises(ModelError, match=r"ssm.state_size 256 .* exceed the kernels' 128"):
        spec_for(validate_gguf(big))
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "serve", str(big), "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "ssm.state_size 256" in lines[0], r.stderr

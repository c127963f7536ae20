"""gemma4 at the real models' head sizes, vramd against the numpy reference (tests/engine/reference/gemma4.py).

The conformance case (cases.py) holds vramd and the reference against llama.cpp
on small heads; Gemma 4 31B's are 256 wide (sliding, 16 KV heads) and 512 wide
(global, 4 KV heads, V = K, a quarter of the pairs rotated): the attention,
RoPE and norm kernels at 512 and the scratch / KV cache sized for the widest
layer are what this file checks, on prefill and on the replayed decode step,
with the window crossed (12 tokens over a window of 4).
"""

import numpy as np
import pytest

from tests.engine.conformance.compare import log_softmax
from tests.engine.conformance.engine import vramd_logits
from tests.engine.reference.gemma4 import Gemma4Reference
from tests.ggufgen.gemma4 import write_gemma4

TOKENS = [1, 17, 42, 99, 3, 250, 8, 64, 5, 77, 31, 2]


@pytest.mark.gpu
def test_gemma4_at_31b_head_sizes_matches_the_reference(device, tmp_path):
    path = write_gemma4(tmp_path / "g4.gguf", weight_type="F32", n_head=2, head_dim=512, n_head_kv=1,
                        head_dim_swa=256, n_head_kv_swa=2, n_rot_swa=256, window=4,
                        swa_layers=(True, False, True), seed=11)
    ref = Gemma4Reference(path)
    want = log_softmax(ref.forward(TOKENS, ref.new_kv(np.float16), 0))
    got = log_softmax(vramd_logits(device, path, TOKENS, 32, decode_from=len(TOKENS) - 3))
    assert np.abs(got - want).max() < 5e-3, np.abs(got - want).max()
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()

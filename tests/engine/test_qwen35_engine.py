"""vramd's engine on qwen35 (vramd/engine/deltanet.py, arch/qwen35.py): generation through the
runner against the numpy reference, prefix reuse with a recurrent state, and the state going
cold and warm.  (Agreement with llama.cpp per weight type: test_conformance.py's qwen35 case.)

Prefix reuse (runner.py's _prefill_recurrent): the state cannot be cut back to a shared
prefix, so a request continues the cache only where the cache ends, or the checkpoint (the
state after the last prompt but its last token), and otherwise recomputes from position 0.
Each request's tokens must be the reference's from a fresh start, whichever way it went;
`reused_tokens` says which way it went.
"""

import numpy as np
import pytest

from tests.engine.conformance.engine import EngineOn
from tests.engine.reference.qwen35 import Qwen35Reference
from tests.ggufgen.qwen35 import write_qwen35
from vramd.engine.sampler import SamplingParams

N_GEN = 6


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, device):
    path = write_qwen35(tmp_path_factory.mktemp("q35") / "q.gguf", weight_type="F32", seed=11)
    on = EngineOn(device, path, ctx=160, batch=32)   # chunks of 32: prompts span several
    yield on, Qwen35Reference(path)
    on.close()


def generate(engine, ids):
    out, before = [], engine.stats["reused_tokens"]
    engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=N_GEN), lambda p: p.token < 0 or out.append(p.token) or True)
    return out, engine.stats["reused_tokens"] - before


def test_requests_sharing_prefixes_give_fresh_outputs(qwen35):
    on, ref = qwen35
    e = on.engine
    rng = np.random.default_rng(3)
    a = [int(t) for t in rng.integers(0, 512, 70)]
    b = a[:40] + [int(t) for t in rng.integers(0, 512, 12)]
    want = {name: ref.greedy(p, N_GEN, kv_dtype=np.float16) for name, p in (("a", a), ("b", b))}
    got, reused = generate(e, a)
    assert got == want["a"] and reused == 0
    got, reused = generate(e, b)            # shares 40 tokens with the cache: the state cannot go back
    assert got == want["b"] and reused == 0
    got, reused = generate(e, a)            # a prompt seen before: not the checkpoint's (b's), so from 0
    assert got == want["a"] and reused == 0
    got, reused = generate(e, a)            # the same prompt again: from the checkpoint after a[:-1]
    assert got == want["a"] and reused == len(a) - 1
    c = a + got + [5, 6, 7]                 # continues the cache: every reply token but the last was fed
    want_c = ref.greedy(c, N_GEN, kv_dtype=np.float16)
    got, reused = generate(e, c)
    assert got == want_c and reused == len(a) + N_GEN - 1
    got, reused = generate(e, a + [9, 9])   # extends a[:-1], the checkpoint: c's prefill set it to c[:-1]
    assert got == ref.greedy(a + [9, 9], N_GEN, kv_dtype=np.float16) and reused == 0


def test_state_survives_cold_and_warm_bit_for_bit(qwen35):
    on, ref = qwen35
    e, res = on.engine, on.res
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 512, 50)]
    first, _ = generate(e, prompt)
    pairs = e.model.kv.checkpoint_tensors
    before = [t.read().tobytes() for pair in pairs for t in pair]
    res.sync()
    res.release(["weights", "state", "scratch"])   # cold: the state evicted to its host shadow
    res.restore(["weights", "state"])
    assert [t.read().tobytes() for pair in pairs for t in pair] == before
    assert any(b.strip(b"\0") for b in before)     # not vacuous: a state was there
    c = prompt + first + [11]
    got, reused = generate(e, c)
    assert reused == len(prompt) + N_GEN - 1   # (the last reply token is never fed)
    assert got == ref.greedy(c, N_GEN, kv_dtype=np.float16)


def test_memory_counts_the_recurrent_state(qwen35):
    on, _ = qwen35
    layout = on.engine.model.kv.layout
    d = on.engine.spec.deltanet
    n_rec = sum(layer.recurrent for layer in on.engine.spec.layers)
    assert layout.recurrent_bytes == 2 * n_rec * 4 * ((d.d_conv - 1) * d.conv_dim + d.hv * d.s * d.s)
    kv = sum(n for name, n in layout.tensors() if name.startswith("cache_"))
    assert kv == 2 * (on.engine.spec.n_layer - n_rec) * 160 * on.engine.spec.kv_width * 2
    assert layout.nbytes == kv + layout.recurrent_bytes


def test_a_batch_that_does_not_continue_the_state_is_refused(qwen35):
    from vramd.errors import ModelError
    on, _ = qwen35
    e = on.engine
    generate(e, [3, 4, 5, 6])
    at = e.model.rec_pos
    with pytest.raises(ModelError, match=f"holds positions 0..{at - 1}: a batch from position 2 cannot continue"):
        e.model.forward([7, 8], 2)
    assert e.model.rec_pos == at   # refused before anything ran


def test_a_failed_prefill_from_the_start_drops_the_checkpoint(qwen35, monkeypatch):
    """A prompt computed from position 0 rewrites the K/V rows the checkpoint's state goes with:
    if its batch fails after writing them, a later prompt that extends the old checkpoint must not
    resume from it (it would pair the old recurrent state with the failed batch's K/V rows)."""
    on, ref = qwen35
    e = on.engine
    rng = np.random.default_rng(5)
    a = [int(t) for t in rng.integers(0, 512, 60)]
    d = [int(t) for t in rng.integers(0, 512, 50)]
    generate(e, a)
    generate(e, a)                           # the checkpoint is a[:-1]
    real = e.model.forward

    def fail_after(batch, *args, **kw):      # the body batch runs (its rows are written), then fails
        real(batch, *args, **kw)
        raise RuntimeError("injected: the batch failed after writing its rows")
    monkeypatch.setattr(e.model, "forward", fail_after)
    with pytest.raises(RuntimeError, match="injected"):
        generate(e, d)
    monkeypatch.setattr(e.model, "forward", real)
    got, reused = generate(e, a + [9, 9])    # extends the old checkpoint: computed afresh instead
    assert got == ref.greedy(a + [9, 9], N_GEN, kv_dtype=np.float16) and reused == 0

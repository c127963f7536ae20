"""Decode replays one recorded step (vramd/engine/model.py: TransformerModel, decode_step.py),
and a decode step can be timed per dispatch (vramd/gpu/timing.py).

Correctness of the replayed logits against the numpy reference is
test_forward.py's job (its decode loops run through the replay); here: the
step is recorded once for many tokens, recorded again after a
release/restore (buffers may move) with the logits still right, and the
timestamps of a step name every dispatch, with the bytes of each matvec.
"""
import numpy as np
import pytest

from tests.ggufgen.llama import write_llama
from tests.engine.reference.llama import ReferenceModel
from tests.engine.test_forward import TOL, rel_err
from vramd.engine.arch import spec_for
from vramd.engine.model import TransformerModel
from vramd.engine.scratch import scratch_layout
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

CTX = 64


@pytest.fixture
def model(device, tmp_path):
    from vramd.gpu.residency import Residency

    path = write_llama(tmp_path / "m.gguf", weight_type="Q8_0", n_head=4, n_head_kv=2, seed=3)
    mf = validate_gguf(path)
    cfg = spec_for(mf)
    res = Residency(device)
    lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(cfg, 16))
    res.restore(["weights", "state"])
    m = TransformerModel(lm, res, CTX, lm.scratch, batch=16)
    yield m, ReferenceModel(path), res
    m.close()
    res.close()


def test_decode_records_once_and_rerecords_after_a_move(model):
    m, ref, res = model
    kv = ref.new_kv(np.float16)
    prompt = [1, 7, 9, 11]
    m.forward(prompt, 0)
    ref.forward(prompt, kv, 0)
    pos = len(prompt)
    for tok in [20, 21, 22, 23]:
        assert rel_err(m.forward([tok], pos), ref.forward([tok], kv)[-1]) < TOL
        pos += 1
    assert m.step_records == 1
    # A switch: every region released (scratch freed, KV copied out), then
    # restored into new device memory.  The step must be recorded again.
    res.release(["weights", "state", "scratch"])
    res.drain()
    res.restore(["weights", "state"])
    for tok in [24, 25]:
        assert rel_err(m.forward([tok], pos), ref.forward([tok], kv)[-1]) < TOL
        pos += 1
    assert m.step_records == 2
    # A prefill chunk in between binds the same buffers: no re-record.
    m.forward([30, 31], pos)
    ref.forward([30, 31], kv)
    pos += 2
    assert rel_err(m.forward([32], pos), ref.forward([32], kv)[-1]) < TOL
    assert m.step_records == 2


def test_a_profiled_step_times_every_dispatch(model, device):
    from vramd.gpu.timing import Timestamps, summarize

    m, _ref, _res = model
    cfg = m.spec
    timer = Timestamps(device)
    try:
        m.profile(timer)
        m.forward([1, 2, 3], 0)
        steps = []
        for i in range(3):
            m.forward([4 + i], 3 + i)
            steps.append(timer.read())
        m.profile(None)
        m.forward([9], 6)   # re-recorded without timestamps; still works
    finally:
        timer.close()
    # Steps of several tokens are never timed (the profile is the one-token step's):
    # the 3-token step recorded while the timer was attached replays after it is closed.
    assert m._steps[3].timer is None
    m.forward([10, 11, 12], 7)
    assert m.step_records == 2
    n = m._steps[1]._graph.dispatches + 3   # and the copies: id and position in, logits out
    assert all(len(s) == n for s in steps)
    assert [label for label, _b, _ns in steps[0]].count("copy") == 3
    assert all(ns >= 0 for s in steps for _l, _b, ns in s)
    matvecs = [(label, nbytes) for label, nbytes, _ns in steps[0] if label.startswith("matvec_")]
    assert len(matvecs) == 7 * cfg.n_layer + 1          # q k v o gate up down per layer, then the output
    per_layer = (cfg.n_embd * (2 * cfg.q_width + 2 * cfg.kv_width) + 3 * cfg.n_embd * cfg.n_ff) // 32 * 34
    want = cfg.n_layer * per_layer + cfg.n_vocab * cfg.n_embd // 32 * 34
    assert sum(b for _l, b in matvecs) == want           # every Q8_0 weight byte, once
    s = summarize(steps)
    assert s["steps"] == 3 and s["gpu_ms_per_step"] > 0
    assert sum(k["dispatches"] for k in s["kernels"]) == n
    mv = "matvec_c_q8_0" if device.type == "cpu" else "matvec_q8_0"   # linear.select(): the CPU form on lavapipe
    from vramd.engine.ops import dec_kernel
    dec = dec_kernel(cfg.head_dim_of(0)) if m.ops.decode_attn == "new" else None   # the default
    split = dec or ("attention_split_gqa" if m.ops.split_gqa and cfg.n_head > cfg.n_head_kv else "attention_split")
    assert {k["kernel"].split()[0] for k in s["kernels"]} >= {mv, split, "attention_merge", "add_rms_norm", "get_rows_q8_0"}


def test_host_buffer_round_trip(device):
    """kernels.HostBuffer: what the host writes, a copy takes to the device
    and back (Ops.copy outside a batch runs at once)."""
    from vramd.engine.ops import Ops, view
    from vramd.gpu.kernels import HostBuffer
    from vramd.gpu.residency import Residency

    res = Residency(device)
    ops = Ops(res)
    hb = HostBuffer(device, 4096)
    try:
        r = res.region("state", "s", {"t": 4096})
        r.restore()
        data = np.arange(512, dtype=np.int32)
        hb.array[:2048] = data.view(np.uint8)
        ops.copy(hb.view(0, 2048), view(r.tensors["t"], 1024, 2048), 2048)
        ops.copy(view(r.tensors["t"], 1024, 2048), hb.view(2048, 2048), 2048)
        ops.sync()
        assert np.array_equal(r.tensors["t"].read(np.int32, 1024, 2048), data)
        assert np.array_equal(hb.array[2048:].view(np.int32), data)
    finally:
        hb.close()
        ops.close()
        res.close()


def test_steps_of_several_tokens_replay_as_their_chunk_computes(model):
    """The decode step is keyed by batch size: a batch of n <= REPLAY_TOKENS
    tokens wanting its last row's logits replays a step recorded for n,
    giving the logits the chunk path gives for the same batch, bit for bit."""
    from vramd.engine.batch import TokenBatch
    from vramd.engine.model import REPLAY_TOKENS

    m, ref, _res = model
    kv = ref.new_kv(np.float16)
    m.forward([1, 7, 9], 0)
    ref.forward([1, 7, 9], kv, 0)
    pos = 3
    for n in (2, 3, 5, REPLAY_TOKENS):
        toks = list(range(40, 40 + n))
        batch = TokenBatch.of(toks, pos)
        chunk = m._chunk(batch)[0]                 # the recorded-per-chunk path
        replayed = m.forward(batch)                # the step recorded for n tokens, replayed
        assert np.array_equal(chunk, replayed)
        assert rel_err(replayed, ref.forward(toks, kv)[-1]) < TOL
        assert m._steps[n].records == 1
        pos += n
    assert sorted(m._steps) == [2, 3, 5, REPLAY_TOKENS]

"""Several sequences in one KV cache and one forward pass (issue 16's engine part: parallel slots).

vramd/engine/kvcache.py gives each sequence its own region (rows [s*ctx, (s+1)*ctx), its own
recurrent state), vramd/engine/model.py's forward_batch runs a TokenBatch.mix of several
sequences' tokens (decode rows of some, a prefill chunk of another), and a step of one decode
token of each of several sequences replays a recorded graph (decode_step.py).  Asserted here on
real Vulkan, for llama, gemma3 (sliding windows), gpt-oss (sinks), qwen35 (recurrent layers), a
MoE model (GPU- and host-routed), Gemma 4 E2B's shape (per-layer embeddings, shared KV), and llama with a dispatch per sequence for the decode rows (the
fallback where a layer's whole cache passes one binding): every sequence's logits in a mixed
batch are its logits run alone (within test_forward.py's TOL, the greedy tokens equal) over many interleaved steps; the
replayed multi-sequence step gives what the same step not replayed gives, bit for bit; a sequence's
K/V rows are untouched by the others' writes; copy_seq forks a sequence; bad batches are refused.
The solo runs are checked against the numpy references and llama.cpp by test_forward.py and
test_conformance.py; they run here on the last sequence of the same cache.
"""
import numpy as np
import pytest

from tests.engine.test_forward import TOL, rel_err
from tests.ggufgen.gemma3 import write_gemma3
from tests.ggufgen.gemma4 import E2B_SHAPE, write_gemma4
from tests.ggufgen.gptoss import write_gptoss
from tests.ggufgen.llama import write_llama
from tests.ggufgen.moe import write_moe
from tests.ggufgen.qwen35 import write_qwen35
from vramd.engine import model as model_mod
from vramd.engine.arch import spec_for
from vramd.engine.batch import TokenBatch
from vramd.engine.model import TransformerModel
from vramd.engine.scratch import scratch_layout
from vramd.errors import ModelError
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

CTX = 64
N_SEQ = 4
SOLO = N_SEQ - 1          # the sequence the solo runs use
CHUNK = 32

WRITERS = {
    "llama": lambda p: write_llama(p, weight_type="Q8_0", n_head=4, n_head_kv=2, seed=3),
    "gemma3": lambda p: write_gemma3(p, seed=5),
    "gptoss": lambda p: write_gptoss(p, seed=2),
    "qwen35": lambda p: write_qwen35(p, weight_type="F32", seed=11),
    "qwen3moe": lambda p: write_moe(p, seed=4),
    "qwen3moe-host": lambda p: write_moe(p, seed=4),
    "llama-per-seq": lambda p: write_llama(p, weight_type="Q8_0", n_head=4, n_head_kv=2, seed=3),
    # Gemma 4 E2B's shape: per-layer embeddings, KV-sharing layers reading an earlier layer's region
    "gemma4-e2b": lambda p: write_gemma4(p, weight_type="Q8_0", seed=5, **E2B_SHAPE),
}


@pytest.fixture(scope="module", params=list(WRITERS))
def slots(request, tmp_path_factory, device):
    from vramd.gpu.residency import Residency

    path = WRITERS[request.param](tmp_path_factory.mktemp("slots") / "m.gguf")
    mf = validate_gguf(path)
    res = Residency(device)
    lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(spec_for(mf), CHUNK), n_seq=N_SEQ)
    res.restore(["weights", "state"])
    m = TransformerModel(lm, res, CTX, lm.scratch, batch=CHUNK, gpu_routing=request.param != "qwen3moe-host")
    if request.param == "llama-per-seq":   # the fallback where the whole cache passes one binding
        m.seq_kernels = m.seq_input = False
    else:
        assert m.seq_kernels
    yield m
    m.close()
    res.close()


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def solo(m, tokens, steps):
    """`tokens` alone on sequence SOLO from position 0, then `steps` greedy tokens: the logits
    of the prompt's last row and of each decode step, and the tokens."""
    m.clear_seq(SOLO)
    logits = [m.forward_batch(TokenBatch.of(tokens, 0, seq=SOLO))[0]]
    out = []
    for k in range(steps):
        out.append(int(np.argmax(logits[-1])))
        logits.append(m.forward_batch(TokenBatch.of([out[-1]], len(tokens) + k, seq=SOLO))[0])
    return logits, out


def test_mixed_batches_give_each_sequence_its_solo_logits(slots):
    """Three sequences: two prefill together, then decode while the third's prompt joins as a
    prefill chunk; over many steps each gets its solo greedy tokens and logits."""
    m = slots
    V = m.spec.n_vocab
    prompts = {0: prompt(1, 11, V), 1: prompt(2, 5, V), 2: prompt(3, 23, V)}
    steps = 14
    want = {s: solo(m, p, steps) for s, p in prompts.items()}
    for s in prompts:
        m.clear_seq(s)
    got = {s: [] for s in prompts}
    toks = {s: [] for s in prompts}
    first = m.forward_batch(TokenBatch.mix([(0, prompts[0], 0), (1, prompts[1], 0)]))
    got[0].append(first[0])
    got[1].append(first[1])
    joined = False
    runs = m.slot_step_runs
    for step in range(steps + 4):
        parts = []
        for s in (0, 1, 2):
            if s == 2 and not joined:
                continue
            if len(toks[s]) < steps:
                toks[s].append(int(np.argmax(got[s][-1])))
                parts.append((s, [toks[s][-1]], len(prompts[s]) + len(toks[s]) - 1))
        if step == 2:   # the third sequence's prompt arrives: its prefill rides with the decode rows
            parts.insert(1, (2, prompts[2], 0))
            joined = True
        if not parts:
            break
        logits = m.forward_batch(TokenBatch.mix(parts))
        assert logits.shape == (len(parts), V)
        for (s, _t, _p), row in zip(parts, logits):
            got[s].append(row)
    for s in prompts:
        logits, tokens = want[s]
        assert toks[s] == tokens, f"sequence {s}"
        assert len(got[s]) == len(logits)
        for k, (g, w) in enumerate(zip(got[s], logits)):
            assert rel_err(g, w) < TOL, f"sequence {s}, step {k}"
    if m.replays_decode:   # the steps of only decode rows replayed a recorded multi-sequence step
        assert m.slot_step_runs > runs


def _kv_bytes(m, s):
    """Sequence s's K/V rows and recurrent state, as bytes, every layer."""
    L, out = m.kv.layout, []
    for i in range(L.n_layer):
        if i in L.recurrent:
            for t, size in ((m.kv._conv[i], L.conv_bytes), (m.kv._ssm[i], L.ssm_bytes)):
                out.append(t.read(np.uint8, s * size, size).tobytes())
        else:
            for t, w in ((m.kv._k[i], L.k_width), (m.kv._v[i], L.v_width)):
                size = 2 * L.ctx * w
                out.append(t.read(np.uint8, s * size, size).tobytes())
    return out


def test_a_sequence_is_untouched_by_the_others(slots):
    m = slots
    V = m.spec.n_vocab
    m.clear_seq(0)
    m.forward_batch(TokenBatch.of(prompt(7, 9, V), 0, seq=0))
    m.ops.sync()
    before = _kv_bytes(m, 0)
    assert any(b.strip(b"\0") for b in before)
    for s in (1, 2):
        m.clear_seq(s)
    m.forward_batch(TokenBatch.mix([(1, prompt(8, 30, V), 0), (2, prompt(9, 4, V), 0)]))
    m.forward_batch(TokenBatch.mix([(1, [5], 30), (2, [6], 4)]))
    m.forward_batch(TokenBatch.mix([(2, [7], 5), (1, [8], 31)]))
    m.ops.sync()
    assert _kv_bytes(m, 0) == before


def test_the_replayed_step_equals_the_step_not_replayed(slots, monkeypatch):
    """The same multi-sequence decode step (the same state, tokens, positions) through the
    recorded graph and through a freshly recorded chunk: the same logits, bit for bit."""
    m = slots
    V = m.spec.n_vocab
    parts = [(0, prompt(10, 6, V), 0), (1, prompt(11, 13, V), 0), (2, prompt(12, 3, V), 0)]
    for s, _t, _p in parts:
        m.clear_seq(s)
    m.forward_batch(TokenBatch.mix(parts))
    for s, _t, _p in parts:
        m.save_checkpoint(s) if m.kv.recurrent else None
    step = TokenBatch.mix([(2, [21], 3), (0, [22], 6), (1, [23], 13)])
    runs = m.slot_step_runs
    replayed = m.forward_batch(step)
    assert m.slot_step_runs == runs + (1 if m.replays_decode else 0)
    if m.kv.recurrent:   # the states back to before the step (their checkpoints)
        for s, t, _p in parts:
            m.restore_checkpoint(len(t), s)
    monkeypatch.setattr(model_mod, "SLOTS_REPLAY", 0)
    plain = m.forward_batch(step)
    assert m.slot_step_runs == runs + (1 if m.replays_decode else 0)
    assert np.array_equal(replayed, plain)
    # and the step's rows are each sequence's own: a different order of the rows, the same logits
    monkeypatch.undo()
    if m.kv.recurrent:
        for s, t, _p in parts:
            m.restore_checkpoint(len(t), s)
    swapped = m.forward_batch(TokenBatch.mix([(1, [23], 13), (2, [21], 3), (0, [22], 6)]))
    assert rel_err(swapped[[1, 2, 0]], replayed) < TOL
    assert (swapped[[1, 2, 0]].argmax(axis=1) == replayed.argmax(axis=1)).all()


def test_other_sequences_replay_the_same_graph(slots):
    """Where the decode kernels read each row's sequence id (model.seq_input: K/V writes,
    split attention, and qwen35's conv and delta rule), a step of other sequences, or of the
    same in another order, replays the graph recorded for its size; else (the fallback: a
    dispatch per sequence on its region) it is recorded again for them."""
    m = slots
    if not m.replays_decode:
        return   # host-routed MoE: no step is replayed (test_mixed_batches covers its batches)
    V = m.spec.n_vocab
    for s in range(N_SEQ):
        m.clear_seq(s)
    m.forward_batch(TokenBatch.mix([(s, prompt(20 + s, 4 + s, V), 0) for s in range(N_SEQ)]))
    at = [4 + s for s in range(N_SEQ)]
    records = m.slot_step_records
    for k, seqs in enumerate([(0, 1), (2, 3), (3, 0), (1, 2)]):
        got = m.forward_batch(TokenBatch.mix([(s, [30 + k], at[s]) for s in seqs]))
        for s in seqs:
            at[s] += 1
        assert got.shape == (2, V)
    if m.seq_input:   # at most the first (a size-2 step may be recorded already)
        assert m.slot_step_records - records <= 1
    else:
        assert m.slot_step_records - records >= 3
    one = m.step_records   # and the one-token step, on one sequence then another
    for k, s in enumerate((0, 2, 1, 3)):
        m.forward_batch(TokenBatch.of([40 + k], at[s], seq=s))
        at[s] += 1
    if m.seq_input:
        assert m.step_records - one <= 1
    else:
        assert m.step_records - one >= 3
    assert m.seq_input == m.seq_kernels   # every layer of these files as wide as the cache's rows


def test_copy_seq_forks_a_sequence(slots):
    m = slots
    V = m.spec.n_vocab
    m.clear_seq(0)
    p = prompt(13, 17, V)
    m.forward_batch(TokenBatch.of(p, 0, seq=0))
    m.copy_seq(0, 2)
    assert m.rec_positions[2] == m.rec_positions[0]
    both = m.forward_batch(TokenBatch.mix([(0, [4], 17), (2, [4], 17)]))
    assert np.array_equal(both[0], both[1])


def test_bad_batches_are_refused(slots):
    m = slots
    with pytest.raises(ModelError, match=f"sequence {N_SEQ} outside the cache's {N_SEQ}"):
        m.forward_batch(TokenBatch.of([1, 2], 0, seq=N_SEQ))
    split = TokenBatch(np.array([1, 2, 3]), np.array([0, 0, 1]), np.array([0, 1, 0], np.int32), (2,))
    with pytest.raises(ModelError, match="sequence 0: its tokens are not consecutive rows"):
        m.forward_batch(split)
    if m.kv.recurrent:
        m.clear_seq(1)
        m.forward_batch(TokenBatch.of([1, 2, 3], 0, seq=1))
        with pytest.raises(ModelError, match="state of sequence 1 holds positions 0..2: a batch from position 5"):
            m.forward_batch(TokenBatch.mix([(0, [1], 0), (1, [4], 5)]))
        assert m.rec_positions[1] == 3   # refused before anything ran


def test_the_footprint_counts_every_sequence(tmp_path):
    from vramd.model.footprint import footprint
    mf = validate_gguf(write_qwen35(tmp_path / "q.gguf", weight_type="F32", seed=11))
    one, three = footprint(mf, CTX), footprint(mf, CTX, n_seq=3)
    assert loader.kv_shape(mf, CTX, 3).nbytes == 3 * loader.kv_shape(mf, CTX).nbytes
    assert three.recurrent_bytes == 3 * one.recurrent_bytes > 0
    assert three.region_bytes("kv") >= 3 * sum(n for _t, n in one.layouts["kv"])
    assert three.device_bytes > one.device_bytes


def test_hidden_states_advance_sequence_0(slots):
    """The embedding path (hidden) runs on sequence 0: its state's position after it is the
    tokens' count (qwen35), the other sequences' unchanged."""
    m = slots
    for s in range(N_SEQ):
        m.clear_seq(s)
    m.forward_batch(TokenBatch.of([5, 6], 0, seq=2))
    h = m.hidden([1, 2, 3, 4, 5], (4,))
    assert h.shape == (1, m.spec.n_embd)
    if m.kv.recurrent:
        assert m.rec_positions == [5, 0, 2, 0]

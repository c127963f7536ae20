"""Continuous batching over an Engine's slots (vramd/engine/batching.py) on real Vulkan (lavapipe).

One synthetic model, its KV cache of N_SEQ sequences.  Every request's solo output comes
from Engine.generate (the one-slot path) on the same engine; batched, each request must
give exactly that: the same tokens, text and finish reason, greedy and seeded sampling,
with stop strings, a grammar, penalties and logprobs, whether requests start together,
join mid-generation, outnumber the slots (they wait), or are cancelled (the slot is freed
for a waiting one at the next step).  Prefix reuse picks the slot that holds the prompt's
prefix; a long prompt's prefill advances one chunk every step while short requests keep
arriving (no starvation).  The host cache saves and restores a slot's own sequence; a
recurrent model's slots (qwen35) continue their state or prefill from 0, each its solo output.
"""

import numpy as np
import pytest

from tests.ggufgen.llama import write_llama
from vramd.engine.arch import spec_for
from vramd.engine.batch import TokenBatch
from vramd.engine.batching import Batcher
from vramd.engine.grammar import json_schema
from vramd.engine.prompt import Prompt, common_prefix
from vramd.engine.runner import Engine
from vramd.engine.sampler import SamplingParams
from vramd.engine.scratch import scratch_layout
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

CTX = 160
N_SEQ = 4
CHUNK = 16


@pytest.fixture(scope="module")
def engine(device, tmp_path_factory):
    from vramd.gpu.residency import Residency

    path = write_llama(tmp_path_factory.mktemp("batching") / "q.gguf", arch="qwen3", n_embd=64, n_ff=128,
                       n_layer=2, seed=3)
    mf = validate_gguf(path)
    res = Residency(device)
    lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(spec_for(mf), CHUNK), n_seq=N_SEQ)
    res.restore(["weights", "state"])
    e = Engine(lm, res, CTX, chunk=CHUNK)
    assert e.n_seq == N_SEQ
    _COOPMAT[0] = e.model.ops.coopmat
    yield e
    e.close()
    res.close()


def ids_of(engine, text):
    return engine.prompt_ids(Prompt(kind="completion", prompt=text))


REQUESTS = [
    ("The river ran", dict(temperature=0.0, max_tokens=12)),
    ("Once upon a time there was a very long prompt that", dict(temperature=0.9, seed=7, max_tokens=10,
                                                              repeat_penalty=1.3, logprobs=3)),
    ("A B C", dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11, max_tokens=14, stop=("e",))),
    ("JSON:", dict(temperature=1.0, seed=3, max_tokens=40,
                   grammar=json_schema({"enum": ["river", "rain", "road"]}))),
    ("Mountains", dict(temperature=0.7, seed=5, max_tokens=9, frequency_penalty=0.5)),
    ("x", dict(temperature=0.0, max_tokens=6)),
]


def as_tuple(pieces):
    return [(p.token, p.text, p.logprob, None if p.top is None else [t for t, _ in p.top]) for p in pieces]


# Log-probabilities of a batched request against its solo run: on lavapipe every kernel is f32
# and they agree to 1e-4; a GPU's tensor-core prefill (f16 tiles) of a prompt cut into other
# chunks than alone moved them by up to 2e-3 on the H200 (2026-12-02), tokens and text equal.
LOGPROB_TOL = {False: 1e-4, True: 1e-2}


def assert_same(got, want, what=""):
    """Same tokens, text, top ids and finish; log-probabilities within LOGPROB_TOL."""
    tol = LOGPROB_TOL[bool(_COOPMAT[0])]
    if isinstance(got, tuple):   # (pieces, finish)
        assert got[1] == want[1], what
        got, want = got[0], want[0]
    assert [(t, x, top) for t, x, _l, top in got] == [(t, x, top) for t, x, _l, top in want], what
    for (_t, _x, a, _), (_t2, _x2, b, _2) in zip(got, want):
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= tol), (what, a, b)


_COOPMAT = [False]


def solo(engine, text, kw):
    engine.forget()
    pieces = []
    finish = engine.generate(ids_of(engine, text), SamplingParams(**kw), lambda p: pieces.append(p) or True)
    return as_tuple(pieces), finish


@pytest.fixture(scope="module")
def solos(engine):
    return [solo(engine, t, kw) for t, kw in REQUESTS]


def submit(b, engine, text, kw, out, stop_after=None):
    pieces = []
    out.append(pieces)

    def emit(p):
        pieces.append(p)
        return stop_after is None or len([q for q in pieces if q.token >= 0]) < stop_after
    return b.submit(ids_of(engine, text), SamplingParams(**kw), emit)


def test_requests_together_each_give_their_solo_output(engine, solos):
    """More requests than slots, all at once: four run, two wait; each equals its solo run."""
    engine.forget()
    b = Batcher(engine)
    out = []
    gens = [submit(b, engine, t, kw, out) for t, kw in REQUESTS]
    widths = []
    b.run(lambda: widths.append(len(b.busy)))
    for k, (gen, pieces) in enumerate(zip(gens, out)):
        assert_same((as_tuple(pieces), gen.finish), solos[k], f"request {k}")
    assert max(widths) == N_SEQ          # the slots were all busy at once
    assert not b.busy and not b.waiting


def test_a_generation_ends_with_its_last_token_not_a_step_later(engine):
    """max_tokens spent: the generation ends as its last token is drawn, alone and batched; no
    forward pass runs that token (nobody samples its logits: a wasted step per request, and in
    a daemon a step that could fall after a pause for a peer, calling it back to the GPU)."""
    ids = ids_of(engine, "The river ran")
    engine.forget()
    runs = engine.model._steps[1].runs if 1 in engine.model._steps else 0
    pieces = []
    assert engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=5),
                           lambda p: pieces.append(p) or True) == "length"
    assert len([p for p in pieces if p.token >= 0]) == 5
    assert engine.model._steps[1].runs - runs == 4           # the prompt's step gave the first token
    assert engine.cached == ids + [p.token for p in pieces if p.token >= 0][:4]
    engine.forget()
    b = Batcher(engine)
    gens = [b.submit(ids_of(engine, t), SamplingParams(temperature=0.0, max_tokens=3), lambda p: True)
            for t in ("The river ran", "A B C")]
    b.run()
    assert [g.finish for g in gens] == ["length", "length"]
    # one prompt a step: A's prompt (its 1st token), A's 2nd + B's prompt, A's 3rd + B's 2nd, B's 3rd
    assert b.steps == 4


def test_a_request_joining_mid_generation(engine, solos):
    engine.forget()
    b = Batcher(engine)
    out, gens = [], []
    gens.append(submit(b, engine, *REQUESTS[0], out))
    gens.append(submit(b, engine, *REQUESTS[2], out))

    def between():
        if b.steps == 4:
            gens.append(submit(b, engine, *REQUESTS[1], out))
        if b.steps == 7:
            gens.append(submit(b, engine, *REQUESTS[3], out))
    b.run(between)
    for k, (gen, pieces) in zip((0, 2, 1, 3), zip(gens, out)):
        assert_same((as_tuple(pieces), gen.finish), solos[k], f"request {k}")


def test_a_cancelled_request_frees_its_slot_for_a_waiting_one(engine, solos):
    engine.forget()
    b = Batcher(engine)
    out = []
    # four long greedy runs fill the slots; the first stops after 3 tokens (its emit returns
    # False, a client gone); one is cancelled from outside between steps; two wait
    kw = dict(temperature=0.0, max_tokens=30)
    first = submit(b, engine, "Four", kw, out, stop_after=3)
    second = submit(b, engine, "Five", kw, out)
    others = [submit(b, engine, t, k, out) for t, k in (REQUESTS[4], REQUESTS[5], REQUESTS[0], REQUESTS[1])]
    taken = {}

    def between():
        if b.steps == 5:
            b.cancel(second)
        for g in others:
            if g.seq >= 0 and g not in taken:
                taken[g] = (b.steps, g.seq)
    b.run(between)
    assert first.finish == second.finish == "cancelled"
    assert len([p for p in out[0] if p.token >= 0]) == 3
    assert len(out[1]) == 4   # a token each step from its prefill (step 2) until it was cancelled, then none
    # the waiting ones took the two freed slots as soon as they were free
    assert {taken[others[2]][1], taken[others[3]][1]} == {first.seq, second.seq}
    assert taken[others[2]][0] <= 4 and taken[others[3]][0] <= 6
    for g, pieces, k in zip(others, out[2:], (4, 5, 0, 1)):
        assert_same((as_tuple(pieces), g.finish), solos[k], f"request {k}")


def test_a_prompt_goes_to_the_slot_holding_its_prefix(engine):
    engine.forget()
    b = Batcher(engine)
    out = []
    kw = dict(temperature=0.0, max_tokens=4)
    texts = ["alpha beta gamma", "delta epsilon", "zeta eta theta", "iota kappa"]
    gens = [submit(b, engine, t, kw, out) for t in texts]
    b.run()
    seqs = {t: g.seq for t, g in zip(texts, gens)}
    longer = "delta epsilon and then some more words"
    before = engine.stats["reused_tokens"]
    g = submit(b, engine, longer, kw, out)
    b.run()
    assert g.seq == seqs["delta epsilon"]
    assert g.reused == len(ids_of(engine, "delta epsilon")) == engine.stats["reused_tokens"] - before
    # no shared prefix anywhere: the least recently used slot (the first to finish, or the
    # oldest) is taken, never the one just used
    h = submit(b, engine, "omega", kw, out)
    b.run()
    assert h.seq != g.seq


def test_a_long_prompt_is_not_starved_by_short_ones(engine):
    """A prompt of many chunks with three short requests arriving at every step: it still
    advances one chunk a step and starts generating after its chunks' steps."""
    engine.forget()
    b = Batcher(engine)
    out = []
    long_ids = [int(t) for t in np.random.default_rng(0).integers(3, engine.spec.n_vocab, 6 * CHUNK)]
    pieces = []
    long_gen = b.submit(long_ids, SamplingParams(temperature=0.0, max_tokens=3), lambda p: pieces.append(p) or True)
    first_token = []

    def between():
        if long_gen.finish is None and len(b.waiting) < 3:
            submit(b, engine, "x", dict(temperature=0.0, max_tokens=2), out)
        if pieces and not first_token:
            first_token.append(b.steps)
        if b.steps > 200:
            raise AssertionError("the long prompt never finished")
    b.run(between)
    assert long_gen.finish == "length" and len(pieces) >= 3
    # 6 chunks of at most CHUNK rows less the decode rows beside them: at most 2 rows a step
    # are others' (three slots decode), so within 6 * CHUNK / (CHUNK - 3) + 1 steps
    assert first_token[0] <= int(np.ceil(6 * CHUNK / (CHUNK - 3))) + 1
    engine.forget()
    want = []
    engine.generate(long_ids, SamplingParams(temperature=0.0, max_tokens=3), lambda p: want.append(p) or True)
    assert_same(as_tuple(pieces), as_tuple(want))


def test_the_host_cache_saves_and_restores_a_slots_own_sequence(engine):
    """vramd/server/hostcache.py on a slot other than 0: the rows saved are that sequence's
    (the K/V region at seq * ctx rows), written back into another slot they continue there:
    the extended prompt reuses them and gives its solo output."""
    from vramd.server.hostcache import HostCache

    engine.forget()
    V = engine.spec.n_vocab
    rng = np.random.default_rng(4)
    base = [int(t) for t in rng.integers(3, V, 30)]
    more = base + [int(t) for t in rng.integers(3, V, 7)]
    kw = dict(temperature=0.0, max_tokens=5)
    b = Batcher(engine)
    fill = [b.submit([int(t) for t in rng.integers(3, V, 20)], SamplingParams(**kw), lambda p: True)
            for _ in range(2)]
    g = b.submit(base, SamplingParams(**kw), lambda p: True)
    b.run()
    seq = g.seq
    assert seq not in (0, fill[0].seq) and engine.seq_cached[seq][:30] == base
    held = list(engine.seq_cached[seq])
    kv, lay = engine.model.kv, engine.model.kv.layout
    want_rows = [kv.k(i).read(np.uint8, seq * lay.ctx * 2 * lay.k_width, 2 * lay.k_width * len(held))
                 for i in range(lay.n_layer)]
    hc = HostCache(64 << 20)
    assert hc.before(engine, [7, 8, 9], seq=seq) == 0          # a prompt that cuts the slot: saved
    (entry,) = hc.entries.values()
    assert entry.tokens == held
    for i in range(lay.n_layer):
        assert np.array_equal(entry.rows[2 * i], want_rows[i])
    engine.seq_cached[seq] = []
    engine.model.forward_batch(TokenBatch.of([int(t) for t in rng.integers(3, V, 40)], 0, seq=seq))  # rows gone
    other = 3 if seq != 3 else 2
    engine.seq_cached[other] = []
    n = common_prefix(held, more)
    assert n == 30 < len(held)
    assert hc.before(engine, more, seq=other) == n            # written back into another slot
    assert engine.seq_cached[other] == base
    pieces = []
    before = engine.stats["reused_tokens"]
    h = b.submit(more, SamplingParams(**kw), lambda p: pieces.append(p) or True)
    b.run()
    assert h.seq == other and engine.stats["reused_tokens"] - before == n
    engine.forget()
    want = []
    engine.generate(more, SamplingParams(**kw), lambda p: want.append(p) or True)
    assert_same(as_tuple(pieces), as_tuple(want))


@pytest.fixture(scope="module")
def recurrent(device, tmp_path_factory):
    """qwen35 (DeltaNet layers: a recurrent state per slot), prompts as token ids."""
    from tests.ggufgen.qwen35 import write_qwen35
    from vramd.gpu.residency import Residency

    path = write_qwen35(tmp_path_factory.mktemp("batching35") / "q.gguf", weight_type="F32", seed=11)
    mf = validate_gguf(path)
    res = Residency(device)
    lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(spec_for(mf), CHUNK), n_seq=3)
    res.restore(["weights", "state"])
    e = Engine(lm, res, CTX, chunk=CHUNK)
    assert e.model.kv.recurrent
    yield e
    e.close()
    res.close()


def test_recurrent_slots_give_their_solo_output(recurrent):
    """A recurrent slot continues its state where a prompt extends what it holds, resumes from
    its checkpoint where a prompt extends the slot's last prompt (not its reply), else
    prefills from 0; each request gives its solo (fresh) output."""
    e = recurrent
    V = e.spec.n_vocab
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(3, V, n)] for n in (5, 37, 12, 20)]
    prompts.append(prompts[1] + [int(t) for t in rng.integers(3, V, 6)])   # extends request 1's prompt
    kws = [dict(temperature=0.0, max_tokens=6), dict(temperature=0.8, seed=2, max_tokens=6)] * 3
    want = []
    for ids, kw in zip(prompts, kws):
        e.forget()
        e.model.clear_seq(0)
        pieces = []
        e.generate(ids, SamplingParams(**kw), lambda p: pieces.append(p) or True)
        want.append(as_tuple(pieces))
    e.forget()
    b = Batcher(e)
    got = [[] for _ in prompts]
    gens = [b.submit(ids, SamplingParams(**kw), lambda p, k=k: got[k].append(p) or True)
            for k, (ids, kw) in enumerate(zip(prompts[:4], kws))]
    b.run()
    # the fifth extends the prompt of the second, but that slot also holds its generated tokens:
    # the state cannot go back; it resumes from the slot's checkpoint, the state after all of
    # that prompt but its last token; a prompt extending all the slot holds continues the state
    # (reuse = what it holds)
    gens.append(b.submit(prompts[4], SamplingParams(**kws[4]), lambda p: got[4].append(p) or True))
    held = list(e.seq_cached[gens[3].seq])
    cont = held + [int(t) for t in rng.integers(3, V, 4)]
    cont_out = []
    gens.append(b.submit(cont, SamplingParams(temperature=0.0, max_tokens=4), lambda p: cont_out.append(p) or True))
    b.run()
    assert gens[4].reused == len(prompts[1]) - 1 and gens[4].seq == gens[1].seq
    assert gens[5].reused == len(held) and gens[5].seq == gens[3].seq
    for k in range(5):
        assert_same(as_tuple(got[k]), want[k], f"request {k}")
    e.forget()
    e.model.clear_seq(0)
    solo_cont = []
    e.generate(cont, SamplingParams(temperature=0.0, max_tokens=4), lambda p: solo_cont.append(p) or True)
    assert_same(as_tuple(cont_out), as_tuple(solo_cont))

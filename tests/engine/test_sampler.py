"""Tests of vramd.engine.sampler: parameter validation, the filter chain
against a plain step-by-step rendering of llama.cpp's (top-k, top-p, min-p,
temperature, each on the whole sorted candidate list), seeded draws and their
distribution, log-probabilities, and stop strings split across chunks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vramd.engine.sampler import (SamplingParams, Sampler, StopMatcher, log_softmax,
                                  top_logprobs)
from vramd.errors import UsageError, VramdError


# --- parameters ---------------------------------------------------------------------------

def test_defaults_are_llama_servers():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert p.seed is None and p.max_tokens is None and p.stop == () and p.logprobs is None


def test_values_are_normalised():
    p = SamplingParams(temperature=0, top_k=40.0, stop="\n\n", seed=7, logprobs=5)
    assert p.greedy and p.top_k == 40 and isinstance(p.top_k, int)
    assert p.stop == ("\n\n",) and p.temperature == 0.0
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be at least 0"),
    ({"temperature": float("nan")}, "temperature must be at least 0"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"temperature": True}, "temperature must be a number"),
    ({"top_k": -1}, "top_k must be at least 0"),
    ({"top_k": 1.5}, "top_k must be an integer"),
    ({"top_p": 1.5}, "top_p must be between 0 and 1"),
    ({"min_p": -0.01}, "min_p must be between 0 and 1"),
    ({"seed": -5}, "seed must be between 0 and"),
    ({"seed": 1 << 64}, "seed must be between 0 and"),
    ({"max_tokens": -1}, "max_tokens must be at least 0"),
    ({"logprobs": 21}, "logprobs must be between 0 and 20"),
    ({"stop": ["ok", ""]}, "non-empty strings"),
    ({"stop": 5}, "a string or a list of strings"),
    ({"stop": ["s"] * 17}, "at most 16"),
    ({"stop": ["x" * 1025]}, "longer than 1024"),
])
def test_bad_values_are_usage_errors(kwargs, message):
    with pytest.raises(UsageError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.http_status == 400


# --- the filter chain ----------------------------------------------------------------------

def llama_chain(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> list[int]:
    """llama.cpp's top_k -> top_p -> min_p on a best-first candidate list,
    written out step by step (llama_sampler_top_k/top_p/min_p_apply)."""
    cands = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))
    if top_k > 0:
        cands = cands[:top_k]
    if top_p < 1.0:
        top = float(logits[cands[0]])
        probs = [math.exp(float(logits[i]) - top) for i in cands]
        total = sum(probs)
        cum = 0.0
        for n, pr in enumerate(probs):
            cum += pr / total
            if cum >= top_p:
                cands = cands[:n + 1]
                break
    if min_p > 0.0:
        floor = float(logits[cands[0]]) + math.log(min_p)
        cands = cands[:1] + [i for i in cands[1:] if float(logits[i]) >= floor]
    return cands


def probs_logits(*probs: float) -> np.ndarray:
    return np.log(np.array(probs, dtype=np.float32))


@pytest.mark.parametrize("kwargs, kept", [
    ({"top_k": 2}, 2),
    ({"top_p": 0.75}, 2),            # 0.5, then 0.8 >= 0.75
    ({"top_p": 0.45}, 1),
    ({"min_p": 0.2}, 3),             # 0.05 / 0.5 < 0.2
    ({"min_p": 0.7}, 1),
    ({}, 4),
])
def test_filters_by_hand(kwargs, kept):
    x = probs_logits(0.5, 0.3, 0.15, 0.05)
    params = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **kwargs}
    ids, _ = Sampler(SamplingParams(**params)).candidates(x)
    assert list(ids) == [0, 1, 2, 3][:kept]


def test_top_p_normalises_over_what_top_k_kept():
    x = probs_logits(0.4, 0.3, 0.2, 0.1)
    # Alone, top-p 0.5 needs two tokens (0.4 < 0.5) ...
    assert len(Sampler(SamplingParams(top_k=0, top_p=0.5, min_p=0)).candidates(x)[0]) == 2
    # ... after top-k 2 the first one is 4/7 >= 0.5: top-k comes first.
    assert len(Sampler(SamplingParams(top_k=2, top_p=0.5, min_p=0)).candidates(x)[0]) == 1


def test_temperature_comes_after_the_filters():
    # min-p on the raw logits keeps two tokens whatever the temperature.
    x = probs_logits(0.5, 0.3, 0.2)
    for t in (0.1, 1.0, 50.0):
        ids, _ = Sampler(SamplingParams(temperature=t, top_k=0, top_p=1.0, min_p=0.5)).candidates(x)
        assert list(ids) == [0, 1]


def test_chain_matches_the_step_by_step_reference():
    rng = np.random.default_rng(1)
    for trial in range(300):
        n = int(rng.integers(1, 60))
        x = (rng.standard_normal(n) * rng.uniform(0.1, 4)).astype(np.float32)
        if trial % 5 == 0:
            x = np.round(x)                       # ties
        top_k = int(rng.choice([0, 1, 3, 10, 100]))
        top_p = float(rng.choice([1.0, 0.95, 0.5, 0.1, 0.0]))
        min_p = float(rng.choice([0.0, 0.05, 0.3, 0.9]))
        sampler = Sampler(SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p))
        assert list(sampler.candidates(x)[0]) == llama_chain(x, top_k, top_p, min_p), trial


def test_chain_on_large_vocabularies():
    # Above 1024 candidates top-p sorts only a prefix that holds enough mass.
    rng = np.random.default_rng(4)
    for scale, top_p in ((0.5, 0.95), (3.0, 0.5), (8.0, 0.99), (1.0, 0.0)):
        x = (rng.standard_normal(5000) * scale).astype(np.float32)
        sampler = Sampler(SamplingParams(top_k=0, top_p=top_p, min_p=0.0))
        assert list(sampler.candidates(x)[0]) == llama_chain(x, 0, top_p, 0.0)


def test_greedy():
    x = np.array([1.0, 3.0, 3.0, -np.inf], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0, seed=1))
    assert sampler.sample(x) == 1                  # the lowest id of the tied best
    assert Sampler(SamplingParams(top_k=1, seed=3)).sample(np.array([0.0, 2.0, 1.0])) == 1


def test_same_seed_same_tokens():
    rng = np.random.default_rng(0)
    logits = [rng.standard_normal(1000).astype(np.float32) for _ in range(50)]
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    once = Sampler(params)
    first = [once.sample(x) for x in logits]
    again = Sampler(params)
    assert [again.sample(x) for x in logits] == first
    other = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=99))
    assert [other.sample(x) for x in logits] != first
    # No seed: a random one, reported so that the run can be repeated.
    unseeded = Sampler(SamplingParams(temperature=1.5))
    repeat = Sampler(SamplingParams(temperature=1.5, seed=unseeded.seed))
    assert [unseeded.sample(x) for x in logits] == [repeat.sample(x) for x in logits]


def test_draws_follow_the_tempered_distribution():
    x = probs_logits(0.5, 0.3, 0.15, 0.05)
    temperature = 2.0
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=3, top_p=1.0, min_p=0.0, seed=5))
    draws = np.bincount([sampler.sample(x) for _ in range(20000)], minlength=4) / 20000
    expected = np.exp(x[:3].astype(np.float64) / temperature)
    expected /= expected.sum()
    assert draws[3] == 0                           # removed by top-k
    assert np.abs(draws[:3] - expected).max() < 0.015


def test_bad_logits():
    sampler = Sampler(SamplingParams(seed=0))
    with pytest.raises(VramdError, match="NaN"):
        sampler.sample(np.array([0.0, np.nan]))
    with pytest.raises(VramdError, match="non-empty vector"):
        sampler.sample(np.zeros((2, 2)))
    with pytest.raises(VramdError, match="-inf"):
        sampler.sample(np.full(4, -np.inf))


def test_a_real_vocabulary_sized_vector():
    x = np.random.default_rng(2).standard_normal(262144).astype(np.float32) * 3
    for params in (SamplingParams(seed=1), SamplingParams(seed=1, top_k=0, min_p=0.0),
                   SamplingParams(temperature=0)):
        token = Sampler(params).sample(x)
        assert 0 <= token < x.shape[0]
    assert Sampler(SamplingParams(temperature=0)).sample(x) == int(np.argmax(x))


# --- logit bias and repetition penalties (vramd/engine/penalties.py) ------------------------

def greedy_run(params: SamplingParams, steps: list[np.ndarray], prompt=()) -> list[int]:
    sampler = Sampler(params, prompt=prompt)
    return [sampler.sample(x) for x in steps]


def reference_adjusted(x, generated, window, freq=0.0, presence=0.0, repeat=1.0, bias=()):
    """OpenAI's formula for frequency/presence (counts of sampled tokens), llama.cpp's for
    repeat_penalty (each distinct token of the window once), then the bias: element by element."""
    out = [float(v) for v in x]
    for t in set(window):
        out[t] = out[t] / repeat if out[t] > 0 else out[t] * repeat
    for t in set(generated):
        c = generated.count(t)
        out[t] -= c * freq + (1.0 if c > 0 else 0.0) * presence
    for t, b in bias:
        out[t] += b
    return out


def test_penalty_and_bias_values_are_checked():
    for kwargs, message in [({"frequency_penalty": 2.5}, "frequency_penalty must be between -2 and 2"),
                            ({"presence_penalty": -3}, "presence_penalty must be between -2 and 2"),
                            ({"presence_penalty": float("inf")}, "presence_penalty must be between"),
                            ({"repeat_penalty": 0}, "repeat_penalty must be more than 0"),
                            ({"repeat_last_n": -2}, "repeat_last_n must be between -1"),
                            ({"logit_bias": {"5": 101}}, r"logit_bias\['5'\] must be between -100 and 100"),
                            ({"logit_bias": {"x": 1}}, "'x' is not a token id"),
                            ({"logit_bias": {"-1": 1}}, "'-1' is not a token id"),
                            ({"logit_bias": {"5": "high"}}, r"logit_bias\['5'\] must be a number"),
                            ({"logit_bias": 7}, "logit_bias must map token ids to numbers"),
                            ({"logit_bias": {str(i): 1 for i in range(1025)}}, "at most 1024")]:
        with pytest.raises(UsageError, match=message):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={"7": 5, "2": -1.5}).logit_bias == ((2, -1.5), (7, 5.0))


def test_logit_bias_bans_and_forces_tokens():
    rng = np.random.default_rng(3)
    steps = [rng.standard_normal(50).astype(np.float32) * 4 for _ in range(40)]
    best = [int(np.argmax(x)) for x in steps]
    # -100 bans: greedy never takes the banned token, and takes the runner-up instead.
    banned = best[0]
    got = greedy_run(SamplingParams(temperature=0, logit_bias={str(banned): -100}), steps)
    assert banned not in got
    assert all(g == b for g, b in zip(got, best) if b != banned)
    # +100 forces, also when sampling at a high temperature.
    forced = greedy_run(SamplingParams(temperature=2.0, top_k=0, top_p=1, min_p=0, seed=1,
                                       logit_bias={"11": 100}), steps)
    assert forced == [11] * len(steps)
    # A small bias shifts the draw's distribution: the biased token comes up more often.
    x = np.zeros(4, dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=2, logit_bias={"3": math.log(3)}))
    draws = np.bincount([s._draw(s.adjust.apply(x)) for _ in range(20000)], minlength=4) / 20000
    assert abs(draws[3] - 0.5) < 0.015 and abs(draws[0] - 1 / 6) < 0.015
    # The logits handed in are never written.
    x0 = steps[0].copy()
    Sampler(SamplingParams(temperature=0, logit_bias={"1": 50}, presence_penalty=1)).sample(steps[0])
    assert np.array_equal(x0, steps[0])


def test_frequency_and_presence_penalties_follow_openais_formula():
    """Greedy over logits where token 0 always leads by a margin: without penalties it is picked
    every time; with them it is picked until its count has eaten the margin."""
    margin = 1.0
    x = np.array([margin, 0.0, -0.5, -0.7], dtype=np.float32)
    steps = [x] * 8
    assert greedy_run(SamplingParams(temperature=0), steps) == [0] * 8
    # presence 1.5 > margin: token 0 once, then token 1 once (it is at 0 - 1.5 after), ...
    got = greedy_run(SamplingParams(temperature=0, presence_penalty=1.5), steps)
    generated = []
    for step in steps:   # the reference: element by element, from the formula
        ref = reference_adjusted(step, generated, (), presence=1.5)
        generated.append(int(np.argmax(ref)))
    assert got == generated and got[:2] == [0, 1]
    got = greedy_run(SamplingParams(temperature=0, frequency_penalty=0.4), steps)
    generated = []
    for step in steps:
        generated.append(int(np.argmax(reference_adjusted(step, generated, (), freq=0.4))))
    assert got == generated
    assert got[:4] == [0, 0, 0, 1]    # 1.0 - 3 x 0.4 < 0: the fourth goes to token 1
    # Negative values encourage repetition: a token picked once keeps winning.
    y = np.array([1.0, 1.2, 0.0], dtype=np.float32)
    assert greedy_run(SamplingParams(temperature=0, presence_penalty=-1.0), [y] * 5) == [1] * 5


def test_repeat_penalty_counts_the_prompt_and_a_window_of_tokens():
    x = np.array([2.0, 1.5, -1.0, -1.2], dtype=np.float32)
    # The prompt holds token 0: at 1.5 penalty, 2.0 / 1.5 < 1.5, so token 1 wins from the first step.
    assert greedy_run(SamplingParams(temperature=0, repeat_penalty=1.5), [x], prompt=[0]) == [1]
    assert greedy_run(SamplingParams(temperature=0), [x], prompt=[0]) == [0]
    # A negative logit is multiplied: -1.0 x 1.5 = -1.5 < -1.2 (token 3 wins among the negatives).
    neg = np.array([-1.0, -1.2], dtype=np.float32)
    assert greedy_run(SamplingParams(temperature=0, repeat_penalty=1.5), [neg], prompt=[0]) == [1]
    # The window: with repeat_last_n 1 only the newest token counts; 0 turns it off.
    assert greedy_run(SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=1), [x],
                      prompt=[0, 2]) == [0]
    assert greedy_run(SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=0), [x], prompt=[0]) == [0]
    # Generated tokens enter the window: against a random sequence, the element-by-element reference.
    rng = np.random.default_rng(8)
    steps = [rng.standard_normal(30).astype(np.float32) for _ in range(60)]
    prompt = list(rng.integers(0, 30, 10))
    params = SamplingParams(temperature=0, repeat_penalty=1.3, repeat_last_n=8, frequency_penalty=0.2,
                            presence_penalty=0.1, logit_bias={"4": -2.0})
    got = greedy_run(params, steps, prompt=prompt)
    history, generated = list(prompt), []
    for step in steps:
        ref = reference_adjusted(step, generated, history[-8:], freq=0.2, presence=0.1, repeat=1.3,
                                 bias=[(4, -2.0)])
        t = int(np.argmax(np.array(ref, dtype=np.float32)))
        history.append(t)
        generated.append(t)
    assert got == generated
    assert len(set(got)) > 5       # the penalties did something: greedy alone repeats less varied


# --- log-probabilities ---------------------------------------------------------------------

def test_log_softmax_and_top_logprobs():
    x = np.array([2.0, 1.0, 2.0, -1.0, 0.5], dtype=np.float32)
    lp = log_softmax(x)
    assert math.isclose(float(np.exp(lp).sum()), 1.0, rel_tol=1e-12)
    naive = [float(v) - math.log(sum(math.exp(float(w)) for w in x)) for v in x]
    assert np.allclose(lp, naive, atol=1e-12)
    top = top_logprobs(x, 3)
    assert [i for i, _ in top] == [0, 2, 1]        # ties by lower id
    assert all(math.isclose(v, naive[i], abs_tol=1e-12) for i, v in top)
    assert top_logprobs(x, 0) == [] and len(top_logprobs(x, 99)) == 5
    assert Sampler.top_logprobs(x, 1) == top[:1]


# --- stop strings --------------------------------------------------------------------------

def feed_all(matcher: StopMatcher, chunks: list[str]) -> tuple[list[str], str]:
    out = [matcher.feed(c) for c in chunks]
    return out, matcher.flush()


def test_stop_string_split_across_chunks():
    m = StopMatcher(["</end>"])
    out, tail = feed_all(m, ["Hello </", "en", "d> ignored", "more"])
    assert out == ["Hello ", "", "", ""] and tail == ""
    assert m.stopped and m.matched == "</end>"


def test_a_false_start_is_released():
    m = StopMatcher(["</end>"])
    assert m.feed("a </") == "a " and m.pending == 2
    assert m.feed("b") == "</b"                    # not a stop after all
    assert m.pending == 0 and not m.stopped
    assert m.feed("x <") == "x " and m.flush() == "<"


def test_earliest_stop_wins_and_text_before_it_is_kept():
    m = StopMatcher(["world", "lo w"])
    out, _ = feed_all(m, ["hel", "lo world"])
    assert "".join(out) == "hel" and m.matched == "lo w"


def test_stop_inside_one_chunk_and_at_the_start():
    m = StopMatcher(["\n\n"])
    assert m.feed("line one\n\nline two") == "line one" and m.stopped
    assert m.feed("anything") == ""
    m = StopMatcher(["STOP"])
    assert m.feed("STOP now") == "" and m.stopped


def test_overlapping_prefixes():
    # "aab" must not be missed because "aa" looked like the start of it.
    m = StopMatcher(["aab"])
    out, _ = feed_all(m, ["xa", "a", "a", "b!"])
    assert "".join(out) == "xa" and m.stopped


def test_no_stop_strings():
    m = StopMatcher([])
    assert m.feed("anything at all") == "anything at all" and m.pending == 0


def test_random_chunkings_agree_with_a_whole_string_search():
    rng = np.random.default_rng(3)
    stops = ["ab", "bca", "cc"]
    for _ in range(500):
        text = "".join(rng.choice(list("abcx"), size=int(rng.integers(0, 20))))
        cuts = sorted(rng.integers(0, len(text) + 1, size=int(rng.integers(0, 5))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        m = StopMatcher(stops)
        emitted = "".join(m.feed(c) for c in chunks) + m.flush()
        hits = [text.find(s) for s in stops if s in text]
        assert emitted == (text[:min(hits)] if hits else text), (text, chunks)

"""Choosing the next token from the logits, and where generation stops.

Owns: `SamplingParams` (a request's sampling settings, validated: a bad value
is a `UsageError`, an HTTP 400), `Sampler` (logit bias and repetition
penalties first (vramd/engine/penalties.py), then greedy at temperature 0,
otherwise top-k, top-p, min-p, temperature, then a draw from a seeded
`numpy.random.Generator`), `log_softmax` / `top_logprobs` for the `logprobs`
of a response, and `StopMatcher`, which finds stop strings in streamed text
and holds back what might be the start of one.

Does not own: the logits (the engine's forward pass), end-of-generation
tokens (`Tokenizer.is_eog`; the generation loop ends at one unless
`ignore_eos`), counting `max_tokens` (the generation loop reads it from the
params).

The filter chain is llama.cpp's default (common_params_sampling.samplers):
logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist, each keeping at least one
token; top-k 0 and top-p 1 and min-p 0 disable their filter.  Note that
llama.cpp applies the temperature last, so top-p and min-p see the raw
logits; vramd does the same.  The draw uses numpy's PCG64 generator, not
llama.cpp's mt19937: the same seed gives the same tokens in vramd, not the
same tokens as llama.cpp.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from vramd.engine.penalties import Adjuster
from vramd.errors import UsageError, VramdError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024              # entries: OpenAI documents no bound; 300 is what its API takes


@dataclass
class Piece:
    """One generated token as the engine emits it (and the API reports it)."""

    token: int
    text: str                       # the text it completes (may be "" mid-character)
    logprob: float | None = None
    top: list[tuple[str, float]] | None = None   # (token text, logprob), best first


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling settings.  Defaults are llama-server's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None           # None: a random seed (see Sampler.seed)
    max_tokens: int | None = None     # None: until end of generation or the context is full
    stop: tuple[str, ...] = field(default=())
    logprobs: int | None = None       # how many top alternatives to report per token
    # Before the filter chain (vramd/engine/penalties.py); these defaults change nothing.
    frequency_penalty: float = 0.0    # OpenAI's, -2..2, over the generated tokens
    presence_penalty: float = 0.0     # OpenAI's, -2..2, over the generated tokens
    repeat_penalty: float = 1.0       # llama.cpp's, over the last repeat_last_n tokens (prompt too)
    repeat_last_n: int = 64           # llama.cpp's default; -1: every token, 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, -100..100) pairs
    # An llguidance grammar (vramd/engine/grammar.py) the tokens must follow; None: free.
    grammar: str | None = None
    # Decode control tokens as their text (a tool-call format whose marker is one, Mistral's
    # [TOOL_CALLS], must see it to parse the call).
    special_text: bool = False
    # llama.cpp's ignore_eos: the end-of-generation tokens are never drawn (Generation bans
    # them), so max_tokens or the context ends the generation (fixed-length benchmark runs).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "temperature", _number("temperature", self.temperature, 0.0, None))
        set_(self, "top_k", _integer("top_k", self.top_k, 0, None))
        set_(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0))
        set_(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            set_(self, "seed", _integer("seed", self.seed, 0, (1 << 64) - 1))
        if self.max_tokens is not None:
            set_(self, "max_tokens", _integer("max_tokens", self.max_tokens, 0, None))
        if self.logprobs is not None:
            set_(self, "logprobs", _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        set_(self, "stop", _stop_strings(self.stop))
        set_(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        set_(self, "presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_(self, "repeat_penalty", _number("repeat_penalty", self.repeat_penalty, 0.0, 10.0))
        if self.repeat_penalty == 0.0:
            raise UsageError("repeat_penalty must be more than 0 (1 is off)")
        set_(self, "repeat_last_n", _integer("repeat_last_n", self.repeat_last_n, -1, 1 << 20))
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        if not isinstance(self.ignore_eos, bool):
            raise UsageError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _number(name: str, value, low: float, high: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        raise UsageError(f"{name} must be {bound}, got {value!r}")
    return value


def _integer(name: str, value, low: int, high: int | None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)            # JSON clients send 40.0 for 40
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise UsageError(f"{name} must be {bound}, got {value}")
    return value


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise UsageError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise UsageError(f"stop has {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise UsageError(f"stop strings must be non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise UsageError(f"a stop string is longer than {MAX_STOP_CHARS} characters")
    return tuple(stop)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a decimal string, or an int) to a bias, or (id, bias) pairs."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        items = list(items)
    except TypeError:
        raise UsageError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}") from None
    if len(items) > MAX_LOGIT_BIAS:
        raise UsageError(f"logit_bias has {len(items)} entries, at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise UsageError(f"logit_bias must map token ids to numbers, got {item!r}")
        key, value = item
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10 else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise UsageError(f"logit_bias: {key!r} is not a token id (a non-negative integer)")
        out[token] = _number(f"logit_bias[{key!r}]", value, -100.0, 100.0)
    return tuple(sorted(out.items()))


# --- sampling -------------------------------------------------------------------------

class Sampler:
    """Draws tokens for one request.  The same params (seed included) and the
    same logits give the same tokens."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()):
        """prompt: the tokens before the generation (repeat_penalty's window starts in them)."""
        self.params = params
        # The seed actually used, so that a response can report it.
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self.adjust = Adjuster(params, prompt)

    def sample(self, logits: np.ndarray) -> int:
        """The next token; it counts for the penalties of the steps after."""
        token = self._draw(self.adjust.apply(_check_logits(logits)))
        self.adjust.accept(token)
        return token

    def _draw(self, x: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(x))  # greedy; ties: the lowest id
        # The draw needs no order unless top-p has to cut a best-first prefix.
        ids, vals = self._filter(x, ordered=p.top_p < 1.0)
        if len(ids) == 1:
            return int(ids[0])
        scaled = vals / p.temperature
        probs = np.exp(scaled - scaled.max())
        cum = np.cumsum(probs)
        pick = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
        return int(ids[min(pick, len(ids) - 1)])

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens left after top-k, top-p and min-p, best first (ties: lower
        id first), with their raw logits as float64."""
        return self._filter(_check_logits(logits), ordered=True)

    def _filter(self, x: np.ndarray, ordered: bool) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        n = x.shape[0]
        if 0 < p.top_k < n:
            ids = _best(x, p.top_k)
            vals = x[ids].astype(np.float64)
        else:
            ids = np.arange(n)
            vals = x.astype(np.float64)
        top = float(vals.max())
        if not math.isfinite(top):
            raise VramdError("sampling: every logit is -inf")
        # top-p normalises over everything top-k kept: take the sum before min-p.
        denom = float(np.exp(vals - top).sum()) if p.top_p < 1.0 else 1.0
        if p.min_p > 0.0:
            # min-p keeps the tokens whose logit is within log(min_p) of the best.
            # It keeps a best-first prefix, as top-p does, so applying it before
            # top-p's cut gives what llama.cpp's top-p-then-min-p gives.
            keep = vals >= top + math.log(p.min_p)
            ids, vals = ids[keep], vals[keep]
        if p.top_p < 1.0 and len(ids) > 1024:
            # Sorting a whole vocabulary costs tens of ms: find a best-first
            # prefix that already holds top_p of the mass and sort only that.
            m = 1024
            while m < len(ids):
                best = np.argpartition(vals, len(vals) - m)[len(vals) - m:]
                if float(np.exp(vals[best] - top).sum()) / denom >= p.top_p:
                    keep = vals >= vals[best].min()      # the prefix, ties included
                    ids, vals = ids[keep], vals[keep]
                    break
                m *= 8
        if not ordered:
            return ids, vals
        # ids are ascending here unless top-k sorted them, so a stable sort
        # by value leaves ties in id order.
        order = np.argsort(-vals, kind="stable")
        ids, vals = ids[order], vals[order]
        if p.top_p < 1.0:
            cum = np.cumsum(np.exp(vals - top)) / denom
            # The first position where the running sum reaches top_p is kept too.
            last = int(np.searchsorted(cum, p.top_p, side="left"))
            ids, vals = ids[:last + 1], vals[:last + 1]
        return ids, vals


def _check_logits(logits) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1 or x.shape[0] == 0:
        raise VramdError(f"sampling: logits must be a non-empty vector, got shape {x.shape}")
    if np.isnan(x).any():
        raise VramdError("sampling: the logits contain NaN")
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of every token, from the raw logits (float64)."""
    x = _check_logits(logits).astype(np.float64)
    top = x.max()
    return x - top - math.log(float(np.exp(x - top).sum()))


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens and their log-probabilities under the raw
    logits (no temperature, no filters: what OpenAI's `logprobs` report),
    best first, ties by lower id."""
    lp = log_softmax(logits)
    k = max(0, min(int(k), lp.shape[0]))
    if k == 0:
        return []
    return [(int(i), float(lp[i])) for i in _best(lp, k)]


def _best(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values, best first, ties by lower id (also at the
    k-th place, where argpartition alone would pick any of the tied ones)."""
    n = x.shape[0]
    kth = x[np.argpartition(x, n - k)[n - k:]].min()
    ids = np.flatnonzero(x >= kth)
    return ids[np.lexsort((ids, -x[ids]))][:k]


Sampler.top_logprobs = staticmethod(top_logprobs)


# --- stop strings ------------------------------------------------------------------------

class StopMatcher:
    """Finds stop strings in text that arrives in pieces.

    `feed(text)` returns the text that is safe to send now: everything before
    a stop string once one is complete (then `stopped` is true, `matched` says
    which, and the rest is dropped, the stop string included, as OpenAI's API
    does), otherwise everything except the longest tail that could still
    become a stop string, which is held back (`pending` characters) until the
    next piece decides.  `flush()` hands out what is held when generation
    ends for another reason."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def pending(self) -> int:
        return len(self._held)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        best = -1
        for s in self.stops:
            at = buf.find(s)
            if at >= 0 and (best < 0 or at < best):
                best, self.matched = at, s
        if best >= 0:
            self._held = ""
            return buf[:best]
        hold = 0
        for length in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-length:]
            if any(s.startswith(tail) for s in self.stops):
                hold = length
                break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

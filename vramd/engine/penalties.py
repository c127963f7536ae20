"""What a request does to the logits before the filter chain: logit bias and repetition penalties.

Owns `Adjuster`: one request's `logit_bias` (OpenAI: a number from -100 to
100 added to a token's logit; -100 bans it in practice, 100 all but forces
it), OpenAI's `frequency_penalty` and `presence_penalty`, and llama.cpp's
`repeat_penalty` over the last `repeat_last_n` tokens, with the tokens they
count.  The sampler (vramd/engine/sampler.py) calls `apply` on each step's
logits before greedy or the top-k/top-p/min-p chain, as llama.cpp's
sampler chain puts its logit-bias and penalties samplers first, and
`accept` with each token it drew.

What counts as "the text so far":

- frequency and presence, as OpenAI defines them
  (`logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`,
  c[j] how often token j was *sampled* before): the generated tokens only,
  all of them;
- repeat_penalty, as llama.cpp's: the last `repeat_last_n` tokens of the
  prompt and the generation together (-1: all of them, 0: off), each
  distinct token once: a positive logit divided by the penalty, a negative
  one multiplied (so a penalty above 1 always makes the token less likely).

The logprobs a response reports are of the model's distribution, before
these adjustments (as llama.cpp's, without `post_sampling_probs`).
Nothing is copied when no adjustment is asked for.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence

import numpy as np


class Adjuster:
    def __init__(self, params, prompt: Sequence[int] = ()):
        self.bias = tuple(params.logit_bias)
        self.freq, self.presence = params.frequency_penalty, params.presence_penalty
        self.repeat, last_n = params.repeat_penalty, params.repeat_last_n
        self.generated: Counter = Counter()
        # The repeat window: the newest last_n tokens of prompt and generation (None: unbounded).
        self._window_on = self.repeat != 1.0 and last_n != 0
        self.window: deque = deque(prompt if self._window_on else (), maxlen=None if last_n < 0 else last_n)
        self.active = bool(self.bias) or self.freq != 0.0 or self.presence != 0.0 or self._window_on

    def apply(self, x: np.ndarray) -> np.ndarray:
        """The adjusted logits (a new float32 array; `x` itself is never written)."""
        if not self.active:
            return x
        out = np.array(x, dtype=np.float32, copy=True)
        n = out.shape[0]
        if self._window_on and self.window:
            ids = np.fromiter(set(self.window), dtype=np.int64)
            ids = ids[(ids >= 0) & (ids < n)]
            v = out[ids]
            out[ids] = np.where(v > 0, v / self.repeat, v * self.repeat)
        if self.generated and (self.freq or self.presence):
            ids = np.fromiter(self.generated.keys(), dtype=np.int64, count=len(self.generated))
            counts = np.fromiter(self.generated.values(), dtype=np.float32, count=len(self.generated))
            keep = ids < n
            out[ids[keep]] -= counts[keep] * self.freq + self.presence
        for token, b in self.bias:
            if token < n:
                out[token] += b
        return out

    def accept(self, token: int) -> None:
        """A token was drawn: it counts from the next step on."""
        if not self.active:
            return
        self.generated[token] += 1
        if self._window_on:
            self.window.append(token)

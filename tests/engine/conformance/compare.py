"""How an engine's logits are held against llama.cpp's greedy chain.

Owns `Comparison` and `compare(chain, logits, keep=None)`.  `logits` are an
engine's (or the numpy reference's) for prompt + chain.tokens[:-1] at
positions 0.. (teacher-forced along llama.cpp's chain); row
len(prompt) - 1 + i is the distribution llama.cpp's step i was read from.
Per step i:
  diff[i]    max over llama.cpp's top-K ids of |engine log-softmax - llama.cpp logprob|
  margin[i]  llama.cpp's top-1 minus top-2 log-probability (how near a tie)
  agree[i]   the engine's argmax is llama.cpp's greedy token
  top1[i]    llama.cpp's top-1 probability (the distribution's peakedness)
`keep` (bool per step) excludes steps from `worst()`, e.g. those a MoE router
decides by a near-tie (the suite says which and why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.engine.conformance.peer import Chain


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass
class Comparison:
    diff: np.ndarray
    margin: np.ndarray
    agree: np.ndarray
    top1: np.ndarray
    keep: np.ndarray

    def worst(self) -> float:
        return float(self.diff[self.keep].max()) if self.keep.any() else 0.0

    def flips(self, near_tie: float) -> list[tuple[int, float]]:
        """(step, llama.cpp's margin) of every kept step whose greedy token
        differs although llama.cpp's margin is above `near_tie`."""
        bad = ~self.agree & self.keep & (self.margin > near_tie)
        return [(int(i), round(float(self.margin[i]), 4)) for i in np.flatnonzero(bad)]


def compare(chain: Chain, logits: np.ndarray, keep: np.ndarray | None = None) -> Comparison:
    n = len(chain.tokens)
    first = len(chain.prompt) - 1
    if logits.shape[0] < first + n:
        raise ValueError(f"{logits.shape[0]} rows of logits, the chain needs {first + n}")
    lp = log_softmax(logits[first:first + n])
    ids = np.array([[t for t, _ in step] for step in chain.top])
    want = np.array([[v for _, v in step] for step in chain.top])
    diff = np.abs(np.take_along_axis(lp, ids, axis=1) - want).max(axis=1)
    return Comparison(diff=diff, margin=want[:, 0] - want[:, 1], agree=lp.argmax(axis=1) == ids[:, 0],
                      top1=np.exp(want[:, 0]), keep=np.ones(n, bool) if keep is None else np.asarray(keep))

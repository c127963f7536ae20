"""What every synthetic model shares: its random streams and logit scale.

Owns `rng(seed, name)` (one numpy stream per tensor, seeded by (seed,
crc32(name)), so changing one option leaves every other tensor as it was),
`normal(spec, name, shape, std)` and `gain(spec, name, n, scale)` (a norm
weight 1 + N(0, 0.1^2)), and `LOGIT_STD` / `TIED_EMBD` (tests/ggufgen/llama.py's
header says why these values).
"""

from __future__ import annotations

import zlib

import numpy as np

LOGIT_STD = 4.0
TIED_EMBD = 0.25


def rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def normal(spec, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng(spec.seed, name).standard_normal(shape) * std).astype(np.float32)


def gain(spec, name: str, n: int, scale: float = 1.0) -> np.ndarray:
    return (scale * (1.0 + 0.1 * rng(spec.seed, name).standard_normal(n))).astype(np.float32)

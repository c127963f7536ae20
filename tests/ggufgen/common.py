"""What every synthetic model shares: its random streams and logit scale.

Owns `rng(seed, name)` (one numpy stream per tensor, seeded by (seed,
crc32(name)), so changing one option leaves every other tensor as it was),
`normal(spec, name, shape, std)` and `gain(spec, name, n, scale)` (a norm
weight 1 + N(0, 0.1^2)), `LOGIT_STD` / `TIED_EMBD` (tests/ggufgen/llama.py's
header says why these values), and `start_writer`, the GGUFWriter with the
metadata every llama-shaped writer (llama.py, moe.py) begins with.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import gguf
import numpy as np

from tests.ggufgen.quant import FILE_TYPES, WEIGHT_TYPES

LOGIT_STD = 4.0
TIED_EMBD = 0.25


def rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def normal(spec, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng(spec.seed, name).standard_normal(shape) * std).astype(np.float32)


def gain(spec, name: str, n: int, scale: float = 1.0) -> np.ndarray:
    return (scale * (1.0 + 0.1 * rng(spec.seed, name).standard_normal(n))).astype(np.float32)


def output_head(spec, e: int) -> dict[str, np.ndarray]:
    """output_norm (and output, unless tied), scaled so that the logits are peaked
    enough for greedy tests to mean something (LOGIT_STD), in file order."""
    if spec.tied_output:
        return {"output_norm.weight": gain(spec, "output_norm.weight", e, LOGIT_STD / TIED_EMBD)}
    return {"output_norm.weight": gain(spec, "output_norm.weight", e),
            "output.weight": normal(spec, "output.weight", (spec.n_vocab, e), LOGIT_STD / np.sqrt(e))}


def start_writer(path: Path, spec, n_ff: int | None) -> gguf.GGUFWriter:
    """A GGUFWriter on `path` with spec's name, file type, context length, widths,
    head counts, eps and RoPE base and dimension (and feed_forward_length n_ff
    after embedding_length, unless None), in the order the writers always wrote them."""
    writer = gguf.GGUFWriter(str(path), spec.gguf_arch)
    writer.add_name(f"synthetic-{spec.arch}-{spec.weight_type}-{spec.seed}")
    writer.add_file_type(FILE_TYPES[WEIGHT_TYPES[spec.weight_type]])
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    if n_ff is not None:
        writer.add_feed_forward_length(n_ff)
    writer.add_block_count(spec.n_layer)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_rope_dimension_count(getattr(spec, "rot", spec.head_dim))
    return writer

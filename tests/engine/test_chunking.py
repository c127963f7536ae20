"""Prefill chunks (vramd/engine/scratch.py chunk_tokens): the tunable's default
per architecture, the cut that keeps every activation buffer of a chunk
within one storage binding, the scratch it implies, and a prompt run in
chunks of several sizes giving the same logits."""
import dataclasses

import numpy as np
import pytest

from tests.ggufgen.llama import write_llama
from tests.ggufgen.moe import write_moe
from vramd.engine.arch import spec_for
from vramd.engine.scratch import BUFFER_BYTES, MAX_CHUNK, chunk_tokens, scratch_layout
from vramd.errors import UsageError
from vramd.model.footprint import footprint
from vramd.model.gguf_check import validate_gguf


def test_defaults_and_the_tunable(tmp_path):
    dense = spec_for(validate_gguf(write_llama(tmp_path / "l.gguf", seed=1)))
    moe = spec_for(validate_gguf(write_moe(tmp_path / "m.gguf", arch="qwen3moe", n_layer=2, seed=1)))
    assert chunk_tokens(dense) == 512 and chunk_tokens(moe) == 64
    assert chunk_tokens(dense, 48) == 48 and chunk_tokens(moe, 1000) == 1000
    for bad in (0, MAX_CHUNK + 1):
        with pytest.raises(UsageError, match="prefill chunk"):
            chunk_tokens(dense, bad)


def test_a_chunk_is_cut_to_what_one_binding_holds(tmp_path):
    """An FFN of 65,536 floats a token: 512 rows of gate are exactly 128 MiB, 2048 would be 512."""
    spec = dataclasses.replace(spec_for(validate_gguf(write_llama(tmp_path / "l.gguf", seed=1))), n_ff=65536)
    assert chunk_tokens(spec, 2048) == BUFFER_BYTES // (4 * 65536) == 512
    sizes = dict(scratch_layout(spec, 2048))
    assert sizes["gate"] == BUFFER_BYTES and max(b for n, b in sizes.items() if n != "logits") <= BUFFER_BYTES


def test_the_footprint_reports_the_chunk_and_its_scratch(tmp_path):
    mf = validate_gguf(write_llama(tmp_path / "l.gguf", seed=1))
    small, big = footprint(mf, 64, chunk=16), footprint(mf, 64, chunk=1024)
    assert (small.chunk, big.chunk, footprint(mf, 64).chunk) == (16, 1024, 512)
    assert small.layouts["scratch"] == scratch_layout(spec_for(mf), 16)
    assert small.device["scratch"] < big.device["scratch"] and small.to_json()["prefill_chunk"] == 16


def test_chunk_sizes_give_the_same_logits(device, tmp_path):
    """19 prompt tokens in one chunk, in chunks of 5 (the last of 4) and of 2: the same logits of every row
    (the scratch laid out for the chunk given, the model running that chunk)."""
    from vramd.engine.model import TransformerModel
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    path = write_llama(tmp_path / "l.gguf", seed=4, n_vocab=384, n_embd=64, n_ff=160, n_head=4, n_head_kv=2)
    mf = validate_gguf(path)
    tokens = list(np.random.default_rng(3).integers(3, 384, 19))
    got = []
    for chunk in (None, 5, 2):
        with Residency(device) as res:
            lm = loader.load(path, res, 32, mf=mf, scratch=scratch_layout(spec_for(mf), chunk))
            res.restore(["weights", "state"])
            m = TransformerModel(lm, res, 32, lm.scratch, chunk)
            try:
                got.append(m.forward(tokens, 0, all_logits=True))
            finally:
                m.close()
    for other in got[1:]:   # the same math; f32 sums of other kernels (matvec for 1 row, matmul for more)
        assert other.shape == got[0].shape and np.abs(other - got[0]).max() < 1e-4 * np.abs(got[0]).max()

"""Prefill chunks (vramd/engine/scratch.py chunk_tokens): the tunable's default
per architecture, the cut that keeps every activation buffer of a chunk
within one storage binding (the device's maxStorageBufferRange where the
scratch is sized for a device, the Vulkan minimum where none is known, as
`vramd plan` reports), the scratch it implies, and a prompt run in chunks of
several sizes giving the same logits."""
import dataclasses
import json

from click.testing import CliRunner

import numpy as np
import pytest

from tests.ggufgen.llama import write_llama
from tests.ggufgen.moe import write_moe
from vramd.engine.arch import spec_for
from vramd.cli import cli
from vramd.engine.scratch import BUFFER_BYTES, MAX_CHUNK, buffer_cap, chunk_tokens, scratch_layout
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


# an H200's limits as Residency.limits reports them (maxStorageBufferRange 4 GiB - 1)
H200 = {"max_allocation": 1 << 62, "max_storage_range": (1 << 32) - 1, "storage_alignment": 64,
        "block_bytes": 256 << 20}


def test_the_cap_is_the_devices_binding():
    assert buffer_cap(None) == buffer_cap({"storage_alignment": 256}) == BUFFER_BYTES == 128 << 20
    assert buffer_cap(H200) == (1 << 32) - 64   # down to the alignment: one piece (Tensor.views)
    assert buffer_cap(dict(H200, max_allocation=1 << 30)) == 1 << 30   # and within one allocation
    assert buffer_cap({"max_storage_range": 128 << 20, "storage_alignment": 16, "max_allocation": 1 << 40}) == 128 << 20


def test_a_larger_device_takes_larger_chunks(tmp_path):
    """The 65,536-float FFN: 2048 rows are 512 MiB, cut to 512 rows under 128 MiB, whole under an H200's range;
    the footprint sized for the device (serve's) cuts the same way, plan's says what it assumed."""
    mf = validate_gguf(write_llama(tmp_path / "l.gguf", seed=1))
    spec = dataclasses.replace(spec_for(mf), n_ff=65536)
    assert chunk_tokens(spec, 2048, buffer_cap(H200)) == 2048
    assert chunk_tokens(spec, 16384, buffer_cap(H200)) == buffer_cap(H200) // (4 * 65536) == 16383
    assert dict(scratch_layout(spec, 2048, cap=buffer_cap(H200)))["gate"] == 512 << 20
    # a file whose FFN is 4096 floats a token (16 KiB): 8192 tokens under 128 MiB, every one allowed under 4 GiB
    wide = validate_gguf(write_llama(tmp_path / "w.gguf", seed=1, n_embd=64, n_ff=4096, n_head=4, n_head_kv=2))
    big, small = footprint(wide, 64, chunk=MAX_CHUNK, limits=H200), footprint(wide, 64, chunk=MAX_CHUNK)
    assert (big.chunk, big.max_buffer, big.max_buffer_source) == (MAX_CHUNK, buffer_cap(H200), "device")
    assert (small.chunk, small.max_buffer, small.max_buffer_source) == (8192, BUFFER_BYTES, "assumed")
    assert big.layouts["scratch"] == scratch_layout(spec_for(wide), MAX_CHUNK, cap=buffer_cap(H200))
    given = footprint(mf, 64, max_buffer=1 << 30)
    assert (given.max_buffer, given.max_buffer_source) == (1 << 30, "given")
    assert given.to_json()["max_buffer_bytes"] == 1 << 30 and small.to_json()["max_buffer_source"] == "assumed"


def test_plan_reports_the_cap_it_assumed(tmp_path):
    path = str(write_llama(tmp_path / "l.gguf", seed=1))
    r = CliRunner().invoke(cli, ["plan", path, "--ctx", "64"])
    assert r.exit_code == 0, r.output
    assert "prefill chunk cap: one activation buffer at most 128.0 MiB (assumed: the Vulkan minimum" in r.output
    r = CliRunner().invoke(cli, ["plan", path, "--ctx", "64", "--max-buffer", "4GiB", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert (got["max_buffer_bytes"], got["max_buffer_source"]) == ((1 << 32) - 1, "given")
    for bad in ("64MiB", "5GiB", "lots"):
        r = CliRunner().invoke(cli, ["plan", path, "--ctx", "64", "--max-buffer", bad])
        assert isinstance(r.exception, UsageError) and "--max-buffer" in str(r.exception)   # main prints one line


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


def test_the_model_never_runs_more_rows_than_its_scratch_holds(device, tmp_path):
    """A scratch laid out for 5 tokens (as a footprint under a smaller cap would) and no chunk given: the model's
    chunks are the scratch's 5 rows, not the architecture's 512; a chunk given within it is kept."""
    from vramd.engine.model import TransformerModel
    from vramd.gpu.residency import Residency
    from vramd.model import loader
    path = write_llama(tmp_path / "l.gguf", seed=4, n_vocab=384, n_embd=64, n_ff=160, n_head=4, n_head_kv=2)
    mf = validate_gguf(path)
    with Residency(device) as res:
        lm = loader.load(path, res, 32, mf=mf, scratch=scratch_layout(spec_for(mf), 5))
        for batch, want in ((None, 5), (3, 3)):
            m = TransformerModel(lm, res, 32, lm.scratch, batch)
            try:
                assert m.batch == want
            finally:
                m.close()

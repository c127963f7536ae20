"""The architecture registry (vramd/engine/arch): what each spec says, and that an
unsupported setting is refused the same way for every architecture.

Two bugs of the per-architecture configs this replaced, as regressions: the
MoE config accepted `rope.scaling.type = "yarn"` (and applied it as linear)
and 4 heads over 3 KV heads, where the llama one refused both.  Now every
architecture reads its metadata through one reader (arch/hparams.py), and
each refusal is one line naming the file and the key.
"""

import dataclasses

import pytest
from gguf import GGUFValueType as V

from tests.ggufgen.llama import write_llama
from tests.ggufgen.gemma3 import write_gemma3
from tests.ggufgen.moe import write_moe
from tests.ggufgen.check import GGUFImage
from vramd.engine.arch import ARCHITECTURES, spec_for
from vramd.engine.scratch import scratch_layout
from vramd.errors import ModelError
from vramd.model.gguf_check import validate_gguf

# name -> (writer, general.architecture)
WRITERS = {
    "llama": (lambda p, **kw: write_llama(p, arch="llama", **kw), "llama"),
    "qwen2": (lambda p, **kw: write_llama(p, arch="qwen2", **kw), "qwen2"),
    "gemma3": (lambda p, **kw: write_gemma3(p, **kw), "gemma3"),
    "qwen3moe": (lambda p, **kw: write_moe(p, arch="qwen3moe", **kw), "qwen3moe"),
    "qwen2moe": (lambda p, **kw: write_moe(p, arch="qwen2moe", **kw), "qwen2moe"),
    "mixtral": (lambda p, **kw: write_moe(p, arch="mixtral", **kw), "llama"),
}


def _file(tmp_path, name, **kw):
    write, arch = WRITERS[name]
    return write(tmp_path / f"{name}.gguf", **kw), arch


def test_every_architecture_has_a_spec_with_its_conventions(tmp_path):
    got = {}
    for name in WRITERS:
        path, _ = _file(tmp_path, name)
        s = spec_for(validate_gguf(path))
        got[name] = (s.family, s.neox, s.qk_norm, s.post_norms, s.activation, s.moe is not None)
        assert len(s.layers) == s.n_layer and s.n_head % s.n_head_kv == 0
    assert got == {
        "llama": ("llama", False, False, False, "silu", False),
        "qwen2": ("qwen2", True, False, False, "silu", False),
        "gemma3": ("gemma3", True, True, True, "gelu", False),
        "qwen3moe": ("qwen3moe", True, True, False, "silu", True),
        "qwen2moe": ("qwen2moe", True, False, False, "silu", True),
        "mixtral": ("mixtral", False, False, False, "silu", True),
    }
    assert set(ARCHITECTURES) >= {"llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe"}


@pytest.mark.parametrize("name", list(WRITERS))
def test_an_unknown_rope_scaling_is_refused_for_every_architecture(tmp_path, name):
    path, arch = _file(tmp_path, name)
    bad = GGUFImage.from_file(path).set_kv(f"{arch}.rope.scaling.type", V.STRING, "yarn").write(tmp_path / "y.gguf")
    with pytest.raises(ModelError) as e:
        spec_for(validate_gguf(bad))
    msg = str(e.value)
    assert msg.startswith(str(bad)) and f"{arch}.rope.scaling.type = 'yarn' is not supported" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("name", list(WRITERS))
def test_heads_not_a_multiple_of_kv_heads_are_refused_for_every_architecture(tmp_path, name):
    path, arch = _file(tmp_path, name)
    bad = (GGUFImage.from_file(path).set_kv(f"{arch}.attention.head_count", V.UINT32, 4)
           .set_kv(f"{arch}.attention.head_count_kv", V.UINT32, 3).write(tmp_path / "h.gguf"))
    with pytest.raises(ModelError) as e:
        spec_for(validate_gguf(bad))
    msg = str(e.value)
    assert msg.startswith(str(bad)) and f"{arch}.attention.head_count 4 is not a multiple of " \
                                       f"{arch}.attention.head_count_kv 3" in msg


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3moe"])
def test_missing_and_misshapen_tensors_name_the_file_and_the_tensor(tmp_path, res, name):
    """The tensor table (vramd/engine/tensors.py) checks at load, before anything runs."""
    from vramd.engine.tensors import TensorTable
    from vramd.model import loader
    path, _ = _file(tmp_path, name)
    mf = validate_gguf(path)
    spec = spec_for(mf)
    lm = loader.load(path, res, 32, mf=mf, scratch=scratch_layout(spec))
    try:
        TensorTable(spec, mf, lm.weights.tensors)             # complete: no error
        mf = dataclasses.replace(mf, tensors=[t for t in mf.tensors if t.name != "blk.0.attn_k.weight"])
        with pytest.raises(ModelError, match=rf"{path}: missing tensor 'blk.0.attn_k.weight' for architecture"):
            TensorTable(spec, mf, lm.weights.tensors)
    finally:
        for region in lm.regions:
            region.destroy()


def test_a_dense_architecture_with_experts_and_an_moe_one_without_are_refused(tmp_path):
    path, _ = _file(tmp_path, "qwen2")
    bad = GGUFImage.from_file(path).set_kv("qwen2.expert_count", V.UINT32, 8).write(tmp_path / "e.gguf")
    with pytest.raises(ModelError, match="qwen2.expert_count is set"):
        spec_for(validate_gguf(bad))
    path, _ = _file(tmp_path, "qwen3moe")
    bad = GGUFImage.from_file(path).drop_kv("qwen3moe.expert_count").write(tmp_path / "n.gguf")
    with pytest.raises(ModelError, match="missing qwen3moe.expert_count"):
        spec_for(validate_gguf(bad))


@pytest.mark.parametrize("name", list(WRITERS))
def test_plan_sizes_scratch_as_serve_allocates_it(tmp_path, name):
    """`vramd plan` and `vramd serve` ask the same function (the MoE case used to
    differ: plan sized scratch with the llama config, 918,784 B against 332,800 B)."""
    from vramd.model.footprint import footprint
    path, _ = _file(tmp_path, name)
    mf = validate_gguf(path)
    assert footprint(mf, 64).layouts["scratch"] == scratch_layout(spec_for(mf))


def test_a_shared_expert_without_its_width_key_takes_the_tensors_width(tmp_path):
    """qwen2moe: without expert_shared_feed_forward_length the shared expert used
    to be computed at width 0 (wrong logits, no error); its width now comes from
    its tensors, and the spec says so."""
    path, _ = _file(tmp_path, "qwen2moe")
    want = spec_for(validate_gguf(path)).moe.n_ff_shexp
    bad = GGUFImage.from_file(path).drop_kv("qwen2moe.expert_shared_feed_forward_length").write(tmp_path / "s.gguf")
    assert want > 0 and spec_for(validate_gguf(bad)).moe.n_ff_shexp == want


def test_rope_frequency_factors_are_read_only_where_llama_cpp_reads_them(tmp_path):
    assert spec_for(validate_gguf(_file(tmp_path, "llama")[0])).rope_factors
    assert spec_for(validate_gguf(_file(tmp_path, "mixtral")[0])).rope_factors
    for name in ("qwen2", "gemma3", "qwen3moe", "qwen2moe"):
        assert not spec_for(validate_gguf(_file(tmp_path, name)[0])).rope_factors

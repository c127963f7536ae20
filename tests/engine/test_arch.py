"""The architecture registry (vramd/engine/arch): what each spec says, and that an
unsupported setting is refused the same way for every architecture.

Two bugs of the per-architecture configs this replaced, as regressions: the
MoE config accepted `rope.scaling.type = "yarn"` (and applied it as linear, before YaRN was computed)
and 4 heads over 3 KV heads, where the llama one refused both.  Now every
architecture reads its metadata through one reader (arch/hparams.py), and
each refusal is one line naming the file and the key.
"""

import dataclasses

import pytest
from gguf import GGUFValueType as V

from tests.ggufgen.llama import write_llama
from tests.ggufgen.gemma3 import write_gemma3
from tests.ggufgen.gemma4 import write_gemma4
from tests.ggufgen.moe import write_moe
from tests.ggufgen.qwen35 import write_qwen35
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
    "gemma2": (lambda p, **kw: write_gemma3(p, arch="gemma2", **kw), "gemma2"),
    "phi3": (lambda p, **kw: write_llama(p, arch="phi3", **kw), "phi3"),
    "mistral3": (lambda p, **kw: write_llama(p, arch="mistral3", **kw), "mistral3"),
    "qwen35": (lambda p, **kw: write_qwen35(p, **kw), "qwen35"),
    "qwen35moe": (lambda p, **kw: write_qwen35(p, n_expert=4, **kw), "qwen35moe"),
    "gemma4": (lambda p, **kw: write_gemma4(p, **kw), "gemma4"),
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
        "gemma2": ("gemma2", True, False, True, "gelu", False),
        "phi3": ("phi3", True, False, False, "silu", False),
        "mistral3": ("mistral3", False, False, False, "silu", False),
        "qwen35": ("qwen35", True, True, False, "silu", False),
        "qwen35moe": ("qwen35moe", True, True, False, "silu", True),
        "gemma4": ("gemma4", True, True, True, "gelu", False),
    }
    assert set(ARCHITECTURES) >= {"llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "gemma2", "phi3",
                                  "mistral3", "gemma4"}


@pytest.mark.parametrize("name", list(WRITERS))
def test_an_unknown_rope_scaling_is_refused_for_every_architecture(tmp_path, name):
    path, arch = _file(tmp_path, name)
    bad = GGUFImage.from_file(path).set_kv(f"{arch}.rope.scaling.type", V.STRING, "dynamic").write(tmp_path / "y.gguf")
    with pytest.raises(ModelError) as e:
        spec_for(validate_gguf(bad))
    msg = str(e.value)
    assert msg.startswith(str(bad)) and f"{arch}.rope.scaling.type = 'dynamic' is not supported" in msg
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


def test_gemma2_caps_slides_every_other_layer_and_takes_llama_cpps_defaults(tmp_path):
    s = spec_for(validate_gguf(write_gemma3(tmp_path / "g.gguf", arch="gemma2", n_layer=4, window=8,
                                            attn_softcap=3.0, softcap=15.0)))
    assert [layer.window for layer in s.layers] == [8, 0, 8, 0] and s.attn_softcap == 3.0 and s.final_softcap == 15.0
    assert {(layer.rope_base, layer.rope_scale) for layer in s.layers} == {(1e6, 1.0)}   # no gemma3-style SWA base
    assert not s.qk_norm and s.post_norms and s.scale == 1 / 8            # 1/sqrt(key_length 64)
    d = spec_for(validate_gguf(write_gemma3(tmp_path / "d.gguf", arch="gemma2", n_layer=3, window=0)))   # no keys
    assert (d.attn_softcap, d.final_softcap) == (50.0, 30.0) and [layer.window for layer in d.layers] == [4096, 0, 4096]
    bad = GGUFImage.from_file(tmp_path / "g.gguf").set_kv("gemma2.attn_logit_softcapping", V.FLOAT32, 0.0)
    with pytest.raises(ModelError, match=r"gemma2.attn_logit_softcapping = 0.0 is not a number > 0"):
        spec_for(validate_gguf(bad.write(tmp_path / "z.gguf")))


def test_phi3_fused_tensors_are_views_and_longrope_picks_by_context(tmp_path):
    from vramd.engine.tensors import fused_views, required
    path = write_llama(tmp_path / "p.gguf", arch="phi3", n_rot=16, longrope=True, orig_ctx=32, rope_attn_factor=1.2,
                       sliding_window=8)
    s = spec_for(validate_gguf(path))
    assert s.fused_qkv and s.fused_up and s.n_rot == 16 and s.longrope_ctx == 32 and not any(l.window for l in s.layers)
    assert s.rope_params(0)["mscale"] == pytest.approx(1.2) and s.rope_params(0)["ext_factor"] == 0.0
    assert (s.rope_factors_name(64), s.rope_factors_name(32)) == ("rope_factors_long.weight", "rope_factors_short.weight")
    mats, _ = required(s)
    assert mats["blk.0.attn_qkv.weight"] == (128, 384) and mats["blk.0.ffn_up.weight"] == (128, 512)
    assert "blk.0.attn_q.weight" not in mats and "blk.0.ffn_gate.weight" not in mats
    views = fused_views(s)
    assert views["blk.0.attn_v.weight"] == ("blk.0.attn_qkv.weight", 256, 128)
    assert views["blk.0.ffn_gate.weight"] == ("blk.0.ffn_up.weight", 0, 256)
    assert views["blk.0.ffn_up.weight"] == ("blk.0.ffn_up.weight", 256, 256)
    split = spec_for(validate_gguf(write_llama(tmp_path / "u.gguf", arch="phi3", fused_qkv=False)))
    assert not split.fused_qkv and split.fused_up and split.longrope_ctx == 0


def test_yarn_is_computed_for_every_architecture_as_llama_cpp_derives_it(tmp_path):
    """ext_factor 1, the ramp from the original context and beta 32/1, and the magnitude
    (1 + 0.1 ln factor) on the scaled layers only (gemma3's sliding ones keep scale 1)."""
    import math
    for name in ("llama", "qwen2", "qwen3moe", "gemma3"):
        path, arch = _file(tmp_path, name)
        img = (GGUFImage.from_file(path).set_kv(f"{arch}.rope.scaling.type", V.STRING, "yarn")
               .set_kv(f"{arch}.rope.scaling.factor", V.FLOAT32, 4.0)
               .set_kv(f"{arch}.rope.scaling.original_context_length", V.UINT32, 64))
        s = spec_for(validate_gguf(img.write(tmp_path / f"{name}-y.gguf")))
        r = s.rope_scaling
        assert (r.ext_factor, r.beta_fast, r.beta_slow, r.n_ctx_orig) == (1.0, 32.0, 1.0, 64), name
        scaled = [i for i, layer in enumerate(s.layers) if layer.rope_scale == 0.25]
        assert scaled and s.rope_params(scaled[0])["mscale"] == pytest.approx(1 + 0.1 * math.log(4)), name
        lo, hi = s.rope_params(scaled[0])["corr_dims"]
        assert 0 <= lo <= hi <= s.n_rot - 1
        for i, layer in enumerate(s.layers):
            if layer.rope_scale == 1.0:
                assert s.rope_params(i)["mscale"] == pytest.approx(1.0)


def test_mistral3_reads_yarn_betas_log_multiplier_and_temperature(tmp_path):
    path = write_llama(tmp_path / "m.gguf", arch="mistral3", rope_scaling="yarn", rope_scaling_factor=16.0,
                       orig_ctx=16384, yarn_beta_fast=16.0, yarn_beta_slow=0.5, yarn_log_mul=1.0, attn_temp_scale=0.1)
    s = spec_for(validate_gguf(path))
    assert (s.rope_scaling.beta_fast, s.rope_scaling.beta_slow) == (16.0, 0.5)
    assert s.rope_params(0)["mscale"] == pytest.approx(1.0)    # log multiplier 1: mscale(16, 1) / mscale(16, 1)
    assert (s.attn_temp_scale, s.attn_temp_floor, s.attn_temp_offset) == (pytest.approx(0.1), 16384, 0.0)
    # the same keys on a llama file are not read (llama.cpp's llama loader does not)
    q = spec_for(validate_gguf(write_llama(tmp_path / "l.gguf", arch="llama", rope_scaling="yarn",
                                           rope_scaling_factor=16.0, orig_ctx=16384, yarn_beta_fast=16.0)))
    assert q.rope_scaling.beta_fast == 32.0 and q.attn_temp_scale == 0.0


def test_a_missing_deltanet_tensor_is_named(tmp_path, res):
    """qwen35's recurrent layers have their own tensors (vramd/engine/tensors.py's required):
    one missing is one line naming it, at load."""
    from vramd.engine.tensors import TensorTable
    from vramd.model import loader
    path, _ = _file(tmp_path, "qwen35")
    mf = validate_gguf(path)
    spec = spec_for(mf)
    lm = loader.load(path, res, 32, mf=mf, scratch=scratch_layout(spec))
    try:
        TensorTable(spec, mf, lm.weights.tensors)
        for name in ("blk.0.ssm_a", "blk.2.ssm_conv1d.weight", "blk.1.attn_q_norm.weight"):
            less = dataclasses.replace(mf, tensors=[t for t in mf.tensors if t.name != name])
            with pytest.raises(ModelError, match=rf"missing tensor '{name}' for architecture qwen35"):
                TensorTable(spec, less, lm.weights.tensors)
    finally:
        for region in lm.regions:
            region.destroy()


def test_qwen35_reads_the_layer_pattern_array_and_refuses_mtp_blocks(tmp_path, monkeypatch):
    """attention.recurrent_layers, where a file has it, is the layer pattern (llama.cpp reads it
    before full_attention_interval); a file with nextn_predict_layers > 0 counts a
    multi-token-prediction block in block_count that is no layer of the graph: refused by name."""
    import gguf
    plain = [lay.recurrent for lay in spec_for(validate_gguf(_file(tmp_path, "qwen35")[0])).layers]
    add = gguf.GGUFWriter.add_block_count

    def with_pattern(self, n):
        add(self, n)
        self.add_array("qwen35.attention.recurrent_layers", [True, True, False, False])
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", with_pattern)
    got = [lay.recurrent for lay in spec_for(validate_gguf(write_qwen35(tmp_path / "p.gguf"))).layers]
    assert got == [True, True, False, False] != plain

    def with_mtp(self, n):
        add(self, n)
        self.add_uint32("qwen35.nextn_predict_layers", 1)
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", with_mtp)
    with pytest.raises(ModelError, match="nextn_predict_layers = 1: multi-token-prediction blocks"):
        spec_for(validate_gguf(write_qwen35(tmp_path / "m.gguf")))


def test_gemma4_layers_take_their_kinds_geometry_rope_and_scale(tmp_path):
    """Sliding and global layers differ as the file says (tests/ggufgen/gemma4.py's defaults)."""
    path = write_gemma4(tmp_path / "g.gguf", weight_type="F32")
    s = spec_for(validate_gguf(path))
    slide, glob = s.layers[0], s.layers[2]
    assert (slide.window, slide.head_dim, slide.n_head_kv, slide.n_rot, slide.rope_base) == (8, 64, 2, 64, 1e4)
    assert (glob.window, glob.head_dim, glob.n_head_kv, glob.n_rot, glob.rope_base) == (0, 128, 1, 128, 1e6)
    assert not slide.rope_factors and glob.rope_factors and s.rope_factors_name(64) == "rope_freqs.weight"
    assert not slide.v_from_k and glob.v_from_k and s.v_norm and s.attn_scale == 1.0 and s.final_softcap == 15.0
    assert (s.max_q_width, s.max_kv_width) == (512, 128)
    from tests.engine.reference.gemma4 import Gemma4Reference
    ref = Gemma4Reference(path)   # the scale read from the file, as the reference reads the tensor
    assert [layer.out_scale for layer in s.layers] == [float(L["layer_output_scale"][0]) for L in ref.layers]


def test_gemma4_e2b_layers_share_kv_as_llama_cpp_picks_and_keep_no_cache(tmp_path):
    """E2B's shape: layers 4..6 share K/V (sliding ones layer n_kv - 2 = 2's, the global one
    layer n_kv - 1 = 3's), their FFNs double-wide; the KV layout has no rows for them."""
    from tests.ggufgen.gemma4 import E2B_SHAPE
    from vramd.engine.kvcache import KVCache, KVLayout
    from vramd.model.loader import kv_shape
    mf = validate_gguf(write_gemma4(tmp_path / "e.gguf", weight_type="F32", **E2B_SHAPE))
    s = spec_for(mf)
    assert [layer.kv_source for layer in s.layers] == [-1, -1, -1, -1, 2, 2, 3]
    assert [s.n_ff_of(i) for i in range(7)] == [512] * 4 + [1024] * 3 and s.n_ff == 1024
    assert s.ple == 256 and not s.takes_embeds
    lay = KVLayout.for_spec(s, 64)
    names = [n for n, _b in lay.tensors()]
    assert names == [f"cache_{kv}_l{i}" for i in range(4) for kv in "kv"]
    assert lay.nbytes == 4 * 2 * 64 * s.max_kv_width * 2 and kv_shape(mf, 64) == lay   # what vramd plan counts
    cache = KVCache(lay, {n: object() for n in names})
    assert cache.k(4) is cache.k(2) and cache.v(5) is cache.v(2) and cache.k(6) is cache.k(3)


@pytest.mark.parametrize("shared,what", [(4, "layer 4 would share layer 2's K/V"),
                                         (7, "at least two layers must keep their K/V")])
def test_gemma4_kv_sharing_llama_cpp_cannot_mean_is_refused(tmp_path, shared, what):
    """E4B's pattern with more sharing layers: llama.cpp's source for sliding layer 4 (n_kv - 2 = 2)
    is global; or fewer than the two layers its rule reads from keep a cache."""
    from tests.ggufgen.gemma4 import E4B_SHAPE
    bad = write_gemma4(tmp_path / "b.gguf", weight_type="F32", **dict(E4B_SHAPE, shared_kv=shared))
    with pytest.raises(ModelError, match=what) as e:
        spec_for(validate_gguf(bad))
    assert str(e.value).startswith(str(bad)) and "\n" not in str(e.value)


@pytest.mark.parametrize("key,value,what", [
    # experts half-declared (the 26B-A4B's layout: tests/engine/test_gemma4_moe.py)
    ("gemma4.expert_count", 8, "missing gemma4.expert_used_count"),
])
def test_gemma4_variants_the_engine_does_not_run_are_refused_by_name(tmp_path, key, value, what):
    path = write_gemma4(tmp_path / "g.gguf", weight_type="F32")
    bad = GGUFImage.from_file(path).set_kv(key, V.UINT32, value).write(tmp_path / "b.gguf")
    with pytest.raises(ModelError, match=what) as e:
        spec_for(validate_gguf(bad))
    assert str(e.value).startswith(str(bad)) and "\n" not in str(e.value)


def test_gemma4_needs_its_sliding_pattern_array(tmp_path):
    path = write_gemma4(tmp_path / "g.gguf", weight_type="F32")
    bad = GGUFImage.from_file(path).drop_kv("gemma4.attention.sliding_window_pattern").write(tmp_path / "b.gguf")
    with pytest.raises(ModelError, match="missing gemma4.attention.sliding_window_pattern"):
        spec_for(validate_gguf(bad))

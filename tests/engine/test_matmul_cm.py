"""The tensor-core matmuls (matmul_cm_<type>, native/shaders/matmul_cm.glsl) and
their choice at the kernel-selection point (vramd/engine/linear.py).

On lavapipe (no cooperative matrices): the device reports none, selection keeps
the portable matmul_<type>, the capability's parsing and the choice's rules.
On a GPU (marked native_gpu: `VRAMD_TEST_DEVICE=native pytest -m native_gpu`):
every matmul_cm_<type> against a numpy reference (gguf.quants.dequantize) and
against the portable kernel on the same data, at odd row counts, token counts
that are no tile multiple and every tile edge (rows 1, 127, 128, 129, 300;
tokens 4, 127, 128, 129, 300), weights bound at a 2-byte offset, x unaligned.
Tile variants (vramd bench matmul --compile-sweep DIR): with VRAMD_CM_SWEEP=DIR
(and VRAMD_CM_VARIANTS=a,b to choose) each variant's kernels are checked the
same way at its own tile edges (rows BR +- 1, tokens BT +- 1), before one is
adopted as the committed kernel.

Tolerances.  The kernel rounds each weight and activation to f16 in shared
memory, then multiplies and accumulates in f32 on the tensor cores.  So
against numpy on the f16-rounded inputs only f32 accumulation differs:
|y - ref16| <= 2e-5 * sum|w||x| + 1e-5 (the f32 bound of test_kernels.py, with
room for a rounding mode of the conversion other than numpy's); against the
exact f32 inputs and the portable kernel the rounding itself, at most 2^-11 of
each factor: |y - ref| <= 1.1e-3 * sum|w||x| + 1e-5.  A wrong index, nibble,
scale or tile edge gives errors of the order of the values themselves.
"""
import json
import os
import types
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from vramd.engine import linear
from vramd.engine.ops import Weight, view
from vramd.gpu.device import parse_coopmat_shapes

from .test_kernels_kquants import KQUANTS, blocks

TYPES = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
SHAPE_16 = {"m": 16, "n": 16, "k": 16, "a": "f16", "b": "f16", "c": "f32", "result": "f32",
            "saturating": False, "scope": "subgroup"}


def weights(rng, qtype, rows, cols):
    """(bytes to upload, the float32 matrix they mean)."""
    if qtype in KQUANTS:
        return blocks(rng, qtype, rows, cols)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == Q.F16:
        h = w.astype(np.float16)
        return h.view(np.uint8), h.astype(np.float32)
    if qtype == Q.BF16:
        b = (w.view(np.uint32) >> 16).astype(np.uint16)
        return b.view(np.uint8), (b.astype(np.uint32) << 16).view(np.float32)
    q = quantize(w, qtype)
    return q, dequantize(q, qtype)


def _device(shapes, subgroup=32, shared=49152, sizes=None):
    """What coopmat_usable reads of a gpu.device.Device, as plain data (sizes: the
    (min, max) subgroup sizes a pipeline may require, None without the control)."""
    return types.SimpleNamespace(coopmat=shapes, subgroup_size=subgroup, subgroup_sizes=sizes,
                                 limits={"maxComputeSharedMemorySize": shared})


# -- lavapipe (and any device): capability and selection -----------------------

def test_the_capability_picks_the_prefill_kernels(device, ops):
    """lavapipe has no cooperative matrices and keeps the portable kernels; a GPU that has
    them (the native_gpu runs) takes the tensor-core form."""
    d = device.describe()
    w = types.SimpleNamespace(suffix="q4_k", row_bytes=144 * 16)
    if device.type == "cpu":
        assert d["coopmat"] == [] and "VK_KHR_cooperative_matrix" not in d["extensions"]
        assert ops.coopmat is False
        assert linear.select(w, 512, 0, ops.coopmat, cpu=True).name == "matmul_c_q4_k"
        assert linear.select(w, 512, 0, ops.coopmat).name == "matmul_q4_k"
    else:
        assert ops.coopmat == bool(d["coopmat"]) and ("VK_KHR_cooperative_matrix" in d["extensions"]) == ops.coopmat
        assert linear.select(w, 512, 0, ops.coopmat).name == ("matmul_cm_q4_k" if ops.coopmat else "matmul_q4_k")


def test_parse_coopmat_shapes_reads_the_vulkan_structs():
    import vulkan as vk

    props = vk.ffi.new("VkCooperativeMatrixPropertiesKHR[]", 2)
    for p, (a, c, m, n) in zip(props, [(0, 1, 16, 16), (1000141000, 1, 16, 8)]):
        p.MSize, p.NSize, p.KSize, p.AType, p.BType, p.CType, p.ResultType = m, n, 16, a, a, c, c
        p.scope = 3
    shapes = parse_coopmat_shapes(props)
    assert shapes[0] == SHAPE_16
    assert shapes[1]["a"] == "bf16" and shapes[1]["n"] == 8 and shapes[1]["scope"] == "subgroup"


def test_coopmat_usable_needs_the_shape_the_kernels_use(monkeypatch):
    monkeypatch.delenv("VRAMD_NO_COOPMAT", raising=False)
    assert linear.coopmat_usable(_device([SHAPE_16]))
    assert not linear.coopmat_usable(_device([]))
    assert not linear.coopmat_usable(_device([{**SHAPE_16, "c": "f16", "result": "f16"}]))
    assert not linear.coopmat_usable(_device([{**SHAPE_16, "n": 8}]))
    assert not linear.coopmat_usable(_device([SHAPE_16], subgroup=64))      # subgroups of 32 lanes assumed
    assert not linear.coopmat_usable(_device([SHAPE_16], subgroup=64, sizes=(64, 64)))
    assert not linear.coopmat_usable(_device([SHAPE_16], shared=16384))
    monkeypatch.setenv("VRAMD_NO_COOPMAT", "1")
    assert not linear.coopmat_usable(_device([SHAPE_16]))


def test_cm_pipelines_require_32_lanes_where_the_device_can_be_asked(monkeypatch):
    """A device of 64-lane subgroups that can run 32 (AMD: 32..64) runs the kernels with the
    size required; one that cannot be asked only when its own size is 32."""
    monkeypatch.delenv("VRAMD_NO_COOPMAT", raising=False)
    wide = _device([SHAPE_16], subgroup=64, sizes=(32, 64))
    assert linear.cm_subgroup_size(wide) == 32 and linear.coopmat_usable(wide)
    assert linear.cm_subgroup_size(_device([SHAPE_16], sizes=(32, 32))) == 32
    assert linear.cm_subgroup_size(_device([SHAPE_16])) is None and linear.coopmat_usable(_device([SHAPE_16]))
    assert linear.cm_subgroup_size(_device([SHAPE_16], subgroup=8, sizes=(4, 16))) is None


def test_the_subgroup_size_control_names_used_have_values():
    """The `vulkan` binding leaves VK_EXT_subgroup_size_control's _EXT structure types and
    flags None (a None sType would silently break the feature chain on a GPU that has the
    extension, which lavapipe here lacks): device.py and kernels.py use the core names."""
    import vulkan as vk

    from vramd.gpu import kernels

    assert vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES == 1000225002
    assert vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES == 1000225000
    assert vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO == 1000225001
    assert kernels._REQUIRE_FULL_SUBGROUPS == 2   # VK_PIPELINE_SHADER_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS_BIT
    src = "".join(Path(m.__file__).read_text() for m in (kernels, __import__("vramd.gpu.device").gpu.device))
    assert "SUBGROUP_SIZE_CONTROL_FEATURES_EXT" not in src and "SIZE_CREATE_INFO_EXT" not in src


def test_a_pipeline_can_require_the_subgroup_size(device, res):
    """Kernel(subgroup_size=) chains the required size into the pipeline where the device
    has the control: the kernel built so still computes (f32 matvec, a subgroup reduction)."""
    from vramd.gpu.kernels import Kernel
    from vramd.engine.ops import Ops

    if device.subgroup_sizes is None:
        assert "VK_EXT_subgroup_size_control" not in device.describe()["extensions"]
        pytest.skip("no VK_EXT_subgroup_size_control on this device (lavapipe of LLVM 15)")
    size = device.subgroup_sizes[0]
    ops = Ops(res)
    try:
        ops._kernels["matvec_f32"] = Kernel(res, "matvec_f32", 3, 32, subgroup_size=size)
        rng = np.random.default_rng(1)
        w, xv = rng.standard_normal((24, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
        r = res.region("weights", "ssc", {"w": w.nbytes, "x": xv.nbytes, "y": 24 * 4})
        r.restore()
        r.tensors["w"].write(w), r.tensors["x"].write(xv)
        ops.matvec(Weight(r.tensors["w"], Q.F32, 24, 64), r.tensors["x"], r.tensors["y"])
        ops.sync()
        np.testing.assert_allclose(r.tensors["y"].read(np.float32, 0, 96), w @ xv, rtol=1e-4, atol=1e-4)
        r.destroy()
    finally:
        ops.close()


@pytest.mark.parametrize("suffix", sorted(linear.CM_TYPES) + ["f32"])
def test_select_by_capability_and_batch(suffix):
    w = types.SimpleNamespace(suffix=suffix, row_bytes=4096)
    cm = linear.select(w, linear.CM_FROM, 0, True)
    if suffix == "f32":
        assert cm.name == "matmul_f32"     # no tensor-core kernel for f32 weights
        assert linear.select(w, linear.MATMUL_FROM, 0, True).name == "matmul_f32"
    else:
        assert (cm.name, cm.rows_per_group, cm.tokens_per_group) == ("matmul_cm_" + suffix, 128, 128)
        # below CM_FROM tokens the tensor-core form is latency-bound: the matvec (linear.py)
        assert linear.select(w, linear.CM_FROM - 1, 0, True).name.startswith("matvec")
    assert linear.select(w, linear.MATMUL_FROM, 0, False).name == "matmul_" + suffix
    assert linear.select(w, linear.MATMUL_FROM - 1, 0, True).name.startswith("matvec")


# -- a GPU: every kernel against numpy and the portable kernel ------------------

def _cols(qtype):
    if qtype in KQUANTS:
        return 3 * 256
    if qtype in (Q.F16, Q.BF16):
        return 200   # no multiple of the 32-column step: the tile's k edge
    return 13 * 32


def _run(ops, bufs, rng, qtype, rows, n_tokens, cols=None, x_off=1, w_off=2):
    cols = cols or _cols(qtype)
    raw, w = weights(rng, qtype, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    xpad = np.concatenate([np.full(x_off, 7, np.float32), x.reshape(-1)])
    wpad = np.concatenate([np.full(w_off, 0xAB, np.uint8), np.asarray(raw).view(np.uint8).reshape(-1)])
    wt = bufs("weights", w=wpad)["w"]
    t = bufs(x=xpad, y=4 * n_tokens * rows)
    wgt = Weight(view(wt, w_off), qtype, rows, cols)
    out = {}
    for cm in (True, False):
        ops.coopmat = cm
        try:
            ops.matvec(wgt, view(t["x"], 4 * x_off), t["y"], n_tokens)
            ops.sync()
        finally:
            ops.coopmat = linear.coopmat_usable(ops.residency.device)
        out[cm] = t["y"].read(np.float32).reshape(n_tokens, rows).copy()
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    mag = np.abs(x64) @ np.abs(w64).T + 1e-5
    ref = x64 @ w64.T
    ref16 = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
    _close(out[True], ref16, mag, 2e-5, "vs numpy on f16-rounded inputs")
    _close(out[True], ref, mag, 1.1e-3, "vs numpy")
    _close(out[True], out[False], mag, 1.1e-3, "vs the portable kernel")


def _close(y, ref, mag, rel, what):
    err = np.abs(y - ref)
    bound = rel * mag
    assert np.all(err <= bound), f"{what}: max error {err.max():.3g}, worst ratio {np.max(err / bound):.3g}"


@pytest.fixture
def cm_ops(ops):
    if not ops.coopmat:
        pytest.fail(f"{ops.residency.device.name} has no usable cooperative matrices "
                    "(native_gpu tests need them)")
    return ops


@pytest.mark.native_gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n_tokens", [(37, 16), (129, 127), (300, 129), (128, 300), (1, 128), (127, 37)])
def test_matmul_cm_every_type_and_edge(cm_ops, bufs, rng, qtype, rows, n_tokens):
    _run(cm_ops, bufs, rng, qtype, rows, n_tokens)


@pytest.mark.native_gpu
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_matmul_cm_long_rows_aligned(cm_ops, bufs, rng, qtype):
    """An 8B model's row length, weights and x aligned (the engine's usual binding)."""
    _run(cm_ops, bufs, rng, qtype, 259, 200, cols=4096, x_off=0, w_off=0)


def _sweep_cases():
    """(variant, type, rows, tokens) for the variants VRAMD_CM_SWEEP names, at their tile edges."""
    d = Path(os.environ["VRAMD_CM_SWEEP"])
    manifest = json.loads((d / "manifest.json").read_text())
    names = [v for v in os.environ.get("VRAMD_CM_VARIANTS", "").split(",") if v] or list(manifest)
    out = []
    for v in names:
        c = manifest[v]
        for qtype in TYPES:
            for rows, n in [(c["BR"] + 1, c["BT"] - 1), (c["BR"] - 1, c["BT"] + 1), (1, c["BT"]), (37, 4)]:
                out.append(pytest.param(v, qtype, rows, n, id=f"{v}-{qtype.name}-{rows}x{n}"))
    return out


if os.environ.get("VRAMD_CM_SWEEP"):   # (defined only then: a variant sweep is a device-run choice)
    @pytest.mark.native_gpu
    @pytest.mark.parametrize("variant,qtype,rows,n_tokens", _sweep_cases())
    def test_matmul_cm_sweep_variant(cm_ops, bufs, rng, variant, qtype, rows, n_tokens):
        from vramd.bench import matmul

        d = Path(os.environ["VRAMD_CM_SWEEP"])
        c = json.loads((d / "manifest.json").read_text())[variant]
        if not (d / variant / f"matmul_cm_{qtype.name.lower()}.spv").is_file():
            pytest.fail(f"{variant}: no {qtype.name} kernel compiled in {d} (--types)")
        with matmul._variant(cm_ops, c, d / variant, "matmul_cm_" + qtype.name.lower()):
            _run(cm_ops, bufs, rng, qtype, rows, n_tokens)

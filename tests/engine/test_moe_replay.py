"""MoE decode routed on the GPU and replayed (vramd/engine/model.py: the replayed decode step; moe.py:
_gpu_experts), against the numpy reference and the host-routed path.

With every expert on the device (--n-cpu-moe 0) each layer routes on the GPU
(moe_route, matvec_id, moe_combine: tests/engine/test_moe_kernels.py checks
them one by one) and a decode step is recorded once and replayed.  Here, for
each MoE layout of tests/engine/models_moe.py (qwen3moe; qwen2moe with its
gated shared expert; mixtral): prefill and replayed decode logits within the
reference's tolerance (tests/engine/test_moe.py's TOL, on prompts whose
routes are decided by a margin no f32 rounding can flip), greedy tokens
identical to the host-routed path (gpu_routing=False), the step recorded once
across tokens and again after a release/restore; exact router ties broken as
route() breaks them; and the layers that fall back to the host-routed path.
"""
import numpy as np
import pytest

from tests.engine.models_moe import MoESpec, make_moe_weights, write_moe, write_moe_weights
from tests.engine.reference_moe import ReferenceMoE, well_routed_prompt
from tests.engine.test_moe import TOL, rel_err
from vramd.engine.arch import spec_for
from vramd.engine.model import TransformerModel
from vramd.engine.scratch import scratch_layout
from vramd.engine.moe import gpu_routable
from vramd.model import loader, placement
from vramd.model.gguf_check import validate_gguf

CTX = 64
BATCH = 16
LAYOUTS = ["qwen3moe", "qwen2moe", "mixtral"]


@pytest.fixture
def build(device):
    """build(path, n_cpu_moe=0, gpu_routing=True) -> (TransformerModel, Residency), closed after the test."""
    from vramd.gpu.residency import Residency
    made = []

    def make(path, n_cpu_moe=0, gpu_routing=True):
        mf = validate_gguf(path)
        res = Residency(device)
        lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(spec_for(mf), BATCH),
                         host_tensors=placement.host_tensors(mf, n_cpu_moe))
        res.restore(["weights", "state"])
        model = TransformerModel(lm, res, CTX, lm.scratch, batch=BATCH, gpu_routing=gpu_routing)
        made.append((model, res))
        return model, res

    yield make
    for model, res in made:
        model.close()
        res.close()


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request, tmp_path_factory):
    arch = request.param
    path = write_moe(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch=arch, n_layer=3, seed=11)
    return arch, path, ReferenceMoE(path)


def greedy(model, prompt, n):
    logits, out = model.forward(prompt, 0), []
    for i in range(n):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], len(prompt) + i)
    return out


def test_replayed_decode_matches_the_reference(build, layout):
    _arch, path, ref = layout
    model, _res = build(path)
    assert model.replays_decode and all(model.gpu_routed)
    prompt = well_routed_prompt(ref, 6, min_margin=0.01)
    kv = ref.new_kv(np.float16)
    assert rel_err(model.forward(prompt, 0, all_logits=True), ref.forward(prompt, kv, 0)) < TOL
    pos = len(prompt)
    for tok in [3, 50, 7, 120, 9]:
        want = ref.forward([tok], kv)[-1]
        assert min(r.margin.min() for r in ref.last_routes) > 0.01   # no near-tie a rounding could flip
        assert rel_err(model.forward([tok], pos), want) < TOL
        pos += 1
    assert model.step_records == 1          # recorded once, replayed for each token


def test_greedy_tokens_equal_the_host_routed_path(build, layout):
    _arch, path, ref = layout
    gpu, _ = build(path)
    host, _ = build(path, gpu_routing=False)
    assert not any(host.gpu_routed) and host.step_records == 0
    prompt = well_routed_prompt(ref, 5, min_margin=0.01, seed=1)
    want = greedy(host, prompt, 8)
    assert ref.min_route_margin(prompt + want[:-1]) > 0.01
    assert greedy(gpu, prompt, 8) == want
    assert gpu.step_records == 1 and host.step_records == 0


def test_a_long_prefill_routes_on_the_gpu_in_chunks(build, layout):
    """20 tokens: a chunk of 16 and one of 4, each one command buffer with
    16 x k and 4 x k slots in matvec_id's grid."""
    _arch, path, ref = layout
    model, _ = build(path)
    prompt = well_routed_prompt(ref, 20, min_margin=0.01, seed=2)
    got = model.forward(prompt, 0, all_logits=True)
    assert rel_err(got, ref.forward(prompt, ref.new_kv(np.float16), 0)) < TOL
    assert model.step_records == 0          # prefill records per chunk, not the decode step


def test_the_step_is_recorded_again_after_a_move(build, tmp_path):
    path = write_moe(tmp_path / "m.gguf", arch="qwen2moe", n_layer=2, seed=5)
    ref = ReferenceMoE(path)
    model, res = build(path)
    kv = ref.new_kv(np.float16)
    prompt = well_routed_prompt(ref, 4, min_margin=0.01)
    model.forward(prompt, 0)
    ref.forward(prompt, kv, 0)
    pos = len(prompt)
    for tok in [11, 12]:
        assert rel_err(model.forward([tok], pos), ref.forward([tok], kv)[-1]) < TOL
        pos += 1
    res.release(["weights", "state", "scratch"])
    res.drain()
    res.restore(["weights", "state"])
    for tok in [13, 14]:
        assert rel_err(model.forward([tok], pos), ref.forward([tok], kv)[-1]) < TOL
        pos += 1
    assert model.step_records == 2


def tied_router_model(path, arch):
    """Experts 5, 6 and 7 of every layer share one router row, scaled up so
    they are often the top three: with k = 2 the tie is then at the boundary
    and route() takes 5 and 6 (the lower ids).  Other experts are as usual."""
    spec = MoESpec(arch=arch, n_layer=2, seed=3, weight_type="F32")
    w = make_moe_weights(spec)
    for i in range(spec.n_layer):
        r = w[f"blk.{i}.ffn_gate_inp.weight"]
        r[5:8] = 2.0 * r[5]
    return write_moe_weights(path, spec, w)


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
def test_exact_router_ties_break_like_route(build, tmp_path, arch):
    path = tied_router_model(tmp_path / "tied.gguf", arch)
    ref = ReferenceMoE(path)
    model, _ = build(path)
    host, _ = build(path, gpu_routing=False)
    prompt = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37]
    want = ref.forward(prompt, ref.new_kv(np.float16), 0)
    margins = np.concatenate([r.margin for r in ref.last_routes])
    ids = np.concatenate([r.ids for r in ref.last_routes])
    boundary_ties = (margins == 0) & (ids == [5, 6]).all(axis=1)
    assert boundary_ties.sum() >= 3                    # the test exercises ties at the k-th place
    assert np.all((margins == 0) | (margins > 0.01))   # and no near-tie besides
    assert rel_err(model.forward(prompt, 0, all_logits=True), want) < TOL
    # The tie is exact on the GPU too: the three router logits are equal bit for bit.
    router = model.act["router"].read(np.float32, 0, 4 * len(prompt) * 8).reshape(len(prompt), 8)
    assert (router[:, 5] == router[:, 6]).all() and (router[:, 6] == router[:, 7]).all()
    kv = ref.new_kv(np.float16)
    ref.forward(prompt, kv, 0)
    pos = len(prompt)
    for tok in [2, 40, 80]:
        want = ref.forward([tok], kv)[-1]
        assert rel_err(model.forward([tok], pos), want) < TOL
        pos += 1
    host.forward(prompt, 0)
    assert greedy(model, prompt, 5) == greedy(host, prompt, 5)


def test_host_experts_keep_the_host_routed_path(build, tmp_path):
    """--n-cpu-moe 1: layer 0's experts on the host route there (a readback);
    layers 1 and 2 still route on the GPU, and decode is not replayed."""
    path = write_moe(tmp_path / "m.gguf", arch="qwen3moe", n_layer=3, seed=11)
    ref = ReferenceMoE(path)
    model, _ = build(path, n_cpu_moe=1)
    assert model.gpu_routed == [False, True, True] and not model.replays_decode
    prompt = well_routed_prompt(ref, 5, min_margin=0.01)
    kv = ref.new_kv(np.float16)
    assert rel_err(model.forward(prompt, 0, all_logits=True), ref.forward(prompt, kv, 0)) < TOL
    assert rel_err(model.forward([8], len(prompt)), ref.forward([8], kv)[-1]) < TOL
    assert model.step_records == 0


def test_an_expert_larger_than_a_binding_falls_back_to_host_routing(build, tmp_path):
    """matvec_id binds a stack in runs of whole experts: a device whose
    storage range is smaller than one expert's matrix routes on the host."""
    path = write_moe(tmp_path / "m.gguf", arch="qwen3moe", n_layer=2, seed=11)
    model, _ = build(path)
    ops = model.ops
    slab = max(w.rows * w.row_bytes for w in (model.t.stack(f"blk.0.{k}.weight") for k in
                                               ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")))
    ops.max_range = slab + ops.align + 4
    assert gpu_routable(model, 0)
    ops.max_range -= 1
    assert not gpu_routable(model, 0)

"""Mixture-of-experts: the placement rule, and GPU+CPU logits against the numpy reference."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.engine.models_moe import write_moe
from tests.engine.reference_moe import ReferenceMoE
from vramd.engine.arch import spec_for
from vramd.engine.model import TransformerModel
from vramd.engine.scratch import scratch_layout
from vramd.engine.moe import route
from vramd.errors import UsageError
from vramd.model import loader, placement
from vramd.model.gguf_check import validate_gguf

TOL = 2e-3
CTX = 64
N_LAYER = 3


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    return write_moe(tmp_path_factory.mktemp("moe") / "q3.gguf", arch="qwen3moe", n_layer=N_LAYER, seed=1)


# N -> (whole layers on the host, expert tensors of the boundary layer on the host),
# worked out by hand from brief §4: k = floor(frac * 3 + 0.5).
BY_HAND = {0: (0, 0), 1: (1, 0), 4 / 3: (1, 1), 5 / 3: (1, 2), 2.5: (2, 2), N_LAYER: (N_LAYER, 0)}


def expected_host(n: float) -> set[str]:
    whole, k = BY_HAND[n]
    kinds = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]   # the order they leave the device
    out = {f"blk.{layer}.{kind}.weight" for layer in range(whole) for kind in kinds}
    if whole < N_LAYER:
        out |= {f"blk.{whole}.{kind}.weight" for kind in kinds[:k]}
    return out


@pytest.mark.parametrize("n", [0, 1, 4 / 3, 5 / 3, 2.5, N_LAYER])
def test_placement_follows_the_rule(qwen3moe, n):
    mf = validate_gguf(qwen3moe)
    p = placement.plan(mf, n)
    host = {t["name"] for t in p.tensors if t["placement"] == "host"}
    assert host == expected_host(n)
    assert p.host_bytes == sum(t.nbytes for t in mf.tensors if t.name in host)


def test_bad_n_cpu_moe_values_are_usage_errors():
    for bad in ("-1", "x", "inf", "1/0"):
        with pytest.raises(UsageError):
            placement.parse_n_cpu_moe(bad)
    assert placement.parse_n_cpu_moe("4/3") == pytest.approx(4 / 3)


def test_smallest_fit_steps_in_thirds(qwen3moe):
    mf = validate_gguf(qwen3moe)
    full = placement.plan(mf, 0).device_bytes
    one_layer = placement.plan(mf, 1).device_bytes
    p = placement.smallest_fit(mf, one_layer)
    assert p.n_cpu_moe == pytest.approx(1.0)
    assert placement.smallest_fit(mf, full).n_cpu_moe == 0
    with pytest.raises(UsageError, match="every expert on the host"):
        placement.smallest_fit(mf, 1)


@pytest.fixture
def gpu(device):
    from vramd.gpu.residency import Residency
    made = []

    def build(path, n):
        mf = validate_gguf(path)
        cfg = spec_for(mf)
        res = Residency(device)
        lm = loader.load(path, res, CTX, mf=mf, scratch=scratch_layout(cfg, 16),
                         host_tensors=placement.host_tensors(mf, n))
        res.restore(["weights", "state"])
        model = TransformerModel(lm, res, CTX, lm.scratch, batch=16)
        made.append((model, res))
        return model, res, lm

    yield build
    for model, res in made:
        model.close()
        res.close()


def rel_err(got, want):
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-12))


@pytest.mark.parametrize("n", [0, 1, 4 / 3, 5 / 3, 2.5, N_LAYER])
def test_logits_match_the_reference_for_every_placement(gpu, qwen3moe, n):
    model, _res, lm = gpu(qwen3moe, n)
    ref = ReferenceMoE(qwen3moe)
    prompt = [1, 9, 33, 70, 5]
    assert ref.min_route_margin(prompt) > 0.01   # no near-tie a rounding could flip
    want = ref.forward(prompt, ref.new_kv(np.float16), 0)
    assert rel_err(model.forward(prompt, 0, all_logits=True), want) < TOL
    kv = ref.new_kv(np.float16)
    ref.forward(prompt, kv, 0)
    assert rel_err(model.forward([12], len(prompt)), ref.forward([12], kv)[-1]) < TOL
    assert set(lm.host) == expected_host(n)


@pytest.mark.parametrize("arch", ["qwen2moe", "mixtral"])
def test_other_moe_layouts_match_the_reference(gpu, tmp_path, arch):
    path = write_moe(tmp_path / f"{arch}.gguf", arch=arch, n_layer=2, seed=4)
    model, _res, _lm = gpu(path, 1)
    ref = ReferenceMoE(path)
    prompt = [1, 20, 40, 60]
    assert ref.min_route_margin(prompt) > 0.01
    assert rel_err(model.forward(prompt, 0, all_logits=True), ref.forward(prompt, ref.new_kv(np.float16), 0)) < TOL


def test_cold_warm_cycles_leave_host_experts_untouched(gpu, qwen3moe):
    model, res, lm = gpu(qwen3moe, 1.5)
    before = {k: v.copy() for k, v in lm.host.items()}
    first = model.forward([1, 2, 3], 0)
    for _ in range(5):
        res.release(["weights", "state", "scratch"])
        res.restore(["weights", "state"])
    assert all(np.array_equal(before[k], lm.host[k]) for k in before)
    assert rel_err(model.forward([1, 2, 3], 0), first) < 1e-6
    # The host-placed experts are not in the residency swap: not in the weights region at all.
    assert not set(lm.host) & set(lm.weights.tensors)
    on_device = sum(t.nbytes for t in lm.file.tensors if t.name not in lm.host)
    everything = sum(t.nbytes for t in lm.file.tensors)
    assert on_device <= res.breakdown()["weights"]["device"] < everything   # the smaller VRAM footprint


def test_route_renormalizes_per_architecture():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]])
    ids, w = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1]] and w.sum() == pytest.approx(1.0)
    _ids, w2 = route(logits, 2, renormalize=False)
    assert w2.sum() < 1.0


def test_vramd_plan_json(qwen3moe):
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "plan", str(qwen3moe), "--n-cpu-moe", "4/3", "--json",
                        "--ctx", "128"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    host = {t["name"] for t in out["tensors"] if t["placement"] == "host"}
    assert host == expected_host(4 / 3)
    assert out["kv_bytes"] > 0 and out["device_bytes"] > out["device_weight_bytes"]
    assert all(set(t) == {"name", "placement", "bytes"} for t in out["tensors"])


# Q5_0: the native host matvec does not read it; the experts are dequantized by gguf.quants.
@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "F32", "F16", "BF16", "Q5_0"])
def test_host_experts_of_each_type_match_the_reference(gpu, tmp_path, weight_type):
    path = write_moe(tmp_path / f"q_{weight_type}.gguf", arch="qwen3moe", n_layer=2, seed=6, weight_type=weight_type)
    model, _res, _lm = gpu(path, 2)   # every expert on the CPU: each type's host path is used
    ref = ReferenceMoE(path)
    prompt = [1, 11, 22, 33]
    assert ref.min_route_margin(prompt) > 0.01
    assert rel_err(model.forward(prompt, 0, all_logits=True), ref.forward(prompt, ref.new_kv(np.float16), 0)) < TOL

"""`vramd bench decode` end to end on a small synthetic model (lavapipe: the
numbers mean nothing here, the GPU run records them): every weight type the
benchmark offers loads, decodes through the replayed step, and --profile
accounts for every dispatch with its bytes; --profile-prefill does the same
for one prefill chunk."""
import json

import pytest
from click.testing import CliRunner

from vramd.bench.decode import command, run


@pytest.mark.parametrize("wtype", ["F16", "Q8_0", "Q4_K"])
def test_decode_bench_with_profile(wtype):
    r = run(None, "small", wtype, prompt=8, tokens=2, ctx=32, bandwidth=4800.0, profile_steps=2)
    assert wtype in r["types"] and r["decode_tps"] > 0 and 0 < r["roofline_ratio"] < 1
    p = r["profile"]
    assert p["steps"] == 2 and not p["truncated"]
    assert 0 < p["gpu_ms_per_step"] <= p["wall_ms_per_step"] * 1.05
    mv = [k for k in p["kernels"] if k["kernel"].startswith("matvec_")]
    # the matvecs read every matrix once per step: all weight bytes but the F32 norms
    norms = 4 * r["n_embd"] * (2 * r["n_layer"] + 1)
    assert sum(k["bytes"] for k in mv) == r["weight_bytes"] - norms - _embedding_bytes(r)
    assert all(k["gbps"] > 0 for k in mv)


def test_prefill_profile_times_every_dispatch_of_a_chunk():
    r = run(None, "small", "Q4_K", prompt=24, tokens=2, ctx=32, bandwidth=None, prefill_steps=2)
    p = r["prefill_profile"]
    assert p["tokens"] == 24 and p["steps"] == 2 and not p["truncated"]
    assert 0 < p["gpu_ms_per_chunk"] <= p["wall_ms_per_chunk"] * 1.05
    mm = [k for k in p["kernels"] if k["kernel"].startswith("matmul")]
    head = [k for k in p["kernels"] if k["kernel"].startswith("matvec")]   # the last row's logits only
    assert mm and len(head) == 1 and head[0]["dispatches"] == 1
    # every layer matrix is read by a matmul of the chunk, the output head by one matvec
    norms = 4 * r["n_embd"] * (2 * r["n_layer"] + 1)
    assert sum(k["bytes"] for k in mm + head) == r["weight_bytes"] - norms - _embedding_bytes(r)
    assert all(k["tflops"] > 0 for k in mm) and head[0]["tflops"] is None
    for k in mm:   # every dispatch of a shape counted: flops of one x dispatches over their summed time
        rows, cols = map(int, k["kernel"].split()[1].split("x"))
        assert abs(k["tflops"] - 2 * rows * cols * 24 * k["dispatches"] / (k["us"] * 1e6)) <= 1e-9 * k["tflops"]
    assert sum(k["dispatches"] for k in p["by_kernel"]) == sum(k["dispatches"] for k in p["kernels"])
    assert {"attention", "rope", "add_rms_norm", "get_rows_q4_k"} <= {k["kernel"] for k in p["by_kernel"]}


def test_prefill_profile_refuses_a_replayed_prompt():
    res = CliRunner().invoke(command, ["--shape", "small", "--prompt", "8", "--tokens", "2", "--ctx", "32",
                                       "--profile-prefill"])
    assert res.exit_code == 2 and "--profile-prefill needs --prompt above 8" in res.output


def _embedding_bytes(r):
    """token_embd is read by get_rows (one row), not by a matvec."""
    from vramd.bench.models import LlamaShape, _BLOCK

    shape = LlamaShape.for_bytes(64 << 20)
    wtype = next(t for t in r["types"] if t != "F32")
    per, size = _BLOCK[wtype]
    return shape.n_vocab * shape.n_embd // per * size


def test_decode_bench_cli_writes_json(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(command, ["--shape", "small", "--type", "Q8_0", "--prompt", "8", "--tokens", "2",
                                       "--ctx", "32", "--profile", "--profile-steps", "2", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    # rows on 16 bytes: matvec_w; on a CPU device (lavapipe) linear.select() takes the CPU form
    assert "profile (2 steps)" in res.output and ("matvec_w_q8_0" in res.output or "matvec_c_q8_0" in res.output)
    assert json.loads(out.read_text())["profile"]["steps"] == 2


def test_decode_bench_roofline_only_with_a_known_bandwidth():
    """Lavapipe is no H200: without --bandwidth there is no roofline (not the H200's); with it, one."""
    res = CliRunner().invoke(command, ["--shape", "small", "--type", "Q8_0", "--prompt", "8", "--tokens", "2",
                                       "--ctx", "32", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["bandwidth_gbps"] is None and r["roofline_tps"] is None and "--bandwidth" in r["bandwidth_from"]
    res = CliRunner().invoke(command, ["--shape", "small", "--type", "Q8_0", "--prompt", "8", "--tokens", "2",
                                       "--ctx", "32", "--bandwidth", "50"])
    assert res.exit_code == 0 and "at 50 GB/s (--bandwidth)" in res.output, res.output

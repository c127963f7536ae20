"""`vramd plan` and `vramd serve` agree byte for byte on what a model needs (vramd/model/footprint.py).

A real daemon's status breakdown (what its residency core allocated, on
lavapipe, after one request so that the scratch is in) against `vramd plan
--json` for the same file, flags and --ctx.  Before the footprint was shared,
plan sized a MoE model's scratch as a llama model's (918,784 B against the
daemon's 332,800 B for the default synthetic qwen3moe).
"""

import base64
import io
import json
import subprocess
import sys
import urllib.request

import pytest
from PIL import Image

from tests.ggufgen.llama import write_llama
from tests.ggufgen.gemma3 import write_gemma3
from tests.ggufgen.gemma4 import E2B_SHAPE, write_gemma4
from tests.ggufgen.moe import write_moe
from tests.ggufgen.vision import write_mmproj

from .conftest import ROOT, daemon_env

CTX = "64"   # as DaemonProc serves


def plan(path, *flags) -> dict:
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "plan", str(path), "--json", "--ctx", CTX, *flags],
                       capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def post(d, route: str, body: dict) -> None:
    req = urllib.request.Request(d.member().endpoint + route, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def served(d) -> dict:
    """The daemon's breakdown once a request ran (its first compute brought the scratch in)."""
    post(d, "/v1/completions", {"model": d.name, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
    return d.ask("status")["breakdown"]


MODELS = {
    "llama": lambda p: write_llama(p, seed=3, n_vocab=384, n_embd=64, n_ff=160, n_head=4, n_head_kv=2),
    "gemma3": lambda p: write_gemma3(p, n_layer=2, n_embd=64, head_dim=32, n_head=2, seed=3),
    "qwen3moe": lambda p: write_moe(p, arch="qwen3moe", n_layer=3, seed=2),
    # E2B's shape: the per-layer embedding table in the weights, no KV rows for the sharing layers
    "gemma4-e2b": lambda p: write_gemma4(p, weight_type="F16", seed=3, **E2B_SHAPE),
}


@pytest.mark.parametrize("arch, flags", [("llama", ()), ("gemma3", ()), ("qwen3moe", ()),
                                         ("qwen3moe", ("--n-cpu-moe", "1.5")), ("llama", ("--prefill-chunk", "48")),
                                         ("gemma4-e2b", ())])
def test_plan_says_what_serve_allocates(arch, flags, arena, tmp_path, daemons):
    path = MODELS[arch](tmp_path / f"{arch}.gguf")
    want = plan(path, *flags)
    d = daemons(arena, path, arch, *flags)
    got = served(d)
    assert {k: got[k]["device"] for k in ("weights", "state", "scratch", "encoder")} == want["device"]
    assert got["weights"]["host"] == want["host"]["weights"] and got["state"]["host"] == want["host"]["state"]
    assert want["device_bytes"] == sum(got[k]["device"] for k in ("weights", "state", "scratch"))
    if flags and flags[0] == "--prefill-chunk":   # a smaller chunk: a smaller scratch, plan and serve alike
        assert want["prefill_chunk"] == 48 and want["device"]["scratch"] < plan(path)["device"]["scratch"]
        assert plan(path)["prefill_chunk"] == 512
    elif flags:   # the experts --n-cpu-moe keeps on the host are out of the device's weights
        assert want["host"]["experts"] > 0 and want["n_cpu_moe"] == 1.5
        assert want["device"]["weights"] < plan(path)["device"]["weights"]


def test_plan_vram_budget_and_serve_n_cpu_moe_auto_pick_the_same_placement(arena, tmp_path, daemons):
    path = MODELS["qwen3moe"](tmp_path / "moe.gguf")
    full = plan(path, "--parallel", "1")["device_bytes"]   # (under --n-cpu-moe auto serve takes one slot)
    budget = str(full - 1)                      # not all of it: some experts must go to the host
    want = plan(path, "--vram-budget", budget)
    assert 0 < want["n_cpu_moe"] and want["device_bytes"] <= int(budget) < full
    d = daemons(arena, path, "auto", "--n-cpu-moe", "auto", "--vram-budget", budget)
    assert f"--n-cpu-moe auto: {want['n_cpu_moe']:g} layers of experts on the host" in d.output
    got = served(d)
    assert {k: got[k]["device"] for k in ("weights", "state", "scratch", "encoder")} == want["device"]


def test_the_scratch_plan_reported_for_moe_is_the_daemons(tmp_path):
    # The case that disagreed: plan's scratch for the default qwen3moe is its engine's, not llama's.
    from vramd.engine.arch import spec_for
    from vramd.engine.scratch import scratch_layout
    from vramd.model.gguf_check import validate_gguf
    path = write_moe(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=3, seed=2)
    want = sum(n for _t, n in scratch_layout(spec_for(validate_gguf(path))))
    assert plan(path)["regions"]["scratch"]["tensor_bytes"] == want == 333_716   # pos: positions and sequence ids; route_groups: the grouped expert matmul's sort


def test_plan_counts_the_vision_encoder_as_serve_loads_it(arena, tmp_path, daemons):
    lm = write_llama(tmp_path / "lm.gguf", seed=8, n_embd=96, n_head=4, n_vocab=384, vocab="spm")
    mm = write_mmproj(tmp_path / "mm.gguf", "mlp")
    want = plan(lm, "--mmproj", str(mm))
    # --mmproj-resident: after an image the encoder and its activations stay, so they show.
    d = daemons(arena, lm, "vision", "--mmproj", str(mm), "--mmproj-resident")
    got = served(d)
    assert want["encoder_bytes"] > 0 and got["encoder"]["host"] == want["host"]["encoder"] == want["encoder_bytes"]
    assert got["encoder"]["device"] == 0   # in host memory until an image comes
    assert {k: got[k]["device"] for k in ("weights", "state", "scratch")} == \
        {k: want["device"][k] for k in ("weights", "state", "scratch")}
    png = io.BytesIO()
    Image.new("RGB", (24, 24), (200, 40, 90)).save(png, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    image = {"type": "image_url", "image_url": {"url": uri}}
    post(d, "/v1/chat/completions", {"model": d.name, "max_tokens": 1, "temperature": 0,
                                     "messages": [{"role": "user", "content": [image]}]})
    got = d.ask("status")["breakdown"]
    assert got["encoder"]["device"] == want["device"]["encoder"] == want["encoder_bytes"]
    assert got["scratch"]["device"] == want["device"]["scratch"] + want["encode_scratch_bytes"]

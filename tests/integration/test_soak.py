"""The soak (`vramd bench soak`), shortened for CI, and what it found.

The full run (>= 1000 switches) is recorded in docs/reliability.md.
"""

import json
import subprocess
import sys

import pytest

from vramd.bench.soak import PROMPTS, Config, Soak, stream_request, svg_plot

from .conftest import ROOT, daemon_env, planned


def footprint(model) -> int:
    """Device bytes a model needs warm (weights, KV cache, scratch): what it asks for at start-up."""
    return planned(model).device_bytes


def request(d, prompt: str = "the model") -> dict:
    return stream_request(d.member().endpoint, d.name, "completion", prompt, 4)


def test_an_exclusive_daemon_going_warm_evicts_what_a_parked_peer_holds(arena, models, daemons):
    """Found by the soak (mixed layout, a budget for two models but not three): a
    `--residency exclusive` daemon going warm did not ask parked peers to make
    room, restored its weights within what was left and failed its first
    request when the compute scratch did not fit (503, "out of device memory")."""
    one = footprint(models[1])
    budget = str(one + one // 2)           # one model and half another: never both
    cache = daemons(arena, models[1], "cache", "--vram-budget", budget)          # parks everything
    want = request(cache)
    excl = daemons(arena, models[0], "excl", "--vram-budget", budget, "--residency", "exclusive")
    for _ in range(3):
        request(excl)                      # needs room the parked peer holds
        assert request(cache) == want      # and back: evicted parts restored, the same answer
    assert cache.ask("status")["evictions"] >= 1
    assert cache.ask("verify")["weights_ok"] and excl.ask("verify")["weights_ok"]


@pytest.mark.parametrize("layout", ["mixed", "cache"])
def test_soak_shortened(tmp_path, layout):
    """Three daemons (mixed: one exclusive evicting its KV cache, one exclusive
    keeping it, one parking everything; cache: all three parking) under a
    budget of one model and half another, three clients streaming until the
    daemons count 50 switches: nothing fails, every output equals its
    unswitched reference, memory stays flat."""
    cfg = Config(switches=50, clients=3, layout=layout, max_tokens=8, max_seconds=240, sample_interval=0.25,
                 min_requests=50)
    r = Soak(cfg, tmp_path).run()
    assert r["ok"], r["verdict"]
    assert r["switches"] >= 50 and r["failures"] == 0 and r["mismatches"] == 0
    assert r["requests"] >= 50 and all(n > 0 for n in r["requests_per_daemon"].values())
    assert sum(r["evictions_per_daemon"].values()) > 0     # the budget really made peers give up room
    assert r["exit_codes"] == {"alpha": 0, "beta": 0, "gamma": 0}
    assert all(r["verify_weights_ok"].values())
    for name, m in r["memory"].items():
        assert m["rss_growth"] <= m["rss_bound"], (name, m)
        assert m["device_max"] <= m["footprint"], (name, m)
        assert m["heap_host_growth"] is not None and m["heap_host_growth"] <= 2 * 2**20, (name, m)
    svg = svg_plot(r)
    assert svg.startswith("<svg") and svg.count("<polyline") == 6   # RSS and host heap in use, 3 daemons each


def test_soak_command_fails_when_the_target_is_out_of_reach(tmp_path):
    """The soak stops by itself: a wall-clock cap that comes first fails the run (exit 1, one line)."""
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "bench", "soak", "--switches", "100000", "--clients", "1",
                        "--max-seconds", "3", "--vram-budget", "none", "--layout", "cache",
                        "--json-out", str(out)],
                       capture_output=True, text=True, env=daemon_env(), cwd=ROOT, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "vramd: soak failed: the switch target (100000) was not reached within 3 s" in r.stderr
    assert "Traceback" not in r.stderr
    result = json.loads(out.read_text())
    assert result["timed_out"] and not result["ok"] and result["failures"] == 0
    assert result["requests"] > 0 and len(result["prompts"]) == len(PROMPTS)

"""`vramd bench cpu` on a small synthetic model, vramd's side (--no-peer):
the rounds run prefill and decode, and the report holds their medians and
no llama.cpp figures.  (The side-by-side run needs llama.cpp's CPU backend
to run on this CPU; docs/benchmarks.md records it.)"""
from click.testing import CliRunner

from vramd.bench.cpu import command, run
from vramd.bench.models import LlamaShape, write_model


def test_bench_cpu_without_the_peer(tmp_path):
    path = str(write_model(tmp_path / "m.gguf", LlamaShape.for_bytes(16 << 20), wtype="Q8_0", fill="zeros"))
    r = run(path, prompt=16, tokens=2, rounds=2, threads=1, peer_on=False)
    assert r["vramd_prefill_tps"] > 0 and r["vramd_decode_tps"] > 0
    assert len(r["per_round"]["vramd"]) == 2 and r["per_round"]["llama.cpp"] == []
    assert r["llama_decode_tps"] is None and r["decode_ratio"] is None
    res = CliRunner().invoke(command, ["--model", path, "--prompt", "16", "--tokens", "1", "--rounds", "1",
                                       "--no-peer"])
    assert res.exit_code == 0, res.output
    assert "decode 1 tokens: vramd" in res.output and "llama.cpp" not in res.output

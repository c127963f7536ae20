"""`vramd bench attention` (vramd/bench/attention.py) on lavapipe: the portable
prefill attention timed by GPU timestamps over chunked prefills (the figures
mean nothing here; the tensor-core kernel is not there), and the CLI's JSON."""
import json

from click.testing import CliRunner

from vramd.bench import attention


def test_chunked_prefill_timed():
    r = attention.run([40, 70], 32, 4, 2, 64, reps=2)
    assert r["flash_cm"] is False and r["max_abs_diff"] == {}
    assert [(x["tokens"], x["kernel"]) for x in r["results"]] == [(40, "attention_flash"), (70, "attention_flash")]
    assert all(x["ms"] > 0 and x["tflops"] > 0 for x in r["results"])
    # 4 flops x head_dim per (q head, query, key it sees): 70 tokens see 1 + ... + 70 keys
    assert attention._flops(70, 4, 64, 0) == 4 * 64 * 4 * 70 * 71 / 2
    assert attention._flops(70, 4, 64, 16) == 4 * 64 * 4 * (16 * 17 / 2 + 54 * 16)


def test_cli_json_and_bad_heads():
    out = CliRunner().invoke(attention.command, ["--tokens", "9", "--chunk", "4", "--heads", "2,1,32",
                                                 "--reps", "1", "--json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output[out.output.index("{"):])
    assert r["heads"] == [2, 1, 32] and r["results"][0]["tokens"] == 9
    bad = CliRunner().invoke(attention.command, ["--heads", "6,4,128"])
    assert bad.exit_code == 2 and "multiple of KV heads" in bad.output

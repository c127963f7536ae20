"""`vramd bench slots` end to end on a small synthetic model (lavapipe: the numbers mean
nothing here, the GPU run records them): each slot count decodes through the replayed
multi-sequence step and reports its step time and aggregate rate; a bad --slots is one line."""
import json

from click.testing import CliRunner

from vramd.bench.slots import command, run


def test_slots_bench_reports_every_count():
    r = run(None, "small", "Q8_0", [1, 3], prompt=8, tokens=2, ctx=32)
    assert r["n_seq"] == 3 and [row["slots"] for row in r["rows"]] == [1, 3]
    for row in r["rows"]:
        assert row["replayed"] and row["step_ms_p50"] > 0 and row["mixed_step_ms"] > 0
        assert abs(row["tokens_per_s"] - row["slots"] / (row["step_ms_p50"] / 1000)) < 1e-6 * row["tokens_per_s"]
    assert r["rows"][0]["vs_one_slot"] == 1.0


def test_slots_bench_cli():
    out = CliRunner().invoke(command, ["--shape", "small", "--slots", "2", "--prompt", "4", "--tokens", "1",
                                       "--ctx", "16", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["rows"][0]["slots"] == 2
    bad = CliRunner().invoke(command, ["--shape", "small", "--slots", "0,x"])
    assert bad.exit_code == 2 and "slot counts 1..64" in bad.output

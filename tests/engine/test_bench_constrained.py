"""`vramd bench constrained` runs end to end on lavapipe (tiny runs: its figures mean nothing here)."""

import json

from click.testing import CliRunner

from vramd.bench import constrained


def test_the_bench_measures_both_runs_alike(device):
    r = constrained.run(None, "small", "F16", prompt=4, tokens=6, reps=1)
    # minItems keeps the grammar open: the constrained run decodes as many tokens as the free one
    assert r["constrained_tokens"] == r["free_tokens"] > 0
    assert r["free_ms_per_token_p50"] > 0 and r["constrained_ms_per_token_p50"] > 0 and r["mask_ms_p50"] > 0
    assert r["n_vocab"] == 1024


def test_mask_only_needs_no_model():
    out = CliRunner().invoke(constrained.command, ["--shape", "small", "--mask-only", "--tokens", "20", "--json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)
    assert r["n_vocab"] == 1024 and r["tokens"] == 20 and r["mask_ms_p50"] > 0

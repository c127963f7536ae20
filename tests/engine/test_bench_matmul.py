"""`vramd bench matmul` (vramd/bench/matmul.py) on lavapipe: the portable
kernels timed by GPU timestamps on small shapes (the figures mean nothing
here), the tile variants of the sweep well-formed, and the committed
matmul_cm tile (matmul_cm.glsl's default CM_* defines) the one
vramd/engine/linear.py dispatches and budgets shared memory for."""
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from vramd.bench import matmul
from vramd.engine import linear

GLSL = Path(__file__).resolve().parents[2] / "native" / "shaders" / "matmul_cm.glsl"


def test_portable_kernels_timed_on_small_shapes():
    r = matmul.run(["Q8_0", "F16"], [8, 40], reps=2, sweep=None, shapes=[(64, 256), (96, 512)])
    assert r["coopmat"] is False and r["checks"] == {}
    assert len(r["results"]) == 2 * 2 * 2 and {x["kernel"] for x in r["results"]} == {"portable"}
    assert all(x["ms"] > 0 and x["tflops"] > 0 for x in r["results"])
    assert {(s["type"], s["tokens"]) for s in r["summary"]} == {(t, n) for t in ("Q8_0", "F16") for n in (8, 40)}
    assert all(s["shapes"] == 2 and s["layer_ms"] is None for s in r["summary"])
    assert r["best"] == {}   # not the 8B's shapes: no layer to sum


def test_best_is_the_least_summed_layer_time_over_the_types():
    summary = [{"kernel": k, "type": t, "tokens": 256, "layer_ms": ms}
               for k, t, ms in [("a", "F16", 1.0), ("a", "Q4_K", 3.0), ("b", "F16", 1.5), ("b", "Q4_K", 2.0),
                                ("c", "F16", 0.1)]]   # c lacks a type: not a candidate
    best = matmul._best(summary, ["F16", "Q4_K"])
    assert best == {"256": {"kernel": "b", "layer_ms_all_types": 3.5, "ranking": ["b", "a"]}}


def test_every_variant_splits_its_tiles_and_fits_nvidias_48k():
    for name in matmul.VARIANTS:
        c = matmul.config(name)
        assert c["NT"] in (128, 256, 512) and c["SHARED"] <= 49152, name
    with pytest.raises(ValueError, match="do not split"):
        matmul.VARIANTS["bad"] = dict(SGR=32, SGT=32, BK=32)   # 512 threads, 256 W chunks
        try:
            matmul.config("bad")
        finally:
            del matmul.VARIANTS["bad"]


def test_the_committed_tile_is_what_linear_dispatches():
    block = GLSL.read_text().split("#ifndef CM_BR", 1)[1].split("#endif", 1)[0]
    d = {k: int(v) for k, v in re.findall(r"#define CM_(\w+) (\d+)", block)}
    c = {**matmul._BASE, **{k: d[k] for k in matmul._BASE if k != "LATE"}}   # LATE: per type, no tile
    late = GLSL.read_text().split("#ifndef CM_LATE", 1)[1].split("#endif\n#endif", 1)[0]
    assert re.findall(r"#define CM_LATE (\d)", late) == ["1", "0"]
    assert (d["BR"], d["BT"]) == (linear.CM_ROWS, linear.CM_TOKENS)
    matmul.VARIANTS["_committed"] = {k: c[k] for k in matmul._BASE}
    try:
        cfg = matmul.config("_committed")
    finally:
        del matmul.VARIANTS["_committed"]
    assert cfg["NT"] == d["NT"] and cfg["SHARED"] == linear.CM_SHARED


def test_cli_text_and_json():
    args = ["--types", "Q8_0", "--tokens", "8", "--reps", "2", "--shapes", "64x256"]
    res = CliRunner().invoke(matmul.command, args)
    assert res.exit_code == 0 and "Q8_0  n=8     portable" in res.output, res.output
    res = CliRunner().invoke(matmul.command, args + ["--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["results"][0]["kernel"] == "portable"   # progress: stderr


def test_cli_refuses_bad_lists():
    res = CliRunner().invoke(matmul.command, ["--types", "Q5_K"])
    assert res.exit_code == 2 and "--types: Q5_K" in res.output
    res = CliRunner().invoke(matmul.command, ["--tokens", "2"])
    assert res.exit_code == 2 and "matmuls start at 4 tokens" in res.output
    res = CliRunner().invoke(matmul.command, ["--shapes", "64x100"])
    assert res.exit_code == 2 and "multiple of 256" in res.output


def test_sweep_swaps_kernel_and_tile_and_refuses_a_wrong_variant(tmp_path, monkeypatch):
    """The sweep's machinery on lavapipe: a 'variant' that is the portable matmul_q8_0
    under matmul_cm_q8_0's name with its own tile (64 x 32) agrees with the portable kernel
    and is timed; the same with a tile claiming 64 tokens a group (the grid then misses
    half of them) is caught by the check and not timed.  coopmat_usable is forced on so
    that selection picks the cm name (lavapipe has no cooperative matrices)."""
    import shutil

    from vramd.gpu.kernels import shader_path

    monkeypatch.setattr(linear, "coopmat_usable", lambda device: True)
    good = {**matmul._BASE, "BR": 64, "BT": 32, "NT": 256, "SHARED": 0}
    manifest = {"asis": good, "tooWide": {**good, "BT": 64}}
    for name in manifest:
        (tmp_path / name).mkdir()
        shutil.copy(shader_path("matmul_q8_0"), tmp_path / name / "matmul_cm_q8_0.spv")
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    r = matmul.run(["Q8_0"], [40], reps=2, sweep=tmp_path, shapes=[(64, 256)])
    assert r["coopmat"] is True
    assert r["checks"]["asis Q8_0"] < 1e-6 and r["checks"]["tooWide Q8_0"] > 0.1
    assert {x["kernel"] for x in r["results"]} == {"portable", "asis"}
    assert (linear.CM_ROWS, linear.CM_TOKENS) == (128, 128)   # restored after each variant

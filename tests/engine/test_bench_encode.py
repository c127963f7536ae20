"""`vramd bench encode` as the lead runs it (a real `vramd` process, on lavapipe
here: the times mean nothing, the GPU run records them): its JSON holds both
modes and agrees with itself — the encoder is off the device on the text
path on demand and on it when resident, each on-demand restore copies the
encoder's bytes, the VRAM freed is the encoder and its activations.  And the
benchmark's projector writer lays out what the tests' writer does."""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.ggufgen.vision import MmprojSpec, mmproj_metadata, write_mmproj
from vramd.bench.vision_models import VisionShape, clip_metadata, write_llava_mmproj
from vramd.model.gguf_check import validate_gguf
from vramd.model.mmproj import load_mmproj

REPS = 2


@pytest.fixture(scope="module")
def report():
    # The engine conftest chose the driver through VK_DRIVER_FILES; the child inherits it.
    proc = subprocess.run([sys.executable, "-m", "vramd.cli", "bench", "encode", "--shape", "small",
                           "--reps", str(REPS), "--json"], capture_output=True, text=True, timeout=300,
                          env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def check_spread(s: dict, positive: bool = True) -> None:
    assert s["min"] <= s["median"] <= s["max"] and s["min"] <= s["p90"] <= s["max"]
    assert s["min"] > 0 if positive else s["min"] >= 0


def test_both_modes_are_measured_with_positive_times(report):
    assert set(report["modes"]) == {"on-demand", "resident"} and report["reps"] == REPS
    for name, m in report["modes"].items():
        for key in ("restore_ms", "encode_ms", "release_ms", "first_token_ms", "prompt_ms", "prefill_ms",
                    "first_token_phased_ms"):
            check_spread(m[key])
        assert len(m["restore_bytes"]) == REPS
        assert m["embeddings_finite"] and not m["evicted_weights"]
        assert m["image_tokens"] == report["encoder"]["image_tokens"] == 16    # a 4x4 patch grid
        assert m["prompt_tokens"] > m["image_tokens"]
        # An image request's first token comes after its prompt (decode + encode) was built.
        assert m["prompt_ms"]["min"] < m["first_token_ms"]["max"]


def test_on_demand_restores_the_encoder_bytes_each_time_and_resident_restores_nothing(report):
    enc = report["encoder"]["bytes"]
    assert enc > 0
    assert report["modes"]["on-demand"]["restore_bytes"] == [enc] * REPS
    assert report["modes"]["resident"]["restore_bytes"] == [0] * REPS


def test_the_text_path_holds_the_encoder_only_when_resident(report):
    enc, act = report["encoder"]["bytes"], report["encoder"]["act_bytes"]
    on_demand = report["modes"]["on-demand"]["text_path"]
    resident = report["modes"]["resident"]["text_path"]
    assert on_demand["encoder_device_bytes"] == 0 and on_demand["encoder_act_device_bytes"] == 0
    assert on_demand["breakdown"]["encoder"]["host"] == enc          # kept in host memory
    assert resident["encoder_device_bytes"] == enc and resident["encoder_act_device_bytes"] == act > 0
    for t in (on_demand, resident):
        assert t["device_bytes"] == sum(v["device"] for v in t["breakdown"].values())
    # The backbone holds the same in both modes: what on demand frees is the encoder and its activations.
    assert report["text_path_freed_bytes"] == resident["device_bytes"] - on_demand["device_bytes"] == enc + act
    # While encoding, the process held the text path's buffers and the encoder's.
    assert report["modes"]["on-demand"]["image_peak_bytes"] >= on_demand["device_bytes"] + enc + act


def test_restore_stands_next_to_bytes_over_the_link(report):
    link = report["link"]
    assert link["bytes"] == report["encoder"]["bytes"] and link["h2d_gbps"] > 0
    assert math.isclose(link["encoder_bytes_over_link_ms"], link["bytes"] / (link["h2d_gbps"] * 1e9) * 1e3)
    m = report["modes"]["on-demand"]
    assert math.isclose(m["restore_over_link"], m["restore_ms"]["median"] / link["encoder_bytes_over_link_ms"])
    assert report["modes"]["resident"]["restore_over_link"] is None     # nothing restored, no ratio


def test_the_benchmark_projector_has_the_tests_projector_layout(tmp_path):
    """Same sizes, same file layout (names, shapes, types, clip keys) as tests/ggufgen/vision.py's
    LLaVA-style writer; only the values differ.  The loader takes it."""
    shape = VisionShape.preset("small", n_embd_text=96)
    ours = validate_gguf(str(write_llava_mmproj(tmp_path / "bench.gguf", shape)))
    theirs = validate_gguf(str(write_mmproj(tmp_path / "tests.gguf", "mlp", image_size=shape.image_size,
                                            patch_size=shape.patch_size, n_embd=shape.n_embd,
                                            n_head=shape.n_head, n_layer=shape.n_layer, n_ff=shape.n_ff,
                                            n_embd_text=96, layer_bias=True)))
    assert [(t.name, tuple(t.shape), t.type) for t in ours.tensors] == \
        [(t.name, tuple(t.shape), t.type) for t in theirs.tensors]
    keys = set(mmproj_metadata(MmprojSpec(projector="mlp")))
    assert set(clip_metadata(shape)) == keys
    for key in keys:
        ours_value, theirs_value = ours.metadata[key], theirs.metadata[key]
        if isinstance(theirs_value, float) or isinstance(theirs_value, list):
            assert ours_value == pytest.approx(theirs_value), key
        else:
            assert ours_value == theirs_value, key
    cfg, info = load_mmproj(ours)
    assert (cfg.n_layer_run, cfg.n_tokens, info.n_embd_text) == (2, 16, 96) and info.has_class_embd


def test_the_vit_l_preset_is_clip_l_336_at_about_0_6_gb():
    shape = VisionShape.preset("vit-l", n_embd_text=4096)
    assert (shape.image_size, shape.patch_size, shape.n_embd, shape.n_layer, shape.n_ff, shape.n_head) == \
        (336, 14, 1024, 24, 4096, 16)
    assert shape.n_patches == 576 and 0.6e9 < shape.file_bytes() < 0.7e9

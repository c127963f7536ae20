"""The vision encoder in its residency region: output, just-in-time residency, the budget case.

The heart of issue 8 at the engine level: the encoder lives in host memory,
comes to the device for one encode and leaves; if it does not fit next to
the language model the backbone weights make room (no copy) while the KV
cache stays, and the encoder is freed before the weights return.  The
device limit of the residency core stands for a small GPU: an allocation
past it fails, so an encode that succeeds under it never exceeded it.
"""

import numpy as np
import pytest

from tests.engine.models import write_llama
from tests.engine.models_vision import write_mmproj
from tests.engine.reference_vision import ReferenceVision
from vramd.engine.arch import spec_for
from vramd.engine.model import TransformerModel
from vramd.engine.scratch import scratch_layout
from vramd.engine.vision import VisionEncoder
from vramd.errors import OutOfDeviceMemory
from vramd.model import loader
from vramd.model.gguf_check import validate_gguf

CTX = 64


def device_bytes(res, kind=None):
    b = res.breakdown()
    return b[kind]["device"] if kind else sum(v["device"] for v in b.values())


@pytest.fixture
def residency(device):
    from vramd.gpu.residency import Residency
    r = Residency(device)
    yield r
    r.close()


def pixels_for(ref, seed=0):
    s = ref.cfg.image_size
    return np.random.default_rng(seed).standard_normal((3, s, s)).astype(np.float32)


@pytest.mark.parametrize("projector", ["mlp", "gemma3"])
def test_encode_matches_the_reference_and_leaves_nothing_on_the_device(residency, tmp_path, projector):
    path = write_mmproj(tmp_path / "mmproj.gguf", projector)
    enc = VisionEncoder(str(path), residency)
    try:
        ref = ReferenceVision(path)
        assert device_bytes(residency) == 0   # loaded into host memory only
        assert residency.breakdown()["encoder"]["host"] > 0
        for seed in range(3):
            px = pixels_for(ref, seed)
            got, want = enc.encode(px), ref.encode(px)
            assert got.shape == want.shape == (enc.n_tokens, enc.info.n_embd_text)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
            assert device_bytes(residency) == 0   # freed right after each encode
    finally:
        enc.close()


@pytest.fixture
def backbone(residency, tmp_path):
    path = write_llama(tmp_path / "lm.gguf", seed=3, n_embd=96)
    mf = validate_gguf(path)
    cfg = spec_for(mf)
    lm = loader.load(path, residency, CTX, mf=mf, scratch=scratch_layout(cfg, 16))
    residency.restore(["weights", "state"])
    model = TransformerModel(lm, residency, CTX, lm.scratch, batch=16)
    yield model, lm
    model.close()


def test_an_encoder_that_does_not_fit_evicts_the_weights_keeps_the_kv_and_stays_in_budget(residency, tmp_path,
                                                                                          backbone):
    model, lm = backbone
    prompt = [1, 5, 9, 13]
    uninterrupted = residency_free_run(model, prompt)
    model.forward(prompt, 0)                    # the KV cache holds the prompt now
    resident = device_bytes(residency)
    enc = VisionEncoder(str(write_mmproj(tmp_path / "mm.gguf", "mlp")), residency)
    try:
        enc_bytes = enc.region.info()["bytes"] + enc.act.info()["bytes"]
        weights = device_bytes(residency, "weights")
        assert enc_bytes < weights                # evicting the weights makes room
        limit = resident + enc_bytes - 1          # everything together does not fit
        residency.set_device_limit(limit)
        ref = ReferenceVision(enc.path)
        px = pixels_for(ref)
        got = enc.encode(px)                      # an allocation past the limit would have failed
        assert np.abs(got - ref.encode(px)).max() <= 1e-5 * np.abs(ref.encode(px)).max()
        assert device_bytes(residency, "encoder") == 0
        assert device_bytes(residency, "weights") == weights   # the backbone is back
        # The KV cache stayed: decoding goes on exactly as if no image had come.
        assert np.abs(model.forward([21], len(prompt)) - uninterrupted).max() < 1e-5
    finally:
        residency.set_device_limit(0)
        enc.close()


def test_a_failed_encoder_restore_leaves_the_model_serving_text(residency, tmp_path, backbone):
    model, lm = backbone
    prompt = [1, 7, 8]
    before = model.forward(prompt, 0)
    resident = device_bytes(residency)
    weights = device_bytes(residency, "weights")
    # An encoder bigger than the backbone's weights: evicting them does not make enough room.
    enc = VisionEncoder(str(write_mmproj(tmp_path / "mm.gguf", "mlp", n_embd=128, n_ff=512, n_layer=6)), residency)
    try:
        assert enc.region.info()["bytes"] > weights
        residency.set_device_limit(resident + 4096)
        with pytest.raises(OutOfDeviceMemory):
            enc.encode(pixels_for(ReferenceVision(enc.path)))
        # Nothing of the encoder stayed, the weights are back, and text goes on unchanged.
        assert device_bytes(residency, "encoder") == 0
        assert device_bytes(residency, "weights") == weights
        assert np.abs(model.forward(prompt, 0) - before).max() < 1e-5
        residency.set_device_limit(0)
        # A later encode succeeds once there is room.
        assert enc.encode(pixels_for(ReferenceVision(enc.path))).shape[0] == enc.n_tokens
    finally:
        residency.set_device_limit(0)
        enc.close()


def residency_free_run(model, prompt):
    """The next-token logits after `prompt` then token 21, with nothing else happening."""
    model.forward(prompt, 0)
    return model.forward([21], len(prompt))

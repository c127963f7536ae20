"""`vramd serve --mmproj`: images through the OpenAI API, the encoder on the device only for an encode."""

import base64
import io
import json
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest
from PIL import Image

from tests.ggufgen.llama import write_llama
from tests.ggufgen.vision import write_mmproj
from vramd.arena.token import Token

from .conftest import daemon_env


@pytest.fixture
def files(tmp_path):
    lm = write_llama(tmp_path / "lm.gguf", seed=8, n_embd=96, n_head=4, n_vocab=384, vocab="spm")
    mm = write_mmproj(tmp_path / "mm.gguf", "mlp")      # 96-wide embeddings, as the model takes
    return lm, mm


def png_uri(seed: int) -> str:
    img = Image.new("RGB", (40, 28), (seed * 40 % 256, 90, 200 - seed * 30 % 200))
    img.putpixel((3, 4), (255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def client(d):
    return openai.OpenAI(base_url=d.member().endpoint + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(c, model, uri, text="what is this?"):
    r = c.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]}])
    return r.choices[0].message.content, r.usage.prompt_tokens


def encoder_device(d) -> int:
    return d.member().breakdown["encoder"]["device"]


def test_text_keeps_the_encoder_off_the_device_and_images_bring_it_in_just_in_time(arena, files, daemons):
    lm, mm = files
    d = daemons(arena, lm, "v", "--mmproj", str(mm), "--ctx", "128")
    c = client(d)
    assert d.member().breakdown["encoder"]["host"] > 0 and encoder_device(d) == 0
    c.chat.completions.create(model="v", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert encoder_device(d) == 0                      # the text path never brought it in
    text, n_prompt = ask(c, "v", png_uri(1))
    assert n_prompt > 16                               # 16 image positions (a 4x4 patch grid) + the text
    assert encoder_device(d) == 0                      # freed right after the encode
    assert ask(c, "v", png_uri(1))[0] == text          # same image, same answer


def test_an_image_request_under_a_tight_budget_answers_as_an_unconstrained_one(arena, files, daemons):
    lm, mm = files
    free = daemons(arena, lm, "free", "--mmproj", str(mm), "--ctx", "128")
    want, _ = ask(client(free), "free", png_uri(3))
    need = free.member().wants_bytes
    enc = free.member().breakdown["encoder"]["host"]
    assert free.stop() == 0
    # Room for the model and its KV cache, not for the encoder beside them:
    # the weights make room (no copy), the KV stays, the encoder leaves first.
    budget = need + enc // 2
    tight = daemons(arena, lm, "tight", "--mmproj", str(mm), "--ctx", "128", "--vram-budget", str(budget))
    got, _ = ask(client(tight), "tight", png_uri(3))
    assert got == want
    assert encoder_device(tight) == 0
    peak = tight.ask("status")["engine"]["image_peak_bytes"]
    assert 0 < peak <= budget                      # at no step did the encode hold more than the budget


def test_bad_images_are_400s_and_a_model_without_an_encoder_says_so(arena, files, daemons):
    lm, mm = files
    d = daemons(arena, lm, "v", "--mmproj", str(mm), "--ctx", "128")
    c = client(d)
    with pytest.raises(openai.BadRequestError, match="fetches nothing"):
        ask(c, "v", "https://example.invalid/cat.png")
    with pytest.raises(openai.BadRequestError, match="base64"):
        ask(c, "v", "data:image/png;base64,@@@")
    with pytest.raises(openai.BadRequestError):
        ask(c, "v", "data:image/png;base64," + base64.b64encode(b"not an image at all").decode())
    plain = daemons(arena, lm, "plain", "--ctx", "128")
    with pytest.raises(openai.BadRequestError, match="--mmproj"):
        ask(client(plain), "plain", png_uri(1))
    assert ask(c, "v", png_uri(1))[1] > 16             # still serving images after the refusals


def test_a_gemma3_model_with_the_gemma3_projector_takes_images(arena, tmp_path, daemons):
    from tests.ggufgen.gemma3 import write_gemma3
    lm = write_gemma3(tmp_path / "g.gguf", n_embd=96, seed=2)
    mm = write_mmproj(tmp_path / "gm.gguf", "gemma3")     # 96-wide, pooled: 4 image positions
    d = daemons(arena, lm, "g", "--mmproj", str(mm), "--ctx", "128")
    c = client(d)
    text, n_prompt = ask(c, "g", png_uri(4))
    assert isinstance(text, str) and n_prompt > 4
    assert ask(c, "g", png_uri(4))[0] == text
    assert encoder_device(d) == 0


# -- device memory that runs out between the encode and the weights' return ------------

LAYER = "VK_LAYER_VRAMD_fail_alloc"


@pytest.fixture
def fail_alloc(tmp_path):
    """tests/gpu/fail_alloc_layer.c as a Vulkan layer for a daemon: (env, set(n), clear()).
    While set, every device allocation of n bytes or more fails (VK_ERROR_OUT_OF_DEVICE_MEMORY)."""
    d = tmp_path / "layer"
    d.mkdir()
    src = Path(__file__).resolve().parents[1] / "gpu" / "fail_alloc_layer.c"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(d / "libvramd_fail_alloc.so"),
                    str(src)], check=True)
    (d / "fail_alloc.json").write_text(json.dumps({"file_format_version": "1.1.2", "layer": {
        "name": LAYER, "type": "GLOBAL", "library_path": "./libvramd_fail_alloc.so", "api_version": "1.3.0",
        "implementation_version": "1", "description": "vramd tests: vkAllocateMemory fails on demand",
        "functions": {"vkGetInstanceProcAddr": "fa_GetInstanceProcAddr",
                      "vkGetDeviceProcAddr": "fa_GetDeviceProcAddr"}}}))
    flag = tmp_path / "out-of-memory"
    env = daemon_env(VK_LAYER_PATH=str(d), VK_INSTANCE_LAYERS=LAYER, VRAMD_TEST_FAIL_ALLOC=str(flag))
    return env, (lambda n: flag.write_text(str(n))), (lambda: flag.unlink(missing_ok=True))


def test_weights_that_cannot_come_back_after_an_image_leave_the_daemon_cold_then_served(arena, files, daemons,
                                                                                       fail_alloc):
    lm, mm = files
    env, set_oom, clear_oom = fail_alloc
    free = daemons(arena, lm, "free", "--mmproj", str(mm), "--ctx", "128")
    need = free.member().wants_bytes
    enc = free.member().breakdown["encoder"]["host"]
    assert free.stop() == 0
    # As above: the encoder fits only once the weights are out.
    d = daemons(arena, lm, "v", "--mmproj", str(mm), "--ctx", "128", "--vram-budget", str(need + enc // 2), env=env)
    c = client(d)

    def text():
        return c.chat.completions.create(model="v", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=0).choices[0].message.content
    want = text()
    weights = d.member().breakdown["weights"]["device"]
    assert enc < weights
    # Memory runs out for anything the size of the weights: the encoder still comes
    # in (the weights made room), the weights cannot go back.
    set_oom(weights)
    with pytest.raises(openai.APIStatusError) as e:
        ask(c, "v", png_uri(3))
    assert e.value.status_code == 503
    st = d.ask("status")
    assert not st["holds_token"] and st["state"] == "cold"          # cold properly, not warm without weights
    assert all(v["device"] == 0 for v in st["breakdown"].values())
    assert Token(arena / "token.lock").holders() == []
    assert d.member().state == "cold"
    with urllib.request.urlopen(d.member().endpoint + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"
    # Still no memory: a text request goes through the restore and its 503, nothing lost.
    with pytest.raises(openai.APIStatusError) as e:
        text()
    assert e.value.status_code == 503 and "out of device memory" in str(e.value)
    assert d.ask("status")["state"] == "cold"
    clear_oom()                                                       # the memory is back
    assert text() == want
    assert ask(c, "v", png_uri(3))[1] > 16                            # images too

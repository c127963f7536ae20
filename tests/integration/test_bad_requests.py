"""Bad requests never take the GPU (issue 19, item 6).

A cold daemon whose peer holds the token: every request below is a 400 at
once, and the peer is never rung (it keeps the token, its yield count does
not move) and the cold daemon uploads nothing.  Before, each was refused
only after the cold daemon had rung its peer and uploaded its weights.
"""

import base64
import json
import struct
import time
import urllib.error
import urllib.request
import zlib

import pytest

from tests.ggufgen.llama import write_llama
from vramd.arena.token import Token

REFUSING = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
            "messages here') }}{% endif %}{{ m['content'] }}{% endfor %}")


def png_1x1() -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def raw_post(url: str, raw: bytes, timeout: float = 30):
    req = urllib.request.Request(url, raw, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


IMAGE = "data:image/png;base64," + base64.b64encode(png_1x1()).decode()
BAD = [
    ("completions", '{"prompt": [1, 2], "seed": -1}', "seed"),
    ("completions", '{"prompt": [1, 2], "seed": %d}' % (1 << 64), "seed"),
    ("completions", '{"prompt": [1, 2], "temperature": NaN}', "temperature"),
    ("completions", '{"prompt": [1, 2], "top_p": NaN}', "top_p"),
    ("completions", '{"prompt": [1, 2], "temperature": Infinity}', "temperature"),
    ("completions", '{"prompt": [1000000]}', "vocabulary"),
    ("completions", '{"prompt": [3, -1]}', "vocabulary"),
    ("completions", '{"prompt": [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, '
                    '5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, '
                    '5, 5, 5, 5, 5, 5, 5, 5, 5, 5]}', "context"),
    ("completions", json.dumps({"prompt": "hi", "stop": ["x" * 2000]}), "stop"),
    ("chat/completions", json.dumps({"messages": [{"role": "system", "content": "be nice"},
                                                   {"role": "user", "content": "hi"}]}), "no system messages"),
    ("chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}]}),
     "--mmproj"),
]


@pytest.fixture
def refusing_llama(tmp_path):
    return write_llama(tmp_path / "a.gguf", seed=21, n_vocab=384, vocab="spm", chat_template=REFUSING)


def test_bad_requests_are_400s_that_never_ring_the_peer(arena, refusing_llama, models, daemons):
    a = daemons(arena, refusing_llama, "a", "--ctx", "64", "--wake-timeout", "20",
                "--max-request-bytes", str(8 << 20))
    b = daemons(arena, models[1], "beta")
    b.ask("wake")                                   # the peer holds the GPU; `a` is cold
    yields, switches = b.member().yields, a.member().switches
    base = a.member().endpoint + "/v1/"
    huge = json.dumps({"prompt": "word " * 1_000_000}).encode()   # 5 MB of text: far over the context
    for route, raw, says in BAD + [("completions", huge, "context")]:
        t0 = time.monotonic()
        status, body = raw_post(base + route, raw if isinstance(raw, bytes) else raw.encode())
        took = time.monotonic() - t0
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (route, raw[:80], body)
        assert says in body["error"]["message"], body
        assert took < 2.0, (raw[:80], took)
        assert Token(arena / "token.lock").holders() == [b.proc.pid], raw[:80]   # never rung away
    assert b.member().yields == yields and a.member().switches == switches
    assert a.member().state in ("cold", "parked")
    # A good request still goes warm and is served.
    status, body = raw_post(base + "completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": 0}')
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert "Traceback" not in a.output

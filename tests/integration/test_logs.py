"""The daemon's log (issue 21, item 1): what an operator reads in the journal after a session.

Real daemons in their own processes: one line per HTTP and control request
(with the model, status, tokens, queue wait, time to the first token, total),
one per switch, yield (cold, with the reason) and eviction; --log-level,
--log-format json, timestamps only when not under the journal; bad values of
the flags are one line and exit 2.
"""

import json
import re
import time
import urllib.request

import pytest

from .conftest import DaemonProc, daemon_env
from .test_serve_cli import assert_one_line_error, serve
from .test_shutdown import post

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z vramd\[\d+\] ")


def fields(line: str) -> dict:
    """The key=value fields of a text line (values quoted as JSON strings when they hold spaces)."""
    out = {}
    for m in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line):
        v = m.group(2)
        out[m.group(1)] = json.loads(v) if v.startswith('"') else v
    return out


def events(d: DaemonProc, what: str) -> list[dict]:
    return [fields(ln) for ln in d.lines if re.search(rf" INFO {what}( |$)", ln)]


def wait_for(pred, what, d, timeout=20):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"no {what}:\n{d.output}"
        time.sleep(0.02)


def test_a_session_in_text_lines(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    url = a.member().endpoint
    status, body = post(url + "/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0})
    assert status == 200
    # The same prompt again: the cache holds it (all but the last token reused).
    assert post(url + "/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0})[0] == 200
    assert post(url + "/v1/completions", {"prompt": "x", "max_tokens": -3})[0] == 400
    wait_for(lambda: len(events(a, "request")) >= 3, "three request lines", a)
    first, second, bad = events(a, "request")[:3]
    assert first["method"] == "POST" and first["path"] == "/v1/completions" and first["status"] == "200"
    assert first["model"] == "alpha"
    assert int(first["prompt_tokens"]) == 4 and int(first["generated_tokens"]) == body["usage"]["completion_tokens"]
    assert int(first["reused_tokens"]) == 0 and int(second["reused_tokens"]) == 3
    for f in (first, second):
        assert 0 <= float(f["queue_s"]) <= float(f["ttft_s"]) <= float(f["total_s"])
    assert bad["status"] == "400" and "max_tokens" in bad["error"]   # a refusal says why
    assert "prompt_tokens" not in bad
    # Every line of a daemon not under the journal starts with a UTC timestamp.
    assert a.lines and all(STAMP.match(ln) for ln in a.lines), a.output

    # Switches and yields: beta takes the GPU from alpha, then an operator asks for it back.
    b = daemons(arena, models[1], "beta")
    wait_for(lambda: events(b, "switch"), "beta's start-up switch line", b)
    assert events(b, "switch")[0]["reason"] == "start-up"
    wait_for(lambda: any(e["reason"] == "yield" for e in events(a, "cold")), "alpha's yield", a)
    cold = next(e for e in events(a, "cold") if e["reason"] == "yield")
    assert int(cold["kept_on_device_bytes"]) > 0   # cache mode: parked
    switches = len(events(a, "switch"))
    assert a.ask("wake")["ok"]
    wait_for(lambda: len(events(a, "switch")) > switches, "alpha's switch line", a)
    switch = events(a, "switch")[-1]
    # Parked: its buffers were still on the device, nothing to upload.
    assert switch["reason"] == "a wake request" and int(switch["uploaded_bytes"]) == 0
    assert float(switch["switch_s"]) > 0
    assert "beta" in switch["holder_before"]
    wait_for(lambda: any(e["cmd"] == "wake" and e["ok"] == "true" for e in events(a, "control")),
             "the wake's control line", a)
    # beta is parked now: an eviction asked over its control socket is a line with the reason.
    wait_for(lambda: b.member().state == "parked", "beta parked", b)
    assert b.ask("evict", everything=True)["freed"] > 0
    wait_for(lambda: events(b, "evict"), "the evict line", b)   # the line comes through the output pump
    evict = events(b, "evict")[-1]
    assert int(evict["freed_bytes"]) > 0 and "control socket" in evict["reason"]
    assert int(evict["kept_on_device_bytes"]) == 0
    # A refused control request: its code and why.
    with pytest.raises(Exception):
        b.ask("bogus")
    wait_for(lambda: any(e["ok"] == "false" for e in events(b, "control")), "the refused control line", b)
    refused = next(e for e in events(b, "control") if e["ok"] == "false")
    assert refused["code"] == "2" and "unknown command" in refused["error"]
    # Probes and scrapes are debug lines: not at the default level.
    urllib.request.urlopen(url + "/health").read()
    urllib.request.urlopen(url + "/metrics").read()
    time.sleep(0.2)
    assert not [e for e in events(a, "request") if e["path"] in ("/health", "/metrics")]


def test_json_lines_under_the_journal(arena, models, daemons):
    # Under the journal ($JOURNAL_STREAM): no timestamp, journald adds its own.
    d = daemons(arena, models[0], "alpha", "--log-format", "json", "--log-level", "debug",
                env=daemon_env(JOURNAL_STREAM="8:12345"), wait_ready=False)
    wait_for(lambda: any('serving ' in ln for ln in d.lines), "the serving line", d, 60)
    url = d.member().endpoint
    assert post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 3})[0] == 200
    urllib.request.urlopen(url + "/health").read()
    wait_for(lambda: sum('"msg": "request"' in ln for ln in d.lines) >= 2, "two request lines", d)
    objs = [json.loads(ln) for ln in d.lines]   # every line is one JSON object
    assert all("ts" not in o and o["pid"] == d.proc.pid for o in objs)
    req = next(o for o in objs if o["msg"] == "request" and o["path"] == "/v1/chat/completions")
    assert req["status"] == 200 and req["level"] == "info" and req["model"] == "alpha"
    assert isinstance(req["prompt_tokens"], int) and req["generated_tokens"] >= 1
    assert isinstance(req["ttft_s"], float) and req["ttft_s"] <= req["total_s"]
    assert any(o["msg"] == "request" and o["path"] == "/health" and o["level"] == "debug" for o in objs)
    # The load: progress lines (no terminal here) ending at 100 %.
    loading = [o for o in objs if o["msg"] == "loading"]
    assert loading and loading[-1]["percent"] == 100.0 and loading[-1]["bytes"] == loading[-1]["total_bytes"]
    assert any(o["msg"] == "switch" and o["reason"] == "start-up" for o in objs)


def test_log_level_warning_keeps_only_warnings(arena, models, daemons):
    d = daemons(arena, models[0], "alpha", "--log-level", "warning", wait_ready=False)
    wait_for(lambda: d.member() is not None and d.member().endpoint and d.member().state == "warm", "warm", d, 60)
    url = d.member().endpoint
    while True:   # the HTTP server starts after the record is published warm
        try:
            urllib.request.urlopen(url + "/health").read()
            break
        except OSError:
            time.sleep(0.05)
    assert post(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200
    time.sleep(0.3)
    assert not [ln for ln in d.lines if " INFO " in ln or " DEBUG " in ln], d.output


@pytest.mark.parametrize("args, words", [
    (("--log-level", "loud"), ["log_level", "'loud'", "debug, info, warning, error"]),
    (("--log-format", "xml"), ["log_format", "'xml'", "text, json"]),
])
def test_bad_log_flags_are_one_line_and_exit_2(tmp_path, models, args, words):
    assert_one_line_error(serve(str(models[0]), "--arena", str(tmp_path / "arena"), "--port", "0", *args), 2, *words)


def test_bad_log_keys_in_a_config_file(tmp_path, models):
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'model = "{models[0]}"\nlog_level = 3\n')
    assert_one_line_error(serve("--config", str(cfg)), 2, "log_level", "expected a string")
    cfg.write_text(f'model = "{models[0]}"\nlog-format = "yaml"\n')
    assert_one_line_error(serve("--config", str(cfg)), 2, "log_format", "'yaml'")
    cfg.write_text(f'model = "{models[0]}"\nmetrics_public = "yes"\n')
    assert_one_line_error(serve("--config", str(cfg)), 2, "metrics_public", "true or false")


def test_a_request_refused_before_its_route_has_its_line(arena, models, daemons):
    import socket
    d = daemons(arena, models[0], "alpha")
    host, port = d.member().endpoint.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/2.0\r\n\r\n")
        assert b" 505 " in s.recv(100).split(b"\r\n", 1)[0]
    wait_for(lambda: any(e.get("status") == "505" for e in events(d, "request")), "the 505's line", d)
    line = next(e for e in events(d, "request") if e.get("status") == "505")
    assert "Invalid HTTP version" in line["error"]   # the line was refused before its method and path were read

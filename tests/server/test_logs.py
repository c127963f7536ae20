"""vramd/server/logs.py's lines, through a real logging handler into a buffer."""

import io
import json
import logging

import pytest

from vramd.server import logs


@pytest.fixture
def configured(monkeypatch):
    """configure() into a buffer; the root logger's handlers and level put back after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def make(fmt, journal=False, level="info"):
        if journal:
            monkeypatch.setenv("JOURNAL_STREAM", "8:1")
        else:
            monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        buf = io.StringIO()
        logs.configure(level, fmt, stream=buf)
        return buf
    yield make
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_text_fields_stay_one_line_and_parse_back(configured):
    buf = configured("text", journal=True)
    log = logging.getLogger("vramd.test")
    logs.event(log, "request", path="/v1/x", status=200, error='said "no"\nthen left', empty="", t=0.1234567,
               skipped=None)
    (line,) = buf.getvalue().splitlines()
    assert line.startswith("vramd[") and " INFO request path=/v1/x status=200 " in line
    assert 'error="said \\"no\\"\\nthen left"' in line and 'empty=""' in line and "t=0.123457" in line
    assert "skipped" not in line


def test_json_lines_and_timestamps(configured):
    buf = configured("json")
    log = logging.getLogger("vramd.test")
    logs.event(log, "switch", reason="start-up", switch_s=0.5)
    log.warning("%s: plain sentence", "alpha")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second, third = (json.loads(ln) for ln in buf.getvalue().splitlines())
    assert first["msg"] == "switch" and first["reason"] == "start-up" and first["switch_s"] == 0.5
    assert first["ts"].endswith("Z") and first["level"] == "info" and first["logger"] == "vramd.test"
    assert second["msg"] == "alpha: plain sentence" and second["level"] == "warning"
    assert "ValueError: boom" in third["exception"]


def test_level_filters(configured):
    buf = configured("text", level="warning")
    log = logging.getLogger("vramd.test")
    logs.event(log, "request", status=200)
    log.warning("kept")
    assert buf.getvalue().count("\n") == 1 and "kept" in buf.getvalue()
    assert buf.getvalue()[:4].isdigit()   # not under the journal: a timestamp first


def test_load_progress_every_tenth_and_the_end():
    sent = []
    log = logging.getLogger("vramd.test.progress")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        p = logs.LoadProgress(log, "alpha", "/m/alpha.gguf", sent.append)
        for done in range(0, 1001, 10):
            p(done, 1000)
    finally:
        log.removeHandler(handler)
    percents = [r.fields["percent"] for r in records]
    assert percents == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
    assert sent[-1] == "loading: alpha.gguf 100% (0.00 of 0.00 GiB read)"

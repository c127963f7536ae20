"""The daemon's log: one line per event, in text or JSON, with or without timestamps.

This module owns how `vramd serve` writes its log to stderr:

- `--log-level` (debug, info, warning, error) and `--log-format` (text, json);
- under the journal (`$JOURNAL_STREAM` set: systemd connected stderr to
  journald, which stamps every line itself) no timestamp; otherwise each line
  starts with an ISO 8601 UTC time;
- `event(logger, what, **fields)`: a line an operator can grep and a log
  pipeline can parse.  In text each field is `key=value` after the message
  (values with spaces or quotes are quoted as JSON strings); in JSON each line
  is one object: `ts` (unless under the journal), `level`, `logger`, `msg`,
  then the fields.  Lines logged without fields are the same, fields absent.

The events (docs/operations.md, "Logs"): `request` (one per HTTP request),
`control` (one per control-socket request), `switch` (went warm), `cold`
(yielded, slept or stopped, with the reason), `evict` (released parked buffers
for a peer), `loading` (the model's progress when stderr is not a terminal).

Signal handlers never log (they only queue); logging is called from threads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")


def under_journal() -> bool:
    """stderr goes to journald (systemd sets $JOURNAL_STREAM for a unit whose output it takes)."""
    return bool(os.environ.get("JOURNAL_STREAM"))


def event(logger: logging.Logger, what: str, level: int = logging.INFO, **fields) -> None:
    """One event: `what` is the message, `fields` its structured values (None values left out)."""
    if logger.isEnabledFor(level):
        logger.log(level, what, extra={"fields": {k: v for k, v in fields.items() if v is not None}})


def _text_value(v) -> str:
    if isinstance(v, float):
        v = round(v, 6)
    s = v if isinstance(v, str) else json.dumps(v)
    if s == "" or any(c in s for c in ' "=\\') or not s.isprintable():
        return json.dumps(s)
    return s


def _stamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def __init__(self, stamp: bool):
        super().__init__()
        self.stamp = stamp

    def format(self, record: logging.LogRecord) -> str:
        line = f"vramd[{record.process}] {record.levelname} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if self.stamp:
            line = f"{_stamp(record)} {line}"
        if record.exc_info:
            # One event, one line: the traceback's lines joined (the journal keeps it as one entry).
            line += " | " + " | ".join(self.formatException(record.exc_info).splitlines())
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self, stamp: bool):
        super().__init__()
        self.stamp = stamp

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": _stamp(record)} if self.stamp else {}
        out.update(level=record.levelname.lower(), logger=record.name, pid=record.process, msg=record.getMessage())
        for k, v in (getattr(record, "fields", None) or {}).items():
            out.setdefault(k, v)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str = "info", fmt: str = "text", stream=None) -> None:
    """The process's logging, replacing any handler set before (the daemon calls this once)."""
    stamp = not under_journal()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(stamp) if fmt == "json" else TextFormatter(stamp))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))


class LoadProgress:
    """The model's loading progress where there is no terminal for the bar: a `loading` line at
    every tenth of the bytes (and at the end), and a STATUS= line for `systemctl status` at most
    every STATUS_EVERY s (systemd keeps only the last)."""

    STATUS_EVERY = 0.25

    def __init__(self, logger: logging.Logger, name: str, model: str, notify):
        self.log, self.name, self.model, self.notify = logger, name, model, notify
        self.t0 = time.monotonic()
        self.logged_tenth = -1
        self.notified = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        frac = done / total if total else 1.0
        tenth = int(frac * 10)
        gib = 2 ** 30
        if tenth > self.logged_tenth:
            self.logged_tenth = tenth
            event(self.log, "loading", model=self.model, percent=round(frac * 100, 1),
                  bytes=done, total_bytes=total,
                  gib_per_s=round(done / max(now - self.t0, 1e-9) / gib, 3))
        if now - self.notified >= self.STATUS_EVERY or done >= total:
            self.notified = now
            self.notify(f"loading: {os.path.basename(self.model)} {frac:.0%} "
                        f"({done / gib:.2f} of {total / gib:.2f} GiB read)")

"""Ollama's `keep_alive` and its load and unload requests, done over a member's control socket.

vramd keeps every member loaded: a member that gives the GPU up parks (its
buffers stay on the device) and frees its device memory only when a peer
needs the room, at its idle sleep, or when an operator asks (`vramd yield
NAME --release`).  So of Ollama's keep_alive only 0 changes anything:

- absent, a positive duration, or a negative one (Ollama's "for ever"):
  accepted, and it is what vramd does anyway, except that a member is never
  unloaded when a positive duration runs out (residency is vramd's policy).
- 0 (0, "0", "0s", "0m"...): Ollama unloads the model after the reply.  The
  gateway asks the member over its control socket (vramd/server/control.py)
  to go cold and free its device memory, as `vramd yield NAME --release`
  does, once the reply is sent (on a thread: a stream's end is not held
  back by it).  Before forwarding such a request it checks that it may use
  that socket (a status request): a gateway that may not (it runs as another
  user, outside the arena's group) refuses keep_alive 0 with a 400 that says
  so, rather than answer as if the model would be unloaded.
- Load requests (/api/generate with an empty prompt, /api/chat with no
  messages, /api/embed with no input, /api/embeddings with an empty prompt):
  nothing is generated; the member is woken (`vramd wake`: warm, the GPU
  taken) or, with keep_alive 0, made cold and its device memory freed, and
  then the reply says done_reason "load" or "unload" as Ollama's does.

Values are Ollama's: a number of seconds or a Go duration ("5m", "1h30m",
"-1m", "0s"); a number as text ("0", "-1", "300") is seconds.  Anything
else is a 400 naming keep_alive.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from contextlib import contextmanager

from vramd.errors import Timeout, UsageError, VramdError
from vramd.gateway.table import Target
from vramd.server.control import request

log = logging.getLogger("vramd.gateway")

_DURATION = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")
_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
CHECK_WAIT_S = 5.0     # the status request that tells whether the gateway may use a member's socket


class ControlFailed(VramdError):
    http_status = 502


def _ask(t: Target, cmd: str, wait: float, **args) -> dict:
    """One control request; a connection the member reset is a VramdError too (control.request lets it
    through as an OSError)."""
    try:
        return request(t.control, cmd, wait=wait, **args)
    except OSError as e:
        raise VramdError(f"{t.control}: the connection failed: {e.strerror or e}") from None


def unload_asked(body: dict) -> bool:
    """Does the request's keep_alive say "unload after this" (0)?  A 400 for a value Ollama would refuse."""
    v = body.get("keep_alive")
    if v is None:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return v == 0
    if isinstance(v, str):
        s = v.strip()
        try:
            seconds = float(s)
        except ValueError:
            if _DURATION.fullmatch(s):
                return all(float(n) == 0 for n in _NUMBER.findall(s))
        else:
            if math.isfinite(seconds):
                return seconds == 0
    raise UsageError(f"'keep_alive' must be a number of seconds or a duration such as \"5m\", \"0s\" or \"-1m\", "
                     f"got {v!r}")


class Residency:
    """Load and unload asked of members over their control sockets; `wait` bounds a wake (seconds)."""

    def __init__(self, wait: float):
        self.wait = wait

    def _fail(self, t: Target, what: str, e: VramdError) -> ControlFailed:
        err = ControlFailed(f"member '{t.name}' did not {what}: {e}")
        if isinstance(e, Timeout):
            err.http_status = 504
        return err

    def check(self, t: Target) -> None:
        """A 400 unless the gateway may ask `t` to unload: before a keep_alive 0 request is forwarded."""
        why = None
        if not t.control:
            why = "it has no control socket"
        else:
            try:
                _ask(t, "status", CHECK_WAIT_S)
            except VramdError as e:
                why = str(e)
        if why is not None:
            raise UsageError(f"'keep_alive' 0 cannot be done: the gateway cannot ask member '{t.name}' to unload "
                             f"({why}); send a keep_alive other than 0, or run the gateway as the daemons' user "
                             "or in the arena's group")

    def unload(self, t: Target) -> None:
        """`vramd yield NAME --release`: cold, its device memory freed."""
        try:
            _ask(t, "yield", self.wait, release=True)
        except VramdError as e:
            raise self._fail(t, "unload", e) from None

    def unload_later(self, t: Target) -> None:
        """`unload` on a thread, once the reply is out; a failure is the gateway log's (the client has its reply)."""
        def run():
            try:
                self.unload(t)
                log.info("gateway: member %s unloaded (keep_alive 0)", t.name)
            except VramdError as e:
                log.warning("gateway: keep_alive 0: %s", e)
        threading.Thread(target=run, name="vramd-gateway-unload", daemon=True).start()

    @contextmanager
    def unload_after(self, ex, t: Target, asked: bool):
        """Around forwarding a request: with keep_alive 0 (`asked`), `check` first, `unload_later` after
        (the reply sent, or the request failed: either way the member is not to be kept)."""
        if asked:
            self.check(t)
            ex.fields["keep_alive"] = 0
        try:
            yield
        finally:
            if asked:
                self.unload_later(t)

    def load(self, t: Target) -> None:
        """`vramd wake NAME`: warm, the GPU taken (Ollama's preload)."""
        try:
            _ask(t, "wake", self.wait + 5, timeout=self.wait)
        except VramdError as e:
            raise self._fail(t, "load", e) from None

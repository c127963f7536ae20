"""The daemon's guard thread: the token is still the arena's, the arena is still there, the loop lives.

Owns one thread that wakes every GUARD_INTERVAL s and looks at three things
no other thread can be trusted to look at while the loop computes:

- While we hold the token: that the inode we hold the flock on is still the
  one at `<arena>/token.lock` (protocol §2).  Someone who renames it away and
  creates a new one lets a second process take "the" token beside us: split
  brain.  The guard sees it within GUARD_INTERVAL and calls `on_lost`; the
  daemon stops computing at the next engine step and exits with code 4.
- Always: that the arena itself is there (`token.lock`, `members/`,
  `doorbell/`).  `$XDG_RUNTIME_DIR` is wiped at logout; a daemon whose arena
  is gone can neither publish, hear a ring nor be reached, and the arena a
  new daemon creates there is not the one it joined.  `on_lost` again: exit
  4, and systemd (Restart=on-failure) starts it afresh in the new arena.
- Our control socket: removed or replaced, it is bound again (`tend`), so the
  daemon stays reachable by `vramd status`, `yield` and its peers.
- Under systemd's watchdog: WATCHDOG=1 every half period *if the loop's
  heartbeat moved within the whole period*.  The loop beats between jobs, at
  every engine step and every slice of a wait for the GPU, so a long
  generation or a long wait keeps the watchdog fed, and a loop stuck in a
  device call stops it (systemd restarts the daemon).  Before, the loop
  pinged only between jobs: a 60 s wait for the GPU went 76 s without a ping.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from vramd.arena.layout import Arena
from vramd.arena.token import Token
from vramd.errors import TokenError
from vramd.server import systemd

log = logging.getLogger("vramd.guard")

GUARD_INTERVAL = 0.1
JOIN_WAIT = 2.0   # close() waits this long for the thread (part of the daemon's STOP_BOUND)


class Guard:
    def __init__(self, name: str, arena: Arena, token: Token, heartbeat: Callable[[], float],
                 on_lost: Callable[[str], None], tend: tuple[Callable[[], object], ...] = (),
                 interval: float = GUARD_INTERVAL):
        self.name, self.arena, self.token = name, arena, token
        self._heartbeat, self._on_lost = heartbeat, on_lost
        self.interval = interval
        self._tend = tend
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vramd-guard", daemon=True)
        self._lost = False
        self._wd = systemd.watchdog_interval()
        self._last_ping = 0.0
        self._stall_logged = False
        self._last_failure: str | None = None

    def start(self) -> "Guard":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOIN_WAIT)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self._lost:
                    self._look()
                if not self._lost:
                    for tend in self._tend:
                        tend()
                self._feed_watchdog()
            except Exception as e:  # the guard must outlive one failed look (said once, not 10 times a second)
                if str(e) != self._last_failure:
                    log.warning("%s: guard: %s", self.name, e)
                self._last_failure = str(e)
            else:
                self._last_failure = None

    def _look(self) -> None:
        why = None
        try:
            self.token.check()
        except TokenError as e:
            why = str(e)
        if why is None:
            for path, what in ((self.arena.token_path, "token file"), (self.arena.members_dir, "members directory"),
                               (self.arena.doorbell_dir, "doorbell directory")):
                if not os.path.lexists(path):
                    why = (f"{path}: the arena's {what} was removed (the arena was wiped?); this daemon can no "
                           "longer take part in it")
                    break
        if why is not None:
            self._lost = True
            self._on_lost(why)

    def _feed_watchdog(self) -> None:
        if self._wd is None:
            return
        now = time.monotonic()
        if now - self._last_ping < self._wd:
            return
        stalled = now - self._heartbeat()
        if stalled > 2 * self._wd:   # the whole WatchdogSec without a beat: let systemd act
            if not self._stall_logged:
                log.error("%s: the loop has not moved for %.0f s (a device call that does not return?): "
                          "no more watchdog pings", self.name, stalled)
                self._stall_logged = True
            return
        self._stall_logged = False
        systemd.watchdog()
        self._last_ping = now

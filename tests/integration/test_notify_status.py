"""systemd's STATUS= through a daemon's life (issue 21, item 3), on a real notify socket.

The test binds the datagram socket PID 1 would ($NOTIFY_SOCKET) and sets
$JOURNAL_STREAM as systemd does for a unit whose stderr goes to the journal:
loading with its progress, waiting for the token behind its holder, serving,
a later wait, stopping; the loading progress in the log, no timestamps.
"""

import re
import signal
import socket
import time

from vramd.arena.layout import Arena
from vramd.arena.token import Token

from .conftest import DaemonProc, daemon_env
from .test_serve_cli import assert_one_line_error, serve
from .test_shutdown import hold_token_elsewhere, in_thread, post


class Notifications:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.got: list[list[str]] = []   # one list of lines per datagram

    def statuses(self) -> list[str]:
        return [ln[len("STATUS="):] for dg in self.got for ln in dg if ln.startswith("STATUS=")]

    def until(self, pred, what: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, dg in enumerate(self.got):
                if pred(dg):
                    return i
            try:
                self.got.append(self.sock.recv(4096).decode().splitlines())
            except TimeoutError:
                pass
        raise AssertionError(f"no {what}; got {self.got}")


def test_status_while_loading_waiting_serving_and_stopping(tmp_path, models):
    arena = tmp_path / "arena"
    rx = Notifications(tmp_path / "notify.sock")
    Arena.open(arena)   # made here: the blocker's token file exists when it is looked at
    blocker = hold_token_elsewhere(arena)   # `vramd exec -- sleep 60` holds the GPU
    env = daemon_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), JOURNAL_STREAM="8:4242")
    d = DaemonProc(arena, models[0], "alpha", "--wake-timeout", "30", env=env, wait_ready=False)
    try:
        rx.until(lambda dg: any(re.fullmatch(r"STATUS=loading: alpha\.gguf 100% \(.* GiB read\)", ln) for ln in dg),
                 "loading at 100 %")
        assert rx.statuses()[0].startswith("loading: checking ")
        waiting = rx.until(lambda dg: any(ln.startswith("STATUS=waiting for the GPU token") for ln in dg),
                           "waiting for the token")
        line = next(ln for ln in rx.got[waiting] if ln.startswith("STATUS="))
        # Behind whom: the holder, by name and pid.
        assert line.startswith("STATUS=waiting for the GPU token (start-up): held by sleep "), line
        assert str(blocker.pid) in line
        assert not any("READY=1" in dg for dg in rx.got)   # not ready while it waits
        blocker.kill()
        blocker.wait()
        ready = rx.until(lambda dg: "READY=1" in dg, "READY=1")
        assert any(re.fullmatch(r"STATUS=warm: alpha loaded, serving on http://127\.0\.0\.1:\d+", ln)
                   for ln in rx.got[ready])

        # Later: cold, the token held elsewhere again, a request waits behind it.
        d.ask("yield")
        rx.until(lambda dg: any(ln.startswith(("STATUS=parked", "STATUS=cold")) for ln in dg), "parked")
        blocker = hold_token_elsewhere(arena)
        waiter = in_thread(post, d.member().endpoint + "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        rx.until(lambda dg: any(ln.startswith("STATUS=waiting for the GPU token (a generate request): held by sleep ")
                                for ln in dg), "the request's wait")
        blocker.kill()
        blocker.wait()
        waiter["thread"].join(60)
        assert waiter["result"][0] == 200
        rx.until(lambda dg: any(ln.startswith("STATUS=warm: holding the GPU") for ln in dg), "warm again")

        d.proc.send_signal(signal.SIGTERM)
        stop = rx.until(lambda dg: "STOPPING=1" in dg, "STOPPING=1")
        assert any(ln.startswith("STATUS=stopping: signal 15; 0 generation requests in flight")
                   for ln in rx.got[stop]), rx.got[stop]
        assert d.proc.wait(30) == 0
    finally:
        if blocker.poll() is None:
            blocker.kill()
        d.stop()
    # The log under the journal: no timestamps of its own, the load's progress in lines.
    assert d.lines and all(ln.startswith("vramd[") for ln in d.lines), d.output
    loading = [ln for ln in d.lines if " INFO loading " in ln]
    assert loading and "percent=100.0 " in loading[-1], d.output
    assert Token(arena / "token.lock").holders() == []


def test_an_address_not_on_this_machine_is_exit_1_which_systemd_retries(tmp_path, models):
    # 192.0.2.1 (TEST-NET-1) is on no interface: as a NIC's address before the network is up at boot.
    r = serve(str(models[0]), "--arena", str(tmp_path / "arena"), "--port", "0", "--host", "192.0.2.1")
    assert_one_line_error(r, 1, "192.0.2.1", "network-online.target")

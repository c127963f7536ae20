"""Resources that must not run out (issue 19, item 8): timed-out waits, the control socket.

Real daemons, real /proc.  Before, every wait for the GPU that timed out left
a thread and an fd blocked on the token until the holder released (+150 each
after 150 timeouts; with RLIMIT_NOFILE 48, 11 of 45 requests failed "Too many
open files"), and a control socket someone removed was never bound again.
"""

import os
import time

from vramd.errors import VramdError

from .test_shutdown import held_elsewhere, post


def threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_timed_out_waits_do_not_leak_threads_or_fds(arena, models, daemons):
    d = daemons(arena, models[0], "alpha", "--wake-timeout", "0.2")
    with held_elsewhere(d, arena):
        url = d.member().endpoint + "/v1/completions"
        assert post(url, {"prompt": [1], "max_tokens": 1})[0] == 503
        threads0, fds0 = threads_and_fds(d.proc.pid)
        for _ in range(40):
            assert post(url, {"prompt": [1], "max_tokens": 1})[0] == 503
        time.sleep(0.3)
        threads, fds = threads_and_fds(d.proc.pid)
        assert threads - threads0 < 5 and fds - fds0 < 5, (threads0, threads, fds0, fds)   # before: +40 each
    assert post(d.member().endpoint + "/v1/completions", {"prompt": [1], "max_tokens": 1})[0] == 200


def test_a_removed_control_socket_is_bound_again(arena, models, daemons):
    d = daemons(arena, models[0], "alpha")
    os.unlink(d.socket)                      # a careless `rm` in the arena
    deadline = time.monotonic() + 5
    while True:
        try:
            assert d.ask("status")["name"] == "alpha"
            break
        except VramdError:
            assert time.monotonic() < deadline, d.output
            time.sleep(0.05)
    assert "bound it again" in d.output
    assert d.stop() == 0
    assert not d.socket.exists()

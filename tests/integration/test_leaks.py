"""Resources that must not run out (issue 19, item 8): timed-out waits, the control socket.

Real daemons, real /proc.  Before, every wait for the GPU that timed out left
a thread and an fd blocked on the token until the holder released (+150 each
after 150 timeouts; with RLIMIT_NOFILE 48, 11 of 45 requests failed "Too many
open files"), and a control socket someone removed was never bound again.
"""

import os
import time

from vramd.errors import VramdError
from vramd.server.control import request

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


def test_the_control_plane_outlives_running_out_of_threads(arena, models, daemons):
    """Before, a control connection the daemon had no thread for killed its accept thread for
    good: the member was unreachable.  Threads run out here by address space (prlimit RLIMIT_AS
    just above what the daemon maps: each new thread's stack no longer fits)."""
    import resource
    import socket
    d = daemons(arena, models[0], "alpha")
    host, port = d.member().endpoint.rsplit("/", 1)[1].split(":")
    with open(f"/proc/{d.proc.pid}/status") as f:
        vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
    # Less room than one thread's stack (8 MiB): no new thread can start.
    old = resource.prlimit(d.proc.pid, resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
    idle = []
    try:
        for _ in range(4):                   # idle HTTP connections: each would take a thread
            idle.append(socket.create_connection((host, int(port))))
        refused = 0
        for _ in range(6):                   # control requests while no thread can start
            try:
                request(d.socket, "status", wait=2)
            except (VramdError, OSError):
                refused += 1
        assert refused > 0, "threads did not run out: the test proves nothing"
    finally:
        for s in idle:
            s.close()
        resource.prlimit(d.proc.pid, resource.RLIMIT_AS, old)
    deadline = time.monotonic() + 10
    while True:                              # room again: the control plane answers
        try:
            assert request(d.socket, "status", wait=2)["name"] == "alpha"
            break
        except (VramdError, OSError):
            assert time.monotonic() < deadline, d.output[-3000:]
            time.sleep(0.1)
    assert d.proc.poll() is None

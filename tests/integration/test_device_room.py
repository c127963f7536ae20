"""Room on the device between members, and memory that is not theirs.

Real daemons on lavapipe in a memory cgroup they share with a real foreign
Vulkan process (as tests/integration/test_foreign_memory.py: root and cgroup
v1 needed, as on the CI machine), so that the kernel's limit is the device
memory every one of them sees.

- A holder that yields without draining (exclusive mode, the next member's
  need fits by the arena's accounting) still holds its released memory for a
  while: the residency core frees it in the background (~110 ms per 16 GiB on
  the H200).  Here the previous holder's reclaimer thread is stopped with
  ptrace to make that while as long as the test needs; the next holder must
  wait for the memory it was told is coming, not refuse with a 503 blaming
  processes outside the arena.
- A restore that cannot fit even if every member gave everything up is
  refused before the holder is rung (no yield, no upload for nothing).
- A restore that memory outside the arena makes short is made to fit by
  evicting parked peers (need - free), and refused without evicting anyone
  when even that would not do.
- The watchdog's baseline is the least seen while holding, and /metrics does
  not keep the last hold's figure once the daemon is cold.
"""

import ctypes
import os
import threading
import time

import pytest

from tests.ggufgen.llama import write_llama
from vramd.arena.token import Token
from vramd.gpu.memview import FOREIGN_SLACK

from .conftest import daemon_env
from .test_foreign_memory import Foreign, cgroup, get, post, wait_for_line  # noqa: F401 (cgroup: a fixture)

MiB = 1 << 20
EXCLUSIVE = ("--residency", "exclusive", "--evict-state", "auto", "--ctx", "128")
CACHE = ("--residency", "cache", "--ctx", "128", "--parallel", "1")   # (the sizes below are one slot's)
PROMPT = "the quick brown fox"


def env() -> dict:
    # lavapipe's device memory is malloc'd: with a fixed mmap threshold glibc hands a
    # freed block back to the kernel at once (as a driver does device memory), instead
    # of keeping it in the heap where the cgroup still counts it.
    return daemon_env(MALLOC_MMAP_THRESHOLD_=str(64 << 10))


def complete(d) -> tuple[int, dict, dict]:
    return post(d, "/v1/completions", {"model": d.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})


def served(d) -> str:
    status, body, _ = complete(d)
    assert status == 200, body
    return body["choices"][0]["text"]


def f32_model(path, seed: int, n_embd: int = 512, n_ff: int = 1024):
    # ~36 MiB of F32 weights at the defaults (~20 MiB at 384/768): sizes that dwarf the cgroup's noise.
    return write_llama(path, seed=seed, n_vocab=4096, n_embd=n_embd, n_ff=n_ff, n_head=8, weight_type="F32",
                       vocab="spm")


# -- one thread of a daemon, stopped: the residency core's reclaimer ------------------

PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207
WALL = 0x40000000


def reclaimer_tid(pid: int) -> int:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() == "vramd-reclaim":
                return int(tid)
    raise AssertionError(f"pid {pid} has no vramd-reclaim thread")


class StoppedThread:
    """One thread of another process held in a ptrace stop; its other threads run on."""

    def __init__(self, tid: int):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.restype = ctypes.c_long
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        if self.libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
            pytest.skip(f"ptrace refused: {os.strerror(ctypes.get_errno())}")
        self.tid = tid
        assert self.libc.ptrace(PTRACE_INTERRUPT, tid, None, None) == 0, os.strerror(ctypes.get_errno())
        os.waitpid(tid, WALL)

    def resume(self) -> None:
        if self.tid is not None:
            self.libc.ptrace(PTRACE_DETACH, self.tid, None, None)
            self.tid = None


# -- 1. a hand-over between large models while the previous holder's memory is still being freed --

def test_a_handover_waits_for_memory_the_previous_holder_is_still_freeing(cgroup, arena, tmp_path, daemons):
    d, born_inside, set_limit, charged = cgroup
    with born_inside():
        a = daemons(arena, f32_model(tmp_path / "a.gguf", 51), "a", *EXCLUSIVE, env=env())
        b = daemons(arena, f32_model(tmp_path / "b.gguf", 52), "b", *EXCLUSIVE, env=env())
    want_b = served(b)
    served(a)                                  # a warm, b cold: b's need is now what the next switch needs
    need = b.member().wants_bytes
    a_weights = a.member().breakdown["weights"]["device"]
    assert need > 30 * MiB and a_weights > 30 * MiB
    # Not room for b while a's weights are held; room once they are back (with 20 MiB to spare).
    set_limit(charged() + need - 16 * MiB)
    stopped = StoppedThread(reclaimer_tid(a.proc.pid))
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", complete(b)))
    try:
        t.start()
        deadline = time.monotonic() + 30
        while a.member().state not in ("cold", "parked"):   # a yielded: released, token dropped
            assert time.monotonic() < deadline, a.member()
            time.sleep(0.02)
        assert a.member().freeing_bytes >= a_weights     # a says its weights are on their way back
        st = b.ask("status")
        while not (st["holds_token"] and st["state"] == "warming"):   # b takes the token a dropped
            assert time.monotonic() < deadline, st
            time.sleep(0.02)
            st = b.ask("status")
        dm = st["device_memory"]                         # not taken for memory outside the arena
        assert dm["foreign_since"] is None and (dm["foreign"] or 0) <= FOREIGN_SLACK, dm
        time.sleep(1.0)                                  # well past the driver-lag re-checks (0.4 s)
        assert t.is_alive(), f"b did not wait for a's memory: {result}"
    finally:
        stopped.resume()
    t.join(60)
    status, body, _ = result["r"]
    assert status == 200, body
    assert body["choices"][0]["text"] == want_b
    deadline = time.monotonic() + 10
    while a.member().freeing_bytes:                  # drained, and said so
        assert time.monotonic() < deadline, a.member()
        time.sleep(0.05)
    assert "held outside the arena" not in b.output and "not restored" not in b.output


# -- 2a. a restore that nothing the members hold could make fit: refused before ringing --

def test_a_hopeless_restore_is_refused_before_the_holder_is_rung(cgroup, arena, tmp_path, models, daemons):
    d, born_inside, set_limit, charged = cgroup
    with born_inside():
        foreign = Foreign(daemon_env())
        a = daemons(arena, models[0], "a", *EXCLUSIVE, env=env())           # small
        b = daemons(arena, f32_model(tmp_path / "b.gguf", 53), "b", *EXCLUSIVE, env=env())
    try:
        want_b = served(b)
        served(a)
        need = b.member().wants_bytes
        assert need > 30 * MiB and a.member().device_bytes() < 8 * MiB
        set_limit(charged() + need + 16 * MiB)
        foreign(f"alloc {need}")                                 # 16 MiB free: not even a's memory would help
        before = a.member()
        for _ in range(3):                                       # a client retrying
            status, body, headers = complete(b)
            assert status == 503 and headers.get("Retry-After") == "5", body
            after = a.member()
            assert Token(arena / "token.lock").holders() == [a.proc.pid]   # a was never rung off the GPU
            assert (after.yields, after.switches, after.bytes_h2d) == (before.yields, before.switches,
                                                                       before.bytes_h2d)
            assert after.device_bytes() == before.device_bytes()
            message = body["error"]["message"]
            assert "not restored" in message and "none was asked" in message and "outside the arena" in message
        assert b.ask("status")["state"] == "parked"           # as before: its KV cache kept, not holding
        foreign("free")
        assert served(b) == want_b
    finally:
        foreign.close()


# -- 2b. memory outside the arena: parked peers make up the difference, or nobody is touched --

def test_outside_memory_is_made_up_by_evicting_parked_peers_or_refused_untouched(cgroup, arena, tmp_path, daemons):
    d, born_inside, set_limit, charged = cgroup
    with born_inside():
        foreign = Foreign(daemon_env())
        p = daemons(arena, f32_model(tmp_path / "p.gguf", 54, n_embd=384, n_ff=768), "p", *CACHE, env=env())
        b = daemons(arena, f32_model(tmp_path / "b.gguf", 55, n_ff=2048), "b", *CACHE, env=env())
    try:
        served(p)                              # p parks with its scratch too when b takes the GPU
        want_b = served(b)
        need = b.member().device_bytes()       # all of it comes back after the release below
        b.ask("yield", release=True)           # b cold with nothing on the device, p parked
        parked = p.member().device_bytes()
        small = parked - p.member().breakdown["weights"]["device"]    # p's scratch and KV cache
        assert p.member().state == "parked" and parked > 16 * MiB and need > parked + 16 * MiB
        set_limit(charged() + need + 8 * MiB)

        # Short by 8 MiB even if p gave up everything: refused, p untouched.
        foreign(f"alloc {16 * MiB + parked}")
        status, body, _ = complete(b)
        assert status == 503 and "not restored" in body["error"]["message"], body
        assert p.member().device_bytes() == parked and p.ask("status")["evictions"] == 0

        # Short by more than p's scratch and KV cache: p is asked for the difference (its
        # weights go too) and b is served.
        foreign("free")
        foreign(f"alloc {8 * MiB + small + 6 * MiB}")
        assert served(b) == want_b
        assert p.ask("status")["evictions"] == 1 and p.member().device_bytes() == 0
        assert p.ask("verify")["weights_ok"]   # p comes back whole
    finally:
        foreign.close()


# -- 4. the watchdog: the least seen while holding; nothing stale once cold --------------

def test_the_foreign_watch_baseline_is_the_least_seen_and_metrics_end_when_cold(cgroup, arena, tmp_path, daemons):
    d, born_inside, set_limit, charged = cgroup
    with born_inside():
        foreign = Foreign(daemon_env())
        set_limit(charged() + 1536 * MiB)
        foreign(f"alloc {512 * MiB}")          # there when a first looks, gone soon after
        a = daemons(arena, f32_model(tmp_path / "a.gguf", 56), "a", *EXCLUSIVE, env=env())
    try:
        assert a.ask("status")["device_memory"]["foreign_since"] is None
        foreign("free")
        dm = a.ask("status")["device_memory"]
        assert dm["foreign"] == 0 and dm["baseline"] < 256 * MiB, dm   # the baseline follows it down
        foreign(f"alloc {384 * MiB}")          # taken while a holds the token: flagged
        dm = a.ask("status")["device_memory"]
        assert dm["foreign_since"] is not None and 352 * MiB <= dm["foreign"] <= 416 * MiB, dm
        wait_for_line(a, "held outside the arena while we hold the token")

        a.ask("yield")                         # cold: the report ends, in /metrics too
        metrics = get(a, "/metrics")[1].decode()
        line = next(x for x in metrics.splitlines() if x.startswith("vramd_device_foreign_bytes{"))
        assert int(line.split()[-1]) == 0, line
        assert a.ask("status")["device_memory"]["foreign_since"] is None
    finally:
        foreign.close()

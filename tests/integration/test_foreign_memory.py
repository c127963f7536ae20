"""Device memory taken by someone else: a real foreign Vulkan process (not a vramd
peer, tests/gpu/foreign_user.py) holds device memory while a daemon is cold.

The daemon's restore is refused before it allocates anything: HTTP 503 with
the reason and a Retry-After, the daemon stays cold and healthy (token
released, KV shadow intact), and the same request succeeds once the foreign
process has freed its memory.  While the daemon holds the token, the watchdog
reports the foreign user in `status`, `/metrics`, `vramd status` and the log.

Where "device memory" is shared (vramd/gpu/memview.py):

- on a GPU with VK_EXT_memory_budget (the H200) the driver counts every
  process: test_on_a_real_gpu (marked native_gpu: deselected unless `-m native_gpu`, on a GPU);
- on lavapipe, device memory is each process's own host memory and Mesa 22.3
  reports no budget, so a foreign process can take ours only through memory
  the two share.  CI makes that real and deterministic with a memory cgroup
  holding both processes (root and cgroup v1 needed, as on the CI machine):
  the kernel counts the foreign process's device memory against the same
  limit the daemon checks before restoring.
"""

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.ggufgen.llama import write_llama
from vramd.arena.token import Token

from .conftest import ROOT, DaemonProc, daemon_env

MiB = 1 << 20
FLAGS = ("--residency", "exclusive", "--evict-state", "always", "--ctx", "128")
PROMPT = "the quick brown fox"


class Foreign:
    """tests/gpu/foreign_user.py in its own process: allocates and frees device memory on command."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "gpu" / "foreign_user.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().strip() == "ready"

    def __call__(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        assert reply and not reply.startswith("err"), f"foreign process: {line!r} -> {reply!r}"
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def post(d: DaemonProc, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(d.member().endpoint + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def get(d: DaemonProc, path: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(d.member().endpoint + path, timeout=60) as r:
        return r.status, r.read()


def complete(d: DaemonProc) -> tuple[int, dict, dict]:
    return post(d, "/v1/completions", {"model": "alpha", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})


def assert_cold_healthy_and_intact(a: DaemonProc, arena: Path) -> None:
    status, body = get(a, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    st = a.ask("status")
    assert not st["holds_token"] and st["state"] == "cold"
    assert Token(arena / "token.lock").holders() == []
    assert all(v["device"] == 0 for v in st["breakdown"].values())
    assert st["breakdown"]["state"]["host"] > 0          # the KV shadow is still there


def refused(a: DaemonProc) -> dict:
    status, body, headers = complete(a)
    assert status == 503, body
    assert headers.get("Retry-After") == "5"
    message = body["error"]["message"]
    assert "not restored" in message and "nothing lost" in message and "\n" not in message
    return body


def wait_for_line(d: DaemonProc, text: str, timeout: float = 10.0) -> None:
    """The daemon's output is read by a thread: a line it logged may take a moment to arrive."""
    deadline = time.monotonic() + timeout
    while text not in d.output:
        assert time.monotonic() < deadline, f"no {text!r} in the daemon's log:\n{d.output}"
        time.sleep(0.05)


def retry_until_served(a: DaemonProc, want: str, tries: int = 5) -> None:
    for _ in range(tries):
        status, body, headers = complete(a)
        if status == 200:
            assert body["choices"][0]["text"] == want
            return
        time.sleep(min(1.0, float(headers.get("Retry-After", 1))))
    raise AssertionError(f"still refused after the memory came back: {body}")


# -- lavapipe in CI: a memory cgroup shared with the foreign process --------------------

def _v1_memory_cgroup_dir() -> Path | None:
    point = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] == "cgroup" and "memory" in rfields[2].split(",") and fields[3] == "/":
                point = Path(fields[4])
    if point is None:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _hid, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return point / path.lstrip("/")
    return None


@pytest.fixture
def cgroup():
    """A fresh memory cgroup (v1) under ours; yields (dir, born_inside(), set_limit(bytes), charged())."""
    parent = _v1_memory_cgroup_dir()
    if os.geteuid() != 0 or parent is None or not os.access(parent, os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 memory controller (the CI machine has both)")
    d = parent / f"vramd-test-{os.getpid()}-{secrets.token_hex(3)}"
    d.mkdir()
    # Limited from the start (generously): the daemon sees what others hold there from its first look.
    (d / "memory.limit_in_bytes").write_text(str(8 << 30))

    def join(pid: int) -> None:
        (d / "cgroup.procs").write_text(str(pid))

    @contextlib.contextmanager
    def born_inside():
        """Processes started in this block begin life in the cgroup (so all their memory is charged there)."""
        (d / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (parent / "cgroup.procs").write_text(str(os.getpid()))

    def set_limit(nbytes: int) -> None:
        (d / "memory.limit_in_bytes").write_text(str(nbytes))

    def charged() -> int:
        """Bytes the kernel holds against the limit, page cache it would drop first excluded."""
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        return int((d / "memory.usage_in_bytes").read_text()) - int(stat.get("total_inactive_file", 0))

    yield d, born_inside, set_limit, charged
    for _ in range(100):   # the processes are gone once their fixtures ended; the kernel may lag
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.1)


@pytest.fixture
def model(tmp_path):
    # ~36 MiB of F32 weights: a restore whose size dwarfs the cgroup's noise.
    return write_llama(tmp_path / "alpha.gguf", seed=41, n_vocab=4096, n_embd=512, n_ff=1024, n_head=8,
                       weight_type="F32", vocab="spm")


def test_foreign_device_memory_on_lavapipe_is_a_503_then_served(cgroup, arena, model, daemons):
    d, born_inside, set_limit, charged = cgroup
    with born_inside():
        foreign = Foreign(daemon_env())
        a = daemons(arena, model, "alpha", *FLAGS, wait_ready=False)
    try:
        a.wait_ready()
        st = a.ask("status")
        assert st["device_memory"]["source"] == "host"
        need = a.member().wants_bytes
        assert need > 30 * MiB
        status, body, _ = complete(a)
        assert status == 200, body
        want = body["choices"][0]["text"]
        kv = a.ask("verify")["kv_sha256"]
        a.ask("yield", release=True)                     # cold: everything released, the KV cache on the host
        assert a.ask("status")["state"] == "cold"

        # Room for the model and 32 MiB more; the foreign process takes 48 of it.
        set_limit(charged() + need + 32 * MiB)
        foreign(f"alloc {48 * MiB}")
        body = refused(a)
        assert "memory cgroup" in body["error"]["message"]
        assert_cold_healthy_and_intact(a, arena)
        assert "vramd_restore_failures_total" in get(a, "/metrics")[1].decode()
        assert refused(a)                                # still cold, still refused, nothing changed

        foreign("free")
        assert a.ask("verify")["kv_sha256"] == kv        # warm again: the KV cache came back whole
        retry_until_served(a, want)

        # The watchdog: while alpha holds the token, the foreign process takes 384 MiB
        # (more than memview.FOREIGN_SLACK).
        set_limit(charged() + 1024 * MiB)
        assert a.ask("status")["holds_token"]
        before = a.ask("status")["device_memory"]
        assert before["foreign_since"] is None
        foreign(f"alloc {384 * MiB}")
        dm = a.ask("status")["device_memory"]
        assert dm["holding_token"] and dm["foreign_since"] is not None
        assert 352 * MiB <= dm["foreign"] <= 416 * MiB, dm
        wait_for_line(a, "held outside the arena while we hold the token")
        metrics = get(a, "/metrics")[1].decode()
        line = next(x for x in metrics.splitlines() if x.startswith("vramd_device_foreign_bytes{"))
        assert int(line.split()[-1]) >= 352 * MiB
        out = subprocess.run([sys.executable, "-m", "vramd.cli", "status", "--arena", str(arena)],
                             capture_output=True, text=True, env=daemon_env(), timeout=60)
        assert "foreign alpha:" in out.stdout and "ignores the token" in out.stdout, out.stdout + out.stderr
        foreign("free")
        dm = a.ask("status")["device_memory"]
        assert dm["foreign_since"] is None and dm["foreign"] < 256 * MiB
        wait_for_line(a, "the foreign device memory is gone")
    finally:
        foreign.close()


# -- a real GPU: the driver's budget counts every process ------------------------------

def fill(foreign, nbytes: int, smallest: int) -> None:
    """The foreign process takes about nbytes in pieces: a driver caps one
    allocation (and may give a little less than its budget says), so a piece
    it refuses is halved, down to `smallest`."""
    piece = 8 << 30
    while nbytes >= smallest and piece >= smallest:
        n = min(piece, nbytes)
        foreign.proc.stdin.write(f"alloc {n}\n")
        foreign.proc.stdin.flush()
        if foreign.proc.stdout.readline().startswith("ok"):
            nbytes -= n
        else:
            piece //= 2


@pytest.mark.native_gpu
def test_on_a_real_gpu(arena, model, daemons):
    env = daemon_env()
    a = daemons(arena, model, "alpha", *FLAGS, env=env)
    st = a.ask("status")
    if st["device_memory"]["source"] != "driver":
        pytest.skip(f"{st['device']['name']} has no VK_EXT_memory_budget")
    foreign = Foreign(env)
    try:
        print("budget, foreign idle:", foreign("budget"))
        need = a.member().wants_bytes
        status, body, _ = complete(a)
        assert status == 200, body
        want = body["choices"][0]["text"]
        kv = a.ask("verify")["kv_sha256"]
        a.ask("yield", release=True)
        free = a.ask("status")["device_memory"]["free"]
        # Fill all but half the model's need: the restore cannot fit.
        fill(foreign, free - need // 2, smallest=max(need // 4, 1 << 20))
        print("budget, foreign full:", foreign("budget"))
        print("daemon's view:", a.ask("status")["device_memory"])
        body = refused(a)
        assert "held outside the arena" in body["error"]["message"]
        assert_cold_healthy_and_intact(a, arena)
        foreign("free")
        assert a.ask("verify")["kv_sha256"] == kv
        retry_until_served(a, want)
        foreign(f"alloc {2 << 30}")
        dm = a.ask("status")["device_memory"]
        print("watchdog:", dm)
        assert dm["foreign_since"] is not None and dm["foreign"] >= (2 << 30) - 256 * MiB
        wait_for_line(a, "held outside the arena while we hold the token")
        foreign("free")
        # The driver's budget follows a free within moments, not at once (the H200: not
        # yet on the next status); the report clears when it does.
        deadline = time.monotonic() + 10
        while a.ask("status")["device_memory"]["foreign_since"] is not None:
            assert time.monotonic() < deadline, a.ask("status")["device_memory"]
            time.sleep(0.2)
    finally:
        foreign.close()

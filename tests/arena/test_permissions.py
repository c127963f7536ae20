"""The arena's permission models, tested with real second uids.

Each identity is a forked child that drops root for good (setgroups, setgid,
setuid) before it touches the arena, so the kernel, not vramd, decides what
it may open; then vramd's own code runs as that uid.  The uids are numbers
no account uses; the groups are throwaway ones made with groupadd (a system
arena names its groups) and removed afterwards.

- a user arena (brief §9: private to one uid, 0700): nobody else takes its
  token, reads its records, rings it, or takes its default path first;
- a system arena (`vramd arena init --group G --ring-group R`): G's
  daemons take the token and read each other's records; R's members ring
  and nothing else; others do nothing at all;
- a ring that names another user's process is forged and not acted on;
- the control socket: its peer's credentials decide (same uid, root, or the
  directory's group when the directory is group-shared), not the file mode.
"""

import errno
import grp
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from vramd.arena import doorbell
from vramd.arena.arbiter import Participant
from vramd.arena.layout import Arena, default_base, init_system_arena
from vramd.arena.members import Member, Registry, process_start_time
from vramd.arena.queue import Queue
from vramd.arena.token import Token
from vramd.errors import VramdError
from vramd.server.control import ControlServer, request

from .conftest import wait_until


@pytest.fixture(autouse=True)
def _root():
    if os.getuid() != 0:
        pytest.fail("these tests switch to other uids: run the suite as root (CI does)")


# -- identities -----------------------------------------------------------------

def free_uids(n: int) -> list[int]:
    """`n` uids no account uses (so no file on the system belongs to them)."""
    used = {p.pw_uid for p in pwd.getpwall()}
    out = [u for u in range(61000, 62000) if u not in used][:n]
    assert len(out) == n
    return out


def groupadd(name: str) -> int:
    for _ in range(20):  # /etc/group may be locked by a concurrent groupadd
        r = subprocess.run(["groupadd", "--system", name], capture_output=True, text=True)
        if r.returncode == 0:
            return grp.getgrnam(name).gr_gid
        time.sleep(0.1)
    pytest.fail(f"groupadd {name}: {r.stderr}")


@pytest.fixture
def groups():
    """Two throwaway groups: daemons (take the token) and ringers (only ring)."""
    tag = secrets.token_hex(3)
    names = {"daemons": f"vtd-{tag}", "ringers": f"vtr-{tag}"}
    made = {}
    try:
        for role, name in names.items():
            made[role] = (name, groupadd(name))
        yield made
    finally:
        for name, _gid in made.values():
            for _ in range(20):
                if subprocess.run(["groupdel", name], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)


AT_RELEASE: list = []  # what a staying child does once released (in the child)


class As:
    """A forked child running `fn(*args)` as uid/gid/groups; it answers in JSON and can stay alive.

    With `start=False` the child (its pid known) waits for `go()` before it
    runs `fn`: a test can prepare something that names its pid first.
    """

    _holding: set[int] = set()  # write ends that keep staying children alive, open in this process

    def __init__(self, uid: int, gid: int, supplementary: list[int], fn, *args, stay: bool = False,
                 start: bool = True):
        r, w = os.pipe()
        hold_r, self._hold_w = os.pipe()
        go_r, self._go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            os.close(r)
            os.close(self._hold_w)
            os.close(self._go_w)
            for fd in As._holding:  # else an earlier staying child would outlive its release
                os.close(fd)
            try:
                os.setgroups(supplementary)
                os.setgid(gid)
                os.setuid(uid)
                os.environ.pop("XDG_RUNTIME_DIR", None)
                os.environ.pop("VRAMD_ARENA", None)
                os.chdir("/")
                os.read(go_r, 1)
                out = {"ok": fn(*args)}
            except BaseException as e:
                out = {"error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
            os.write(w, json.dumps(out).encode() + b"\n")
            if stay:
                os.read(hold_r, 1)  # until the test lets go
                for cleanup in AT_RELEASE:
                    cleanup()
            os._exit(0)
        os.close(w)
        os.close(hold_r)
        os.close(go_r)
        As._holding.add(self._hold_w)
        self._r = os.fdopen(r)
        self.reply = None
        if start:
            self.go()

    def go(self) -> None:
        """Let the child run `fn`, and read its answer."""
        os.write(self._go_w, b"g")  # a byte, not EOF: children forked since hold a copy of this end
        os.close(self._go_w)
        self.reply = json.loads(self._r.readline() or '{"error": "EOF"}')

    def result(self):
        assert "ok" in self.reply, self.reply
        return self.reply["ok"]

    def release(self) -> None:
        if self._hold_w is not None:
            As._holding.discard(self._hold_w)
            os.close(self._hold_w)
            self._hold_w = None
            os.waitpid(self.pid, 0)
            self._r.close()


def run_as(uid, gid, supplementary, fn, *args):
    child = As(uid, gid, supplementary, fn, *args)
    child.release()
    return child.result()


def attempt(fn, *args):
    """What an action comes to: "ok", or the error's class and a word of its message."""
    try:
        fn(*args)
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    except VramdError as e:
        return f"{type(e).__name__}: {e}"


@pytest.fixture
def shm():
    """A scratch directory others can traverse (pytest's tmp tree is 0700)."""
    base = tempfile.mkdtemp(prefix="vramd-perm-", dir="/dev/shm")
    os.chmod(base, 0o755)
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)


# -- the user arena ---------------------------------------------------------------

def make_user_arena(path: str) -> dict:
    arena = Arena.open(path)
    Registry(arena.members_dir).write(Member(name="mine", pid=os.getpid(), start_time=1.0))
    doorbell.ring(arena.doorbell_dir)
    modes = {p.name: oct(stat.S_IMODE(os.lstat(p).st_mode))
             for p in [arena.path, arena.token_path, arena.doorbell_dir, arena.members_dir, arena.queue_dir,
                       arena.control_dir]}
    modes["record"] = oct(stat.S_IMODE(os.lstat(Registry(arena.members_dir).path_for(os.getpid())).st_mode))
    return {"pid": os.getpid(), "modes": modes}


def intrude(path: str, owner_pid: int) -> dict:
    arena = Path(path)
    return {
        "open arena": attempt(Arena.open, path),
        "take token": attempt(lambda: Token(arena / "token.lock").try_acquire()),
        "open token": attempt(os.open, str(arena / "token.lock"), os.O_RDONLY),
        "read record": attempt(lambda: open(arena / "members" / f"{owner_pid}.json").read()),
        "list members": attempt(os.listdir, str(arena / "members")),
        "members seen": [m.name for m in Registry(arena / "members").list(clean=False)],
        "ring": attempt(doorbell.ring, arena / "doorbell"),
        "take ticket": attempt(lambda: Queue(arena / "queue").take()),
    }


def test_a_user_arena_is_the_users_alone(shm):
    owner, other = free_uids(2)
    os.chown(shm, owner, owner)
    path = str(shm / "arena")
    made = run_as(owner, owner, [], make_user_arena, path)
    assert made["modes"] == {"arena": "0o700", "token.lock": "0o600", "doorbell": "0o700", "members": "0o700",
                             "queue": "0o700", "control": "0o700", "record": "0o640"}
    # Another uid, even one in the owner's primary group, can do nothing in it.
    seen = run_as(other, other, [owner], intrude, path, made["pid"])
    assert seen["open arena"].startswith(f"ArenaError: {path}: arena belongs to uid {owner}, not you")
    assert seen["take token"] == f"TokenError: {path}/token.lock: permission denied"
    assert seen["open token"] == seen["read record"] == seen["list members"] == "EACCES"
    assert seen["members seen"] == []
    assert seen["ring"].startswith(f"ArenaError: {path}/doorbell/") and "permission denied" in seen["ring"]
    assert seen["take ticket"].startswith("ArenaError") and "permission denied" in seen["take ticket"]
    # The owner, of course, still can.
    assert run_as(owner, owner, [], lambda: Token(Path(path) / "token.lock").try_acquire()) is True


def test_a_user_arena_base_squatted_by_another_uid_is_refused(shm):
    owner, squatter = free_uids(2)
    base = Path(f"/dev/shm/vramd-{owner}")  # the default base of `owner` when it has no XDG_RUNTIME_DIR
    assert not base.exists()
    try:
        run_as(squatter, squatter, [], lambda: os.mkdir(base, 0o777) or os.chmod(base, 0o777))

        def open_default():
            assert default_base() == base
            return attempt(Arena.open, str(base / "gpu0"))
        refused = run_as(owner, owner, [], open_default)
        assert refused.startswith(f"ArenaError: {base}: the per-user arena base belongs to uid {squatter}")
        assert not (base / "gpu0").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- the system arena ---------------------------------------------------------------

def daemon_member(path: str) -> dict:
    arena = Arena.open(path)
    token = Token(arena.token_path)
    took = token.try_acquire()
    Registry(arena.members_dir).write(Member(name="d1", pid=os.getpid(), start_time=process_start_time(os.getpid())))
    ticket = Queue(arena.queue_dir).take()
    doorbell.ring(arena.doorbell_dir)
    record = Registry(arena.members_dir).path_for(os.getpid())
    st = os.lstat(record)
    return {"took": took, "pid": os.getpid(), "ticket": ticket.name,
            "record": [oct(stat.S_IMODE(st.st_mode)), st.st_gid]}


def other_daemon(path: str, first_pid: int) -> dict:
    arena = Arena.open(path)
    return {"members": [m.name for m in Registry(arena.members_dir).list(clean=False)],
            "queue": [pid for _n, pid in Queue(arena.queue_dir).live()],
            "token busy": not Token(arena.token_path).try_acquire()}


def ringer(path: str, first_pid: int) -> dict:
    arena = Arena.open(path)  # a ring-only member may open the arena...
    ring = attempt(doorbell.ring, arena.doorbell_dir)  # ...and ring
    return {
        "pid": os.getpid(),
        "ring": ring,
        "take token": attempt(lambda: Token(arena.token_path).try_acquire()),
        "read record": attempt(lambda: open(arena.members_dir / f"{first_pid}.json").read()),
        "members seen": [m.name for m in Registry(arena.members_dir).list(clean=False)],
        "take ticket": attempt(lambda: Queue(arena.queue_dir).take()),
        "remove others' ring": attempt(os.unlink, str(arena.doorbell_dir / str(first_pid))),
        "replace token": attempt(os.rename, str(arena.doorbell_dir / str(os.getpid())), str(arena.token_path)),
        "unlink token": attempt(os.unlink, str(arena.token_path)),
        "control dir": attempt(os.listdir, str(arena.control_dir)),
    }


def test_system_arena_daemons_take_the_token_and_ringers_only_ring(shm, groups):
    (gname, gid), (rname, rgid) = groups["daemons"], groups["ringers"]
    d1, d2, ring_uid, outsider = free_uids(4)
    path = shm / "arena"
    init_system_arena(path, gname, rname, d1)  # d1 stands for the daemons' user, owner of doorbell/
    token_st = os.stat(path / "token.lock")
    assert (oct(stat.S_IMODE(token_st.st_mode)), token_st.st_gid) == ("0o660", gid)
    bell_st = os.stat(path / "doorbell")
    assert (oct(stat.S_IMODE(bell_st.st_mode)), bell_st.st_uid, bell_st.st_gid) == ("0o1770", d1, rgid)

    # Daemons are in both groups (systemd/sysusers.d: user vramd, groups vramd and vramd-ring).
    first = As(d1, d1, [gid, rgid], daemon_member, str(path), stay=True)  # holds the token and a ticket
    try:
        got = first.result()
        assert got["took"] is True
        assert got["record"] == ["0o640", gid]  # group-readable through the setgid members/ directory
        # A second daemon of the group reads the first's record and ticket, and waits for its token.
        seen = run_as(d2, d2, [gid, rgid], other_daemon, str(path), got["pid"])
        assert seen == {"members": ["d1"], "queue": [got["pid"]], "token busy": True}

        # A ring-only member rings, and can do nothing else.
        rang = run_as(ring_uid, ring_uid, [rgid], ringer, str(path), got["pid"])
        assert rang["ring"] == "ok"
        assert rang["take token"] == f"TokenError: {path}/token.lock: permission denied"
        assert rang["read record"] == "EACCES" and rang["members seen"] == []
        assert rang["take ticket"].startswith("ArenaError") and "permission denied" in rang["take ticket"]
        assert rang["remove others' ring"] == "EPERM"     # the doorbell is sticky
        assert rang["replace token"] == rang["unlink token"] == "EACCES"   # the arena's root is root's
        assert rang["control dir"] == "EACCES"

        # The owner of doorbell/ (the daemons' user) may remove any ring file
        # there, e.g. one left under a daemon's pid; another daemon uid may not.
        left = str(path / "doorbell" / str(rang["pid"]))
        assert run_as(d2, d2, [gid, rgid], attempt, os.unlink, left) == "EPERM"
        assert run_as(d1, d1, [gid, rgid], attempt, os.unlink, left) == "ok"

        # Anyone else cannot even ring.
        out = run_as(outsider, outsider, [], ringer, str(path), got["pid"])
        assert "permission denied" in out["ring"] and out["take token"].startswith("TokenError")
        assert out["read record"] == "EACCES" and out["members seen"] == []
    finally:
        first.release()
    assert Token(path / "token.lock").holders() == []  # the kernel dropped it with the holder


def ring_and_stay(doorbell_dir: str, as_pid: int | None):
    return str(doorbell.ring(Path(doorbell_dir), as_pid))


def test_a_ring_only_member_makes_the_holder_yield(shm, groups):
    gname, rname, rgid = groups["daemons"][0], groups["ringers"][0], groups["ringers"][1]
    (ring_uid,) = free_uids(1)
    path = shm / "arena"
    init_system_arena(path, gname, rname)
    with Participant(Arena.open(path), "holder", quantum=0.0) as holder:
        holder.ensure_warm()
        script = As(ring_uid, ring_uid, [rgid], ring_and_stay, str(path / "doorbell"), None, stay=True)
        try:
            assert script.result() == str(path / "doorbell" / str(script.pid))
            wait_until(holder.yield_requested, timeout=10)
            assert holder.idle()
        finally:
            script.release()


def test_a_ring_naming_another_users_process_is_forged_and_ignored(shm):
    (outsider,) = free_uids(1)
    path = shm / "shared"
    path.mkdir()
    os.chmod(path, 0o777)  # a llama.cpp-style arena anyone may write
    arena = Arena.open(path, allow_shared=True)
    for sub in ("doorbell", "members", "queue", "control"):
        os.chmod(path / sub, 0o777)
    victim = subprocess.Popen(["sleep", "60"])  # a root process the outsider did not start
    try:
        with Participant(arena, "holder", quantum=0.0) as holder:
            holder.ensure_warm()
            forged = As(outsider, outsider, [], ring_and_stay, str(path / "doorbell"), victim.pid, stay=True)
            try:
                assert forged.result().endswith(f"/{victim.pid}")
                wait_until(lambda: holder.ring_gate.forged >= 1, timeout=10)
                assert not holder.yield_requested()
                # The same user ringing as itself is heard.
                own = As(outsider, outsider, [], ring_and_stay, str(path / "doorbell"), None, stay=True)
                try:
                    wait_until(holder.yield_requested, timeout=10)
                finally:
                    own.release()
            finally:
                forged.release()
    finally:
        victim.kill()
        victim.wait()


# -- ring files another user left under a daemon's pid ------------------------------------

def warm_up(path: str) -> dict:
    """A daemon going warm: the error if any, its record, what it logged, whether a ring file of its pid is left."""
    import logging
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())
    logging.getLogger("vramd.arbiter").addHandler(Keep())
    arena = Arena.open(path)
    p = Participant(arena, "d", quantum=0.0).start()
    try:
        try:
            p.ensure_warm(timeout=5)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        record = Registry(arena.members_dir).read(os.getpid())
        return {"error": error, "held": p.holds_token, "record": record.state if record else None,
                "logged": logged, "ring file": os.path.lexists(arena.doorbell_dir / str(os.getpid()))}
    finally:
        p.close()


def squatted_daemon(path: Path, daemon_uid: int, groups: list[int], squatter: int, squatter_groups: list[int]):
    """A daemon (not yet started) and a ring file under its pid made by a ring-only user (`vramd ring --pid`)."""
    daemon = As(daemon_uid, daemon_uid, groups, warm_up, str(path), start=False)
    bell = path / "doorbell"
    assert run_as(squatter, squatter, squatter_groups, ring_and_stay, str(bell), daemon.pid) == \
        str(bell / str(daemon.pid))
    assert os.lstat(bell / str(daemon.pid)).st_uid == squatter
    daemon.go()
    daemon.release()
    return daemon.result()


def test_the_daemons_user_owns_the_doorbell_and_removes_a_ring_file_left_under_its_pid(shm, groups):
    (gname, gid), (rname, rgid) = groups["daemons"], groups["ringers"]
    daemon_uid, ring_uid = free_uids(2)
    path = shm / "arena"
    init_system_arena(path, gname, rname, daemon_uid)
    bell = os.stat(path / "doorbell")
    assert (bell.st_uid, bell.st_gid, oct(stat.S_IMODE(bell.st_mode))) == (daemon_uid, rgid, "0o1770")
    got = squatted_daemon(path, daemon_uid, [gid, rgid], ring_uid, [rgid])
    # In a sticky directory its owner may remove any file: the daemon clears
    # the squat, rings, and goes warm as usual.
    assert got == {"error": None, "held": True, "record": "warm", "logged": [], "ring file": False}


def test_a_daemon_that_cannot_ring_goes_warm_when_the_token_is_free(shm, groups):
    (gname, gid), (rname, rgid) = groups["daemons"], groups["ringers"]
    daemon_uid, ring_uid = free_uids(2)
    path = shm / "arena"
    init_system_arena(path, gname, rname)  # no user named like the group: doorbell/ stays root's
    assert os.stat(path / "doorbell").st_uid == 0
    # The token is free: a ring would ask nobody anything, so none is needed.
    got = squatted_daemon(path, daemon_uid, [gid, rgid], ring_uid, [rgid])
    assert (got["error"], got["held"], got["record"]) == (None, True, "warm"), got
    assert any("cannot ring" in line and "the token is free, so going warm without a ring" in line
               for line in got["logged"]), got["logged"]
    assert got["ring file"]  # still the squatter's; it rings for nobody (a holder ignores its own pid)

    # The token is held: without a ring the holder cannot be asked to yield.
    # One clear error, and the record goes back to cold (not left "warming").
    # (In another process: a daemon forked from this one would inherit our lock.)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX)\ntime.sleep(60)",
                               str(path / "token.lock")])
    try:
        wait_until(lambda: Token(path / "token.lock").holders(), timeout=10)
        got = squatted_daemon(path, daemon_uid, [gid, rgid], ring_uid, [rgid])
    finally:
        holder.kill()
        holder.wait()
    assert got["error"].startswith("ArenaError: ") and "cannot be asked to yield without a ring" in got["error"], got
    assert f"the token is held by pid {holder.pid}" in got["error"]
    assert (got["held"], got["record"]) == (False, "cold"), got


# -- the ring limit per user ------------------------------------------------------------------

def test_a_user_ringing_as_several_of_its_processes_gets_one_ring_per_interval(shm, groups):
    gname, (rname, rgid) = groups["daemons"][0], groups["ringers"]
    user, other_user = free_uids(2)
    path = shm / "arena"
    init_system_arena(path, gname, rname)
    bell = path / "doorbell"
    # Two processes of one ring-only user ring, each as itself (as `vramd ring
    # --pid P` for each of its processes would), and one of another user.
    ringers = [As(user, user, [rgid], ring_and_stay, str(bell), None, stay=True) for _ in range(2)]
    other = As(other_user, other_user, [rgid], ring_and_stay, str(bell), None, stay=True)
    try:
        for r in [*ringers, other]:
            r.result()
        pids = {r.pid for r in ringers}
        gate = doorbell.RingGate(bell, interval=1.0)
        t0 = time.monotonic()
        first = gate.admit(pids | {other.pid}, set)
        # One ring of the user per interval; the other user's ring is not delayed by it.
        assert other.pid in first and len(first & pids) == 1, first
        (later,) = pids - first
        # Deferred, not dropped: acted on once the user's interval is over.
        got = wait_until(lambda: gate.admit((), set), timeout=5, interval=0.01)
        assert got == {later} and time.monotonic() - t0 >= 0.9
        # A ring the kernel proves (a waiter's) goes through at once, limit or not.
        assert gate.admit(pids, lambda: pids) == pids
    finally:
        for r in [*ringers, other]:
            r.release()


def judge_under_hidepid(bell: str, ringer_pid: int, holder_uid: int) -> dict:
    """As root in a child: a private mount namespace whose /proc hides other users' processes
    (hidepid=invisible); then, as `holder_uid`, judge the ringer's ring."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "-t", "proc", "-o", "hidepid=invisible", "proc", "/proc"], check=True)
    os.setgroups([])
    os.setgid(holder_uid)
    os.setuid(holder_uid)
    return judge(bell, ringer_pid) | {"sees the ringer": os.path.exists(f"/proc/{ringer_pid}")}


def judge(bell: str, ringer_pid: int) -> dict:
    gate = doorbell.RingGate(Path(bell))
    return {"admitted": sorted(gate.admit({ringer_pid}, set)), "forged": gate.forged}


def test_under_hidepid_a_ring_from_a_process_we_cannot_see_is_not_plausible(shm):
    holder_uid, ringer_uid = free_uids(2)
    bell = shm / "doorbell"
    bell.mkdir()
    os.chmod(bell, 0o1777)
    ringer = As(ringer_uid, ringer_uid, [], ring_and_stay, str(bell), None, stay=True)
    try:
        ringer.result()
        # /proc as usual: the ringer rang as itself, so the holder acts on it.
        assert run_as(holder_uid, holder_uid, [], judge, str(bell), ringer.pid) == {"admitted": [ringer.pid],
                                                                                      "forged": 0}
        # hidepid: nothing vouches that the file's owner runs that pid: only a
        # proof (a waiter) could admit it.
        hidden = As(0, 0, [], judge_under_hidepid, str(bell), ringer.pid, holder_uid)
        hidden.release()
        assert hidden.result() == {"admitted": [], "forged": 1, "sees the ringer": False}
    finally:
        ringer.release()


# -- the control socket ---------------------------------------------------------------

def serve_control(sock_path: str):
    """A ControlServer as this uid, until released; it answers with the uid it runs as."""
    server = ControlServer(Path(sock_path), lambda req: {"ok": True, "served_by": os.getuid()}).start()
    AT_RELEASE.append(server.close)
    return oct(stat.S_IMODE(os.lstat(sock_path).st_mode))


def ask(sock_path: str):
    try:
        return request(sock_path, "status", wait=10)["served_by"]
    except VramdError as e:
        return f"refused: {e}"


@pytest.mark.parametrize("layout", ["group-shared", "private"])
def test_control_socket_peers_are_checked_by_their_credentials(shm, groups, layout):
    (_gname, gid) = groups["daemons"]
    owner, groupmate, outsider = free_uids(3)
    control = shm / "control"
    control.mkdir()
    os.chown(control, owner, gid)
    # group-shared: a system arena's control/ (2770 root:G; here owned by the
    # daemon's uid, which changes nothing for the check), with o+x so that
    # the kernel lets a stranger reach the socket and the credentials check
    # is what refuses it.  private: a user arena's 0700 (o+x likewise).
    os.chmod(control, 0o2771 if layout == "group-shared" else 0o701)
    sock = str(control / "d.sock")
    daemon = As(owner, owner, [gid], serve_control, sock, stay=True)
    try:
        assert daemon.result() == "0o660"
        os.chmod(sock, 0o666)  # the kernel lets everyone connect: only SO_PEERCRED decides now
        assert ask(sock) == owner                                          # root
        assert run_as(owner, owner, [], ask, sock) == owner                # the same uid
        mate = run_as(groupmate, groupmate, [gid], ask, sock)              # a member of the directory's group
        if layout == "group-shared":
            assert mate == owner
        else:
            assert "permission denied" in mate, mate    # a private directory shares with no group
        stranger = run_as(outsider, outsider, [], ask, sock)
        assert stranger.startswith("refused: permission denied"), stranger
    finally:
        daemon.release()
    assert not os.path.exists(sock)

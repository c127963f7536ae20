"""sd_notify against real datagram sockets, and the systemd units checked by systemd's own tools.

Nothing here needs a running systemd: the notification socket is one the
test binds, `systemd-analyze verify` loads the units offline, and
`systemd-sysusers` / `systemd-tmpfiles` work inside a scratch root (--root).
"""

import grp
import logging
import os
import pwd
import select
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from vramd.arena import layout
from vramd.server import systemd as sd

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "systemd"
SERVICE = UNITS / "vramd@.service"
TMPFILES = UNITS / "tmpfiles.d" / "vramd.conf"
SYSUSERS = UNITS / "sysusers.d" / "vramd.conf"
REAL_EXEC = "/usr/local/bin/vramd"


# --- sd_notify ---------------------------------------------------------------

@pytest.fixture(autouse=True)
def fresh_notifier(monkeypatch):
    """Each test starts outside systemd with no cached socket and no logged failure."""
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(var, raising=False)
    sd.reset()
    yield
    sd.reset()


@pytest.fixture
def short_dir():
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="vramd-sd-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


class Receiver:
    """What PID 1 does: a bound datagram socket that reads the sender's credentials."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)
        self.sock.settimeout(5)

    def recv(self):
        """One datagram and the pid the kernel vouches for (SCM_CREDENTIALS)."""
        ucred = struct.calcsize("3i")
        data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(ucred))
        pid = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("3i", payload[:ucred])[0]
        return data, pid

    def pending(self):
        """Read one waiting datagram, if there is one, without waiting."""
        if not select.select([self.sock], [], [], 0)[0]:
            return False
        self.sock.recv(4096)
        return True

    def close(self):
        self.sock.close()


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def test_outside_systemd_nothing_happens():
    before = open_fds()
    assert sd.notify_address() is None
    assert sd.sd_notify("READY=1") is False
    assert sd.ready("loaded") is False
    assert sd.status("warm") is False
    assert sd.stopping() is False
    assert sd.watchdog() is False
    assert sd.mainpid() is False
    assert sd.extend_timeout(60) is False
    assert sd.watchdog_interval() is None
    assert sd._sock is None  # no socket was even created
    assert open_fds() == before


def test_path_socket_receives_each_message_as_one_datagram(short_dir, monkeypatch):
    path = short_dir / "notify"
    rx = Receiver(str(path))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sd.ready("serving chat.gguf")
        assert sd.status("cold: peer task holds the GPU")
        assert sd.watchdog()
        assert sd.mainpid()
        assert sd.extend_timeout(1.5)
        assert sd.stopping("SIGTERM: finishing 1 request")
        assert sd.sd_notify("STATUS=a", "ERRNO=0")
        got = [rx.recv() for _ in range(7)]
        assert [data for data, _ in got] == [
            b"READY=1\nSTATUS=serving chat.gguf",
            b"STATUS=cold: peer task holds the GPU",
            b"WATCHDOG=1",
            f"MAINPID={os.getpid()}".encode(),
            b"EXTEND_TIMEOUT_USEC=1500000",
            b"STOPPING=1\nSTATUS=SIGTERM: finishing 1 request",
            b"STATUS=a\nERRNO=0",
        ]
        # The kernel names us as the sender: NotifyAccess=main accepts these.
        assert {pid for _, pid in got} == {os.getpid()}
        assert not rx.pending()
    finally:
        rx.close()


def test_abstract_socket(monkeypatch):
    name = f"vramd-test-{uuid.uuid4().hex}"
    rx = Receiver("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd.notify_address() == b"\0" + name.encode()
        assert sd.ready()
        assert sd.status("warm")
        assert rx.recv() == (b"READY=1", os.getpid())
        assert rx.recv() == (b"STATUS=warm", os.getpid())
    finally:
        rx.close()


def test_status_text_cannot_inject_assignments(short_dir, monkeypatch):
    path = short_dir / "notify"
    rx = Receiver(str(path))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sd.status("model evil\nREADY=1\r\nMAINPID=1")
        data, _ = rx.recv()
        assert data.count(b"\n") == 0 and data.startswith(b"STATUS=model evil ")
    finally:
        rx.close()


def test_socket_is_cached_and_one_per_process(short_dir, monkeypatch):
    path = short_dir / "notify"
    rx = Receiver(str(path))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sd.watchdog()
        first = sd._sock
        before = open_fds()
        for _ in range(5):
            assert sd.watchdog()
            rx.recv()
        assert sd._sock is first and open_fds() == before
        assert first.get_inheritable() is False
    finally:
        rx.close()


def test_vanished_socket_does_not_raise_logs_once_and_recovers(short_dir, monkeypatch, caplog):
    path = short_dir / "notify"
    rx = Receiver(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    assert sd.status("one")
    assert rx.recv()[0] == b"STATUS=one"

    rx.close()
    path.unlink()  # the manager went away
    with caplog.at_level(logging.DEBUG, logger="vramd.server.systemd"):
        assert sd.watchdog() is False
        assert sd._sock is None  # dropped, to be recreated
        assert sd.watchdog() is False
        assert sd.ready("x") is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 2

    # The same path bound again (a re-executed manager): notifications resume.
    rx = Receiver(str(path))
    try:
        assert sd.status("two")
        assert rx.recv()[0] == b"STATUS=two"
    finally:
        rx.close()


def test_vanished_abstract_socket_does_not_raise(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", f"@vramd-test-gone-{uuid.uuid4().hex}")
    assert sd.ready() is False


def test_unusable_addresses_do_not_raise(monkeypatch, short_dir):
    monkeypatch.setenv("NOTIFY_SOCKET", "/" + "x" * 200)  # longer than sun_path
    assert sd.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_dir))  # a directory, not a socket
    assert sd.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # newer systemd; not ours to guess
    assert sd.notify_address() is None and sd.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert sd.watchdog() is False


def test_full_receiver_drops_the_message_instead_of_blocking(short_dir, monkeypatch):
    # A wedged manager that never reads: the main loop must not hang on it.
    monkeypatch.setattr(sd, "SEND_TIMEOUT_S", 0.05)
    path = short_dir / "notify"
    rx = Receiver(str(path))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        start = time.monotonic()
        sent = 0
        while sd.watchdog():
            sent += 1
            assert sent < 100_000, "the receive queue never filled"
        assert time.monotonic() - start < 5
        assert sent >= 1
        while rx.pending():
            pass
        assert sd.watchdog()  # room again: the next ping goes through
    finally:
        rx.close()


@pytest.mark.parametrize("usec, pid, expected", [
    (None, None, None),
    ("30000000", None, 15.0),          # WatchdogSec=30: ping every 15 s
    ("30000000", "self", 15.0),
    ("30000000", "1", None),           # the watchdog watches another process
    ("1000", None, 0.0005),
    ("0", None, None),
    ("-5", None, None),
    ("soon", None, None),
    ("30000000", "not-a-pid", None),
    ("", None, None),
])
def test_watchdog_interval(monkeypatch, usec, pid, expected):
    if usec is not None:
        monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid)
    assert sd.watchdog_interval() == expected


def test_watchdog_pid_of_another_process(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getppid()))
    assert sd.watchdog_interval() is None


# --- the unit ------------------------------------------------------------------

def unit_settings(text):
    """(section, key, value) for every assignment of a unit file."""
    section, out = None, []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key, value))
    return out


def service_values(key):
    return [v for s, k, v in unit_settings(SERVICE.read_text()) if k == key]


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: scripts/setup.sh installs Debian's systemd package"
    original = SERVICE.read_text()
    assert original.count(REAL_EXEC) == 1
    # verify insists that ExecStart's binary exists; the tested copy differs
    # from the shipped unit in that one path and nothing else.
    fake = tmp_path / "bin" / "vramd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    copy = original.replace(REAL_EXEC, str(fake))
    assert copy.replace(str(fake), REAL_EXEC) == original
    unit = tmp_path / "vramd@.service"
    unit.write_text(copy)

    r = subprocess.run([analyze, "verify", "--man=no", str(unit), str(tmp_path / "vramd@chat.service")],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, SYSTEMD_LOG_LEVEL="info", SYSTEMD_LOG_COLOR="0"))
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, out
    # Unknown keys and bad values are warnings with exit code 0: there must be none.
    ours = [line for line in out.splitlines() if "vramd" in line]
    assert ours == [], out


def test_unit_runs_the_daemon_on_the_system_arena():
    (exec_start,) = service_values("ExecStart")
    argv = exec_start.split()
    assert argv[:2] == [REAL_EXEC, "serve"]
    assert argv[argv.index("--config") + 1] == "/etc/vramd/%i.toml"
    assert argv[argv.index("--arena") + 1] == str(layout.SYSTEM_ARENA)
    assert service_values("ReadWritePaths") == [str(layout.SYSTEM_ARENA)]
    assert service_values("AssertPathIsDirectory") == [str(layout.SYSTEM_ARENA)]
    for key, value in [("Type", "notify"), ("NotifyAccess", "main"), ("WatchdogSec", "30"),
                       ("Restart", "on-failure"), ("DevicePolicy", "closed"),
                       ("ProtectSystem", "strict"), ("ProtectHome", "read-only"),
                       ("User", "vramd"), ("Group", "vramd"), ("LimitMEMLOCK", "infinity")]:
        assert service_values(key) == [value], key
    allowed = {v.split()[0] for v in service_values("DeviceAllow")}
    assert {"char-nvidia*", "char-drm"} <= allowed
    # Options that would hide the GPU, break the Vulkan JIT or wipe the arena.
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "DynamicUser", "RemoveIPC"):
        assert service_values(key) == [], key


# --- users, groups and the system arena ------------------------------------------

def parse_tmpfiles(text):
    """{path: (type, mode, user, group)} of a tmpfiles.d file."""
    entries = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        kind, path, mode, user, group = line.split()[:5]
        entries[path] = (kind, int(mode, 8), user, group)
    return entries


def describe_tree(top, group_names, user_names):
    """{relative path: (kind, mode, owner name, group name)} of an arena on disk."""
    out = {}
    for path in [top, *sorted(top.iterdir())]:
        st = os.lstat(path)
        kind = "d" if stat.S_ISDIR(st.st_mode) else "f" if stat.S_ISREG(st.st_mode) else "?"
        rel = "." if path == top else path.name
        out[rel] = (kind, stat.S_IMODE(st.st_mode), user_names(st.st_uid), group_names(st.st_gid))
    return out


def test_tmpfiles_only_creates_the_system_arena():
    entries = parse_tmpfiles(TMPFILES.read_text())
    top = str(layout.SYSTEM_ARENA)
    assert entries[top] == ("d", 0o755, "root", "root")
    assert all(p == top or os.path.dirname(p) == top for p in entries)
    # `d` and `f` create without truncating; no age column, so nothing is ever
    # cleaned (the exact layout is compared with `vramd arena init` below).
    assert {kind for kind, *_ in entries.values()} == {"d", "f"}
    for line in TMPFILES.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert len(line.split()) == 5, line


@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles and arena init chown: needs root "
                    "(CI and the dev machine run as root)")
def test_sysusers_and_tmpfiles_lay_out_what_arena_init_does(tmp_path):
    """systemd's own tools, in a scratch root, against init_system_arena on this host.

    The two layouts must agree on every path's kind, mode, owner and which of
    the two groups owns it, so they can never drift apart.
    """
    sysusers, tmpfiles = shutil.which("systemd-sysusers"), shutil.which("systemd-tmpfiles")
    assert sysusers and tmpfiles, "Debian's systemd package is missing (scripts/setup.sh)"
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    r = subprocess.run([sysusers, f"--root={root}", str(SYSUSERS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([tmpfiles, "--create", f"--root={root}", str(TMPFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr

    groups = {}
    members = {}
    for line in (root / "etc" / "group").read_text().splitlines():
        name, _, gid, users = line.split(":")
        groups[int(gid)] = name
        members[name] = set(filter(None, users.split(",")))
    groups.setdefault(0, "root")
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines()}
    users = {int(fields[2]): name for name, fields in passwd.items()}
    users.setdefault(0, "root")

    # Every user and group the unit names exists, and the daemon's user is in
    # the groups that let it take the token and ring.
    (user,) = service_values("User")
    (group,) = service_values("Group")
    assert user in passwd and groups[int(passwd[user][3])] == group
    for extra in service_values("SupplementaryGroups")[0].split():
        assert user in members[extra], extra

    made = describe_tree(root / str(layout.SYSTEM_ARENA).lstrip("/"), lambda gid: groups[gid], lambda uid: users[uid])

    # Two real groups of this host stand in for vramd and vramd-ring.
    stand_ins = [g for g in grp.getgrall() if g.gr_gid != 0]
    token_group, ring_group = stand_ins[0], next(g for g in stand_ins if g.gr_gid != stand_ins[0].gr_gid)
    # ...and a real user of this host for the daemons' user vramd.
    daemon_user = next(p for p in pwd.getpwall() if p.pw_uid != 0)
    arena = tmp_path / "init" / "vramd"
    layout.init_system_arena(arena, token_group.gr_name, ring_group.gr_name, daemon_user.pw_name)
    role = {token_group.gr_gid: "vramd", ring_group.gr_gid: "vramd-ring", 0: "root"}
    user_role = {daemon_user.pw_uid: "vramd", 0: "root"}
    inited = describe_tree(arena, lambda gid: role.get(gid, gid), lambda uid: user_role.get(uid, uid))

    assert made == inited
    # doorbell/ belongs to the daemons' user: in a sticky directory its owner
    # may remove any ring file, so a daemon can clear one left under its pid.
    assert made["doorbell"] == ("d", 0o1770, "vramd", "vramd-ring")
    assert made[layout.TOKEN] == ("f", 0o660, "root", "vramd")

    # Running tmpfiles again (by hand, or systemd-tmpfiles-setup after an
    # upgrade) changes nothing: no truncation, no cleaning of rings.
    live = root / str(layout.SYSTEM_ARENA).lstrip("/")
    (live / layout.TOKEN).write_bytes(b"kept")
    (live / layout.DOORBELL / "4242").write_bytes(b"")
    r = subprocess.run([tmpfiles, "--create", "--clean", f"--root={root}", str(TMPFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (live / layout.TOKEN).read_bytes() == b"kept"
    assert (live / layout.DOORBELL / "4242").exists()
    assert describe_tree(live, lambda gid: groups[gid], lambda uid: users[uid]) == made


def test_timeout_stop_covers_the_daemons_stop_path():
    """TimeoutStopSec= is the stop path's bound (daemon.STOP_BOUND: the loop, the replies, the
    threads) plus room for releasing the buffers; a longer stop path must raise it."""
    from vramd.server import daemon
    (value,) = service_values("TimeoutStopSec")
    assert daemon.STOP_BOUND == 16.0
    assert int(value) >= daemon.STOP_BOUND + 10, (value, daemon.STOP_BOUND)
    # The unit's comment states the numbers it was reasoned from.
    text = SERVICE.read_text()
    assert f"{daemon.STOP_BOUND:g} s at most before the buffers" in text
    assert f"most {daemon.STOP_GRACE:g} s, the cut-short replies {daemon.REPLY_GRACE:g} s" in text


def verify_with_drop_in(tmp_path, drop_in: str):
    """systemd-analyze verify of vramd@chat.service with `drop_in` as its drop-in, from a unit path of ours."""
    analyze = shutil.which("systemd-analyze")
    fake = tmp_path / "bin" / "vramd"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    units = tmp_path / "units"
    (units / "vramd@chat.service.d").mkdir(parents=True, exist_ok=True)
    (units / "vramd@.service").write_text(SERVICE.read_text().replace(REAL_EXEC, str(fake)))
    (units / "vramd@chat.service.d" / "network-online.conf").write_text(drop_in)
    # The unit path of ours first, then systemd's own (network-online.target lives there): the trailing ':'.
    r = subprocess.run([analyze, "verify", "--man=no", "vramd@chat.service"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path,
                       env=dict(os.environ, SYSTEMD_UNIT_PATH=f"{units}:", SYSTEMD_LOG_LEVEL="info",
                                SYSTEMD_LOG_COLOR="0"))
    return r.returncode, [ln for ln in (r.stdout + r.stderr).splitlines() if "network-online.conf" in ln]


def test_network_online_drop_in_is_a_valid_drop_in(tmp_path):
    text = (UNITS / "network-online.conf").read_text()
    settings = unit_settings(text)
    assert ("Unit", "After", "network-online.target") in settings
    assert ("Unit", "Wants", "network-online.target") in settings
    rc, complaints = verify_with_drop_in(tmp_path, text)
    assert rc == 0 and complaints == [], complaints
    # The drop-in is read (a typo in it is reported): the check above can fail.
    rc, complaints = verify_with_drop_in(tmp_path, text.replace("Wants=", "Wantz="))
    assert complaints and "Wantz" in " ".join(complaints), complaints
    # The template itself stays ordered after network.target only (it cannot know the host).
    assert service_values("After") == ["network.target"]
    readme = (UNITS / "README.md").read_text()
    assert "network-online.conf /etc/systemd/system/vramd@chat.service.d/network-online.conf" in readme


def test_readme_install_names_what_the_build_needs():
    """pip install . compiles the native core: the README's apt line names the compiler, the C
    library's headers, Vulkan's and Python's, and the Vulkan loader the daemon runs on."""
    readme = (UNITS / "README.md").read_text()
    apt = next(ln for ln in readme.splitlines() if ln.startswith("apt-get install "))
    named = set(apt.split()[2:])
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    listed = set(setup.split("APT_PACKAGES=(", 1)[1].split(")", 1)[0].split())
    build = {"gcc", "libc6-dev", "libvulkan-dev", "libvulkan1", "python3-venv"}
    assert build <= listed, "scripts/setup.sh no longer installs what the README names"
    assert build | {"python3-dev"} <= named, apt
    assert apt in readme.split("pip install .", 1)[0]   # before the step that needs them

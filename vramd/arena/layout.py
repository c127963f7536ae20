"""The arena directory: where it is, what it holds, and whether it is safe.

An arena is one directory per GPU shared by every participant on that GPU:

    <arena>/token.lock       the flock baton (never unlinked, never written)
    <arena>/doorbell/<pid>   rings: "pid wants the token"
    <arena>/members/<pid>.json   what each vramd participant is doing
    <arena>/queue/           tickets that make waiting FIFO (vramd only)
    <arena>/control/<name>.sock  daemons' control sockets (vramd only)

llama.cpp's VRAM arbiter uses only token.lock and doorbell/, so the two
interoperate.  Everything here is opened with O_NOFOLLOW and checked to be
the kind of file it should be: in a directory others can write, a planted
symlink, FIFO or directory must give a clear error, never a truncated file
elsewhere or a hang.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from vramd.errors import ArenaError, UsageError

TOKEN = "token.lock"
DOORBELL = "doorbell"
MEMBERS = "members"
QUEUE = "queue"
CONTROL = "control"

ENV_ARENA = "VRAMD_ARENA"
SYSTEM_ARENA = Path("/run/vramd")
ENV_SYSTEM_ARENA = "VRAMD_SYSTEM_ARENA"   # where the units' arena is, if not SYSTEM_ARENA (and for tests)


def system_arena() -> Path:
    """The system arena the systemd units share: $VRAMD_SYSTEM_ARENA, else /run/vramd."""
    return Path(os.environ.get(ENV_SYSTEM_ARENA) or SYSTEM_ARENA)


def has_members(path: Path) -> bool:
    """Does the arena at `path` hold any member record (something runs or ran there)?"""
    try:
        return any(name.endswith(".json") for name in os.listdir(path / MEMBERS))
    except OSError:
        return False

# Files in the arena are small: a member record, a ticket, a ring.  Anything
# larger was planted, and reading it would only waste memory.
MAX_SMALL_FILE = 64 * 1024


def default_base() -> Path:
    """Per-user runtime directory under which each device's arena lives."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "vramd"
    return Path(f"/dev/shm/vramd-{os.getuid()}")


def default_device_key() -> str:
    """The UUID of the device a daemon picks by default (first discrete GPU, else
    the first), so that daemons and CLI commands meet in the same arena.
    "default" when no Vulkan device can be listed."""
    try:
        from vramd.gpu.device import list_devices
        devices = list_devices()
    except Exception:
        return "default"
    if not devices:
        return "default"
    chosen = next((d for d in devices if d["type"] == "discrete"), devices[0])
    return chosen["uuid"]


def existing_arenas(base: Path | None = None) -> list[Path]:
    """Every arena under the per-user base (one per device), sorted.

    Only a base that is ours and private counts (another user could create
    /dev/shm/vramd-<our uid> first), and only arenas in it that are ours.
    """
    base = base or default_base()
    try:
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return []
        entries = sorted(base.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    out = []
    for p in entries:
        try:
            pst = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISDIR(pst.st_mode) and pst.st_uid == os.getuid() and (p / TOKEN).exists():
            out.append(p)
    return out


def resolve_arena(path: str | os.PathLike | None) -> Path:
    """--arena wins, then $VRAMD_ARENA, then the per-user default for the default device.

    Without either, the one arena that exists under the per-user base is
    used; with several (one per GPU) the user must say which.
    """
    if path:
        return Path(path)
    env = os.environ.get(ENV_ARENA)
    if env:
        return Path(env)
    found = existing_arenas()
    system = system_arena()
    if not any(has_members(p) for p in found) and has_members(system):
        # The units run (the system arena has members) and ours is empty or absent: theirs is meant.
        return system
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ArenaError(f"{default_base()}: one arena per GPU here ({', '.join(p.name for p in found)}); "
                         "pick one with --arena or VRAMD_ARENA")
    return default_base() / default_device_key()


@dataclass
class Arena:
    """An opened, checked arena directory."""

    path: Path
    shared: bool = False  # world-writable (a llama.cpp arena), accepted on request

    @property
    def token_path(self) -> Path:
        return self.path / TOKEN

    @property
    def doorbell_dir(self) -> Path:
        return self.path / DOORBELL

    @property
    def members_dir(self) -> Path:
        return self.path / MEMBERS

    @property
    def queue_dir(self) -> Path:
        return self.path / QUEUE

    @property
    def control_dir(self) -> Path:
        return self.path / CONTROL

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, *, create: bool = True,
             allow_shared: bool = False) -> "Arena":
        """Open (and by default create) the arena at `path`, refusing unsafe ones."""
        arena = Path(resolve_arena(path)).absolute()
        if create:
            _make_private_dirs(arena)
        shared = check_dir(arena, allow_shared=allow_shared, what="arena")
        # Only root can make or rename entries in a root-owned arena nobody
        # else may write (a system arena): whoever owns its subdirectories
        # (doorbell/ belongs to the daemons' user) was chosen by root.
        top = os.lstat(arena)
        root_made = top.st_uid == 0 and stat.S_ISDIR(top.st_mode) and not top.st_mode & 0o022
        for sub in (DOORBELL, MEMBERS, QUEUE, CONTROL):
            sub_path = arena / sub
            if create:
                _mkdir_like_parent(sub_path)
            if sub_path.exists() or sub_path.is_symlink():
                shared |= check_dir(sub_path, allow_shared=allow_shared, what="arena directory",
                                    owner_trusted=root_made)
            elif sub == DOORBELL:
                raise ArenaError(not_an_arena(arena, shared))
        if create:
            _create_token(arena / TOKEN)
        return cls(arena, shared)


def not_an_arena(path: Path, shared: bool) -> str:
    """Why `path` (opened without creating) is no arena, and what to do: a system arena is laid
    out by root (`vramd arena init`); a per-user one is made by the first daemon that uses it."""
    if shared:
        return (f"{path}: is world-writable (mode {stat.S_IMODE(os.lstat(path).st_mode):04o}) and holds no arena "
                "(no doorbell/): name the arena's own directory, not a shared one like /tmp")
    if path == system_arena():
        return f"{path}: no arena here yet; lay the system arena out with `sudo vramd arena init --group vramd`"
    return (f"{path}: no arena here (no doorbell/); a user arena is made by the first daemon started with "
            f"`vramd serve MODEL --arena {path}` (or `vramd exec --arena {path} -- CMD`)")


def _check_private_base(base: Path) -> None:
    """The per-user base must be ours and not writable by others (it may live in /dev/shm)."""
    st = os.lstat(base)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ArenaError(f"{base}: the per-user arena base is not a directory (remove it)")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ArenaError(f"{base}: the per-user arena base belongs to uid {st.st_uid} or is writable by others; "
                         "remove it, or choose an arena with --arena")


def check_dir(path: Path, *, allow_shared: bool, what: str, owner_trusted: bool = False) -> bool:
    """Refuse a symlink, a non-directory, or a world-writable directory.

    Returns True when the directory is world-writable and that was allowed.
    A directory of another (non-root) user is refused too, unless
    `owner_trusted` (root chose its owner: a subdirectory of a system arena).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ArenaError(f"{path}: {what} does not exist") from None
    except PermissionError:
        raise ArenaError(f"{path}: {what} is not accessible (permission denied)") from None
    followed = False
    if stat.S_ISLNK(st.st_mode):
        if not allow_shared:
            raise ArenaError(f"{path}: {what} is a symlink; refusing it (pass the real path, "
                             "or --allow-shared-arena if you trust where it points)")
        try:
            st = os.stat(path)
        except OSError:
            raise ArenaError(f"{path}: {what} is a dangling symlink") from None
        followed = True
    if not stat.S_ISDIR(st.st_mode):
        raise ArenaError(f"{path}: {what} is not a directory")
    if st.st_mode & stat.S_IWOTH:
        if not allow_shared:
            raise ArenaError(f"{path}: {what} is world-writable (mode {stat.S_IMODE(st.st_mode):04o}): "
                             "any local user could take the token; pass --allow-shared-arena "
                             "to join it anyway (e.g. a llama.cpp arena)")
        return True
    if st.st_uid not in (os.getuid(), 0) and not owner_trusted:
        # Another user's private arena: joining it would make us depend on
        # their files.  A system arena is root-owned and group-shared.
        if not allow_shared:
            raise ArenaError(f"{path}: {what} belongs to uid {st.st_uid}, not you; "
                             "pass --allow-shared-arena to join it anyway")
        return True
    return followed


def _make_private_dirs(path: Path) -> None:
    """Create the arena (and a missing default base) mode 0700."""
    if path.parent != default_base() and not os.path.isdir(path.parent):
        # Only the per-user base is made here: a typo in --arena would otherwise make a
        # second arena that coordinates with no one.
        raise ArenaError(f"{path}: the arena's parent directory {path.parent} does not exist "
                         "(a typo? an arena elsewhere coordinates with no one); create it first")
    try:
        os.makedirs(path.parent, mode=0o700, exist_ok=True)
        if path.parent == default_base():
            _check_private_base(path.parent)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except PermissionError:
        raise ArenaError(f"{path}: cannot create the arena (permission denied); "
                         "choose another with --arena or VRAMD_ARENA") from None
    except OSError as e:
        raise ArenaError(f"{path}: cannot create the arena: {e.strerror}") from None


def _mkdir_like_parent(path: Path) -> None:
    """Create a subdirectory with its arena's group and permission bits.

    A private arena gives 0700 subdirectories; a group arena made by
    `vramd arena init` already has its own, which are never changed here.
    """
    try:
        parent = os.stat(path.parent)
        os.mkdir(path, stat.S_IMODE(parent.st_mode) & 0o3777)
    except FileExistsError:
        pass
    except PermissionError:
        pass  # a read-only participant of a system arena; check_dir reports problems
    except OSError as e:
        raise ArenaError(f"{path}: cannot create: {e.strerror}") from None


def _create_token(path: Path) -> None:
    """Make sure token.lock exists as a regular file; never truncate or unlink it."""
    mode = stat.S_IMODE(os.stat(path.parent).st_mode) & 0o666
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     mode or 0o600)
    except PermissionError:
        if not path.exists():
            raise ArenaError(f"{path}: cannot create the token file (permission denied)") from None
        return
    except OSError as e:
        raise ArenaError(f"{path}: {describe_open_error(e)}") from None
    try:
        require_regular(fd, path, "token file")
    finally:
        os.close(fd)


def describe_open_error(e: OSError) -> str:
    """Turn an open() failure in the arena into words a user can act on."""
    if e.errno == errno.ELOOP:
        return "is a symlink; refusing to follow it (remove it: only vramd should create it)"
    if e.errno == errno.EISDIR:
        return "is a directory where a file was expected (remove it)"
    if e.errno == errno.ENXIO:
        return "is a FIFO or socket where a file was expected (remove it)"
    if e.errno == errno.EACCES:
        return "permission denied"
    return e.strerror or str(e)


def require_regular(fd: int, path: Path, what: str, max_size: int | None = None) -> os.stat_result:
    """fstat an opened arena file and insist it is a small regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ArenaError(f"{path}: {what} is not a regular file (remove it)")
    if max_size is not None and st.st_size > max_size:
        raise ArenaError(f"{path}: {what} is {st.st_size} bytes, more than the {max_size} allowed")
    return st


def read_small(path: Path, what: str, max_size: int = MAX_SMALL_FILE) -> bytes:
    """Read a small arena file without following links or blocking on FIFOs."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        require_regular(fd, path, what, max_size)
        return os.read(fd, max_size + 1)[:max_size]
    finally:
        os.close(fd)


def doorbell_owner(user: str | int | None, group: str) -> tuple[int, str]:
    """(uid, name) of the user who is to own a system arena's doorbell/.

    The daemons' user: in the sticky doorbell/ only a file's owner and the
    directory's owner may remove a file, so a ring file another user left
    under a daemon's pid (on purpose with `vramd ring --pid`, or a shell that
    rang and exited, its pid later reused) can be removed by the daemons only
    when they own the directory.  Default: the user named like `group` (the
    packaged layout: user and group `vramd`), else root.
    """
    if user is None:
        try:
            pw = pwd.getpwnam(group)
        except KeyError:
            return 0, "root"
        return pw.pw_uid, pw.pw_name
    if isinstance(user, int) or str(user).isdigit():
        uid = int(user)
        try:
            return uid, pwd.getpwuid(uid).pw_name
        except KeyError:
            return uid, str(uid)
    try:
        return pwd.getpwnam(user).pw_uid, str(user)
    except KeyError:
        raise ArenaError(f"user {user!r} does not exist (create it with useradd, or systemd-sysusers)") from None


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def init_system_arena(path: Path, group: str, ring_group: str | None, user: str | int | None = None) -> Arena:
    """Lay out a group-shared arena (brief §9): daemons take the token, ringers only ring.

        d <arena>            0755 root root
        f <arena>/token.lock 0660 root <group>
        d <arena>/members    2770 root <group>
        d <arena>/queue      2770 root <group>
        d <arena>/control    2770 root <group>
        d <arena>/doorbell   1770 <user> <ring_group or group>

    `user` (see doorbell_owner) owns doorbell/, so that the daemons may
    remove any ring file in it; nobody else removes another's ring (sticky).
    """
    try:
        gid = grp.getgrnam(group).gr_gid
        ring_gid = grp.getgrnam(ring_group).gr_gid if ring_group else gid
    except KeyError:
        flag, missing = next((f, g) for f, g in (("--group", group), ("--ring-group", ring_group))
                             if g and not _group_exists(g))
        raise UsageError(f"{flag} {missing}: no such group (create it with groupadd, or systemd-sysusers)") from None
    bell_uid, _name = doorbell_owner(user, group)
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
        check_dir(path, allow_shared=False, what="arena")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
        _make_group_dir(path / MEMBERS, gid, 0o2770)
        _make_group_dir(path / QUEUE, gid, 0o2770)
        _make_group_dir(path / CONTROL, gid, 0o2770)
        _make_group_dir(path / DOORBELL, ring_gid, 0o1770, uid=bell_uid)
        token = path / TOKEN
        fd = os.open(token, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o660)
        try:
            require_regular(fd, token, "token file")
            os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o660)
        finally:
            os.close(fd)
    except PermissionError as e:
        raise ArenaError(f"{e.filename or path}: permission denied (run `vramd arena init` as root)") from None
    except OSError as e:
        raise ArenaError(f"{e.filename or path}: {describe_open_error(e)}") from None
    return Arena(path)


def _make_group_dir(path: Path, gid: int, mode: int, uid: int = 0) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    # Change the directory through an fd opened without following links, so
    # nothing swapped in after the check gets root's chown and chmod.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ArenaError(f"{path}: exists and is not a directory (remove it)") from None
        raise
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)  # mkdir's mode is filtered by umask; chmod is not
    finally:
        os.close(fd)

"""The member registry: `members/<pid>.json`, one record per vramd participant.

A member writes its own record on every state change, atomically (a temp file
in the same directory, then rename), so a reader sees the old or the new
record, never half of one.  Records carry the process start time: a record
whose pid died, or now belongs to another process, is stale and is removed by
whoever notices.  Readers never trust a record's size or shape: it is capped,
parsed as JSON, and type-checked field by field.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from vramd.arena.layout import read_small
from vramd.errors import ArenaError, VramdError

STATES = ("cold", "warming", "warm", "cooling", "parked")
KINDS = ("weights", "state", "encoder", "scratch")
PRIORITY_SECONDS = 60.0


def empty_breakdown() -> dict[str, dict[str, int]]:
    return {kind: {"device": 0, "host": 0} for kind in KINDS}


def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


@dataclass
class Member:
    """What one participant tells its peers and `vramd status` about itself."""

    name: str
    pid: int
    start_time: float          # process create time: detects pid reuse
    model: str = ""
    state: str = "cold"
    since: float = field(default_factory=time.time)   # wall time of the last state change
    switches: int = 0          # times it went warm
    yields: int = 0            # times it went cold because a peer asked
    bytes_h2d: int = 0         # host -> device bytes moved, all switches
    bytes_d2h: int = 0
    last_switch_ms: float | None = None
    breakdown: dict = field(default_factory=empty_breakdown)
    wants_bytes: int = 0       # device bytes it needs to go warm (set while warming)
    freeing_bytes: int = 0     # device bytes it released that its core is still handing back to the driver
    last_used: float = 0.0     # wall time it last held the token: the LRU key
    pinned: bool = False       # never evicted by vramd peers while parked
    priority: int = 0          # each point counts as PRIORITY_SECONDS of recency
    budget: int = 0            # device bytes the arena's members may hold together, as it sees it
    endpoint: str = ""         # http://host:port of a daemon's API, if any
    control: str = ""          # path of a daemon's control socket, if any
    aliases: list = field(default_factory=list)   # a daemon's --alias names (its /v1/models entries beside its name)
    failpoints: str = ""       # VRAMD_FAILPOINTS armed in it ("NAME=ACTION@N,..."): fault injection, tests only

    def eviction_key(self) -> float:
        """Smaller is evicted first: least recently used, shifted by priority.

        A priority point counts as PRIORITY_SECONDS of recency, and it ages
        like any other recency: a high-priority model left unused long
        enough becomes the first to go, so no model is starved for ever.
        """
        return self.last_used + self.priority * PRIORITY_SECONDS

    def device_bytes(self) -> int:
        return sum(v.get("device", 0) for v in self.breakdown.values())

    def host_bytes(self) -> int:
        return sum(v.get("host", 0) for v in self.breakdown.values())

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> "Member":
        if not isinstance(data, dict):
            raise ValueError("not an object")
        m = cls(name=_str(data, "name"), pid=_int(data, "pid"), start_time=_num(data, "start_time"))
        m.model = _str(data, "model", "")
        m.state = _str(data, "state", "cold")
        if m.state not in STATES:
            raise ValueError(f"unknown state {m.state!r}")
        m.since = _num(data, "since", 0.0)
        m.switches = _int(data, "switches", 0)
        m.yields = _int(data, "yields", 0)
        m.bytes_h2d = _int(data, "bytes_h2d", 0)
        m.bytes_d2h = _int(data, "bytes_d2h", 0)
        last = data.get("last_switch_ms")
        m.last_switch_ms = float(last) if isinstance(last, (int, float)) else None
        m.breakdown = _breakdown(data.get("breakdown", {}))
        m.wants_bytes = _int(data, "wants_bytes", 0)
        m.freeing_bytes = _int(data, "freeing_bytes", 0)
        m.last_used = _num(data, "last_used", 0.0)
        pinned = data.get("pinned", False)
        if not isinstance(pinned, bool):
            raise ValueError("pinned is not a boolean")
        m.pinned = pinned
        m.priority = _int(data, "priority", 0)
        m.budget = _int(data, "budget", 0)
        m.endpoint = _str(data, "endpoint", "")
        m.control = _str(data, "control", "")
        m.aliases = _strs(data, "aliases")   # absent in records of daemons from before it: none
        m.failpoints = _str(data, "failpoints", "")
        return m


def _str(d: dict, key: str, default: str | None = None) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise ValueError(f"{key} is not a string")
    return v


def _strs(d: dict, key: str) -> list[str]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{key} is not a list of strings")
    return list(v)


def _int(d: dict, key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{key} is not an integer")
    return v


def _num(d: dict, key: str, default: float | None = None) -> float:
    v = d.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"{key} is not a number")
    return float(v)


def _breakdown(raw: object) -> dict:
    out = empty_breakdown()
    if not isinstance(raw, dict):
        raise ValueError("breakdown is not an object")
    for kind, v in raw.items():
        if kind in out and isinstance(v, dict):
            out[kind] = {"device": _int(v, "device", 0), "host": _int(v, "host", 0)}
    return out


class Registry:
    """The members/ directory of one arena."""

    def __init__(self, members_dir: Path):
        self.dir = Path(members_dir)

    def path_for(self, pid: int) -> Path:
        return self.dir / f"{pid}.json"

    def write(self, member: Member) -> None:
        """Publish `member` atomically (a fresh temp file, then rename).

        The temp name is new each time and created O_EXCL|O_NOFOLLOW|O_NONBLOCK,
        so neither a concurrent writer nor a planted FIFO or symlink can make
        us write into, or block on, anything but our own new file.
        """
        data = json.dumps(member.to_json(), separators=(",", ":")).encode()
        tmp = self.dir / f".{member.pid}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o640)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, self.path_for(member.pid))
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise ArenaError(f"{self.dir}: cannot write member record: {e.strerror}") from None

    def remove(self, pid: int) -> None:
        """Our record, and any temp file a killed writer of ours left behind."""
        try:
            leftovers = [n for n in os.listdir(self.dir) if n.startswith(f".{pid}.") and n.endswith(".tmp")]
        except OSError:
            leftovers = []
        for path in [self.path_for(pid)] + [self.dir / n for n in leftovers]:
            try:
                os.unlink(path)
            except OSError:
                pass

    def read(self, pid: int) -> Member | None:
        try:
            raw = read_small(self.path_for(pid), "member record")
            return Member.from_json(json.loads(raw))
        except (OSError, ValueError, VramdError):
            return None

    def list(self, *, clean: bool = True) -> list[Member]:
        """Live members, by pid.  Stale or malformed records are skipped (and removed if `clean`)."""
        try:
            names = os.listdir(self.dir)
        except (FileNotFoundError, PermissionError):
            return []  # no arena yet, or not in its group: no members to show
        members = []
        for name in names:
            if not name.endswith(".json") or not name[:-5].isdigit():
                continue
            pid = int(name[:-5])
            member = self.read(pid)
            started = process_start_time(pid)
            live = member is not None and member.pid == pid and started is not None \
                and abs(started - member.start_time) < 1.0
            if not live:
                if clean and (started is None or member is not None):
                    self.remove(pid)
                continue
            members.append(member)
        members.sort(key=lambda m: m.pid)
        return members

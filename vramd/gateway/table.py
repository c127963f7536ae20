"""The gateway's routing table: which member serves a model name, where, and in what state.

Built from the arena's member records (members/<pid>.json, vramd/arena/members.py),
re-read at most every REFRESH_S seconds and at once when a name is not found,
so daemons that start or stop while the gateway runs are seen without a
restart.  A request's `model` may be, first to last: an alias of the
gateway's configuration, a member's name, an alias of a member's own (its
`--alias`, in its record), its model file's name (unless two members serve
files of that name), and any of these with Ollama's `:latest` tag.  `named()`
is the model list: each member, then its own aliases, then the gateway's,
each name once, as the daemons' /v1/models lists an alias as its own entry.

A member that went away (its process died: the record is stale, or it was
seen before and its record is gone) is remembered by name: a request for it
is a 503 that says so, not a 404 as if the name were wrong.

States are the records' own, in the words of the gateway's /v1/models:
warm (holds the GPU, or is giving it back), parked (cold, its buffers still on
the device), cold, loading (warming: taking the GPU and uploading, the first
time or after a switch).  The record has no state for a daemon that holds the
GPU but is still building its engine at start: that short while shows as warm,
and a request sent then waits in the daemon's listen queue until it serves.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from vramd.arena.members import Member, Registry
from vramd.errors import VramdError

REFRESH_S = 0.5
STATES = {"warm": "warm", "cooling": "warm", "parked": "parked", "cold": "cold", "warming": "loading"}


class UnknownModel(VramdError):
    http_status = 404


class MemberGone(VramdError):
    http_status = 503


class Ambiguous(VramdError):
    http_status = 400


@dataclass(frozen=True)
class Target:
    """A live member as a request sees it."""

    name: str
    pid: int
    model: str          # the model file's name
    endpoint: str
    state: str          # warm, parked, cold, loading
    since: float        # wall time of its last state change
    started: float      # its process's start time
    device_bytes: int
    weights_bytes: int  # the weights' bytes, on the device or in the host shadow
    control: str = ""   # its control socket's path (keep_alive 0: vramd/gateway/residency.py)
    aliases: tuple[str, ...] = ()   # its own --alias names

    @classmethod
    def of(cls, m: Member) -> "Target":
        w = m.breakdown["weights"]
        return cls(m.name, m.pid, m.model, m.endpoint, STATES.get(m.state, m.state), m.since,
                   m.start_time, m.device_bytes(), max(w["device"], w["host"]), m.control,
                   tuple(a for a in m.aliases if a != m.name))


@dataclass(frozen=True)
class Gone:
    name: str
    pid: int
    model: str
    endpoint: str
    seen: float         # wall time the gateway last saw it live (or its record's last change)
    aliases: tuple[str, ...] = ()


class Table:
    def __init__(self, members_dir: Path, aliases: dict[str, str] | None = None, refresh_s: float = REFRESH_S):
        self.registry = Registry(members_dir)
        self.aliases = dict(aliases or {})
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._read_at = -1e9
        self._live: dict[str, Target] = {}
        self._gone: dict[str, Gone] = {}

    # -- reading the arena ------------------------------------------------------

    def _refresh(self) -> None:
        live = {m.name: Target.of(m) for m in self.registry.list(clean=False) if m.endpoint}
        now = time.time()
        for name, t in self._live.items():
            if name not in live:
                self._gone[name] = Gone(t.name, t.pid, t.model, t.endpoint, now, t.aliases)
        for pid, m in self._stale_records(live):
            if m.name not in live and m.endpoint:
                self._gone.setdefault(m.name, Gone(m.name, pid, m.model, m.endpoint, m.since, tuple(m.aliases)))
        for name in live:
            self._gone.pop(name, None)
        self._live = live

    def _stale_records(self, live: dict[str, Target]):
        """Records left by members that died without removing them (SIGKILL, a crash)."""
        pids = {t.pid for t in live.values()}
        try:
            names = os.listdir(self.registry.dir)
        except OSError:
            return
        for n in names:
            if n.endswith(".json") and n[:-5].isdigit() and int(n[:-5]) not in pids:
                m = self.registry.read(int(n[:-5]))
                if m is not None:
                    yield m.pid, m

    def members(self, fresh: bool = False) -> list[Target]:
        """The live members, by name; re-read if the last reading is older than refresh_s."""
        with self._lock:
            if fresh or time.monotonic() - self._read_at > self.refresh_s:
                self._refresh()
                self._read_at = time.monotonic()
            return sorted(self._live.values(), key=lambda t: t.name)

    # -- names --------------------------------------------------------------------

    @staticmethod
    def _by(members: list[Target], names) -> dict[str, list[Target]]:
        """name -> the members `names(t)` gives it for (a member's own name excluded)."""
        out: dict[str, list[Target]] = {}
        for t in members:
            for n in names(t):
                if n and n != t.name:
                    out.setdefault(n, []).append(t)
        return out

    def _by_alias(self, members: list[Target]) -> dict[str, list[Target]]:
        return self._by(members, lambda t: t.aliases)

    def _by_file(self, members: list[Target]) -> dict[str, list[Target]]:
        return self._by(members, lambda t: (t.model,))

    def known(self, members: list[Target] | None = None) -> list[str]:
        """Every name a request may use: members, their aliases, their unique file names, the gateway's aliases."""
        members = self.members() if members is None else members
        names = {t.name for t in members}
        names |= {a for a, ts in self._by_alias(members).items() if len(ts) == 1}
        names |= {f for f, ts in self._by_file(members).items() if len(ts) == 1}
        names |= set(self.aliases)
        return sorted(names)

    def named(self) -> list[tuple[str, Target, bool]]:
        """The model list, read fresh: (name, member, is an alias) for each member, then each of its own
        aliases (but one that several members claim: no route), then each of the gateway's whose member
        runs; every name once."""
        members = self.members(fresh=True)
        out = [(t.name, t, False) for t in members]
        seen = {t.name for t in members}
        claimed = self._by_alias(members)
        for t in members:
            for a in t.aliases:
                if a not in seen and len(claimed[a]) == 1:
                    seen.add(a)
                    out.append((a, t, True))
        for alias in sorted(self.aliases):
            if alias in seen:
                continue
            try:
                t = self.resolve(alias)
            except VramdError:
                continue   # its member is not running: the alias has nowhere to go
            seen.add(alias)
            out.append((alias, t, True))
        return out

    def resolve(self, model: str) -> Target:
        """The live member `model` names; UnknownModel, MemberGone or Ambiguous if none."""
        found = self._lookup(model, self.members())
        if not isinstance(found, Target):   # a member that started a moment ago: look again before saying no
            found = self._lookup(model, self.members(fresh=True))
        if isinstance(found, Target):
            return found
        name = found if isinstance(found, str) else model
        with self._lock:
            gone = self._gone.get(name) or next((g for g in self._gone.values()
                                                 if name == g.model or name in g.aliases), None)
        if gone is not None:
            raise MemberGone(f"the model '{model}' is served by member '{gone.name}' (pid {gone.pid}, "
                             f"{gone.endpoint}), which is not running: its process exited or was killed "
                             f"(restart it: `systemctl restart vramd@{gone.name}` under systemd)")
        known = self.known()
        raise UnknownModel(f"the model '{model}' does not exist here; known models: "
                           f"{', '.join(known) if known else 'none (no daemon runs in this arena)'}")

    def _lookup(self, model: str, members: list[Target]):
        """A Target; or the name an alias points to (not live); or None."""
        by_name = {t.name: t for t in members}
        for candidate in (model, model.removesuffix(":latest")):
            target = self.aliases.get(candidate, candidate)
            if target in by_name:
                return by_name[target]
            for what, by in (("an alias", self._by_alias), ("the file", self._by_file)):
                ts = by(members).get(target, [])
                if len(ts) == 1:
                    return ts[0]
                if len(ts) > 1:
                    raise Ambiguous(f"the model '{model}' is {what} of several members "
                                    f"({', '.join(t.name for t in ts)}): name one of them")
            if candidate in self.aliases:
                return target
        return None

    def aliases_of(self, t: Target) -> list[str]:
        """The member's own aliases, then the gateway's that name it (by its name, file or own alias)."""
        own = list(t.aliases)
        return own + sorted(a for a, to in self.aliases.items()
                            if to in (t.name, t.model, *t.aliases) and a not in own)

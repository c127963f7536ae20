"""The residency policy: what a daemon may hold on the device, what it asks its peers to give up, and when it refuses.

Owns: `Room`, for one daemon (its model's regions in a residency core): the
arena's budget and what going warm needs, the checks before a restore (within
reach of the device at all, within the budget, free on the device as the
driver sees it) and the refusal with nothing lost, the eviction order of the
parked peers (least recently used, shifted by priority, pinned and the holder
never), making room by asking them in that order only until the shortfall is
covered (with the token held only while a peer answers within QUICK_ASK: see
"Asking, quickly with the token" below),
emptying them for a foreign
(flock-only) peer, our own eviction (encoder, scratch, state, weights) when
the holder asks, what going cold releases, and waiting out memory that
members released and are still freeing.

Its inputs are explicit so that it runs without a daemon: the residency core
and the model's regions, the budget, the other members' records, the token
(holders, waiters), a look at device memory, a callable that sends a control
request to a peer, a clock.  The daemon (daemon.py) holds its lock around the
calls and keeps the threads, the token and the member record.

Asking peers to evict is vramd/server/asking.py's (Asking, which Room is): with
the token held while a peer answers within QUICK_ASK, a StepAside for one that
does not.  The one request sent holding the token for as long as it takes is on
purpose: a holder going cold for a flock-only peer empties the parked members
first (empty_parked_peers), as that peer expects an empty GPU the moment it has
the token, and comes next.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from vramd.arena.members import KINDS
from vramd.errors import OutOfDeviceMemory, PeerError, VramdError
from vramd.server.asking import EVICT_WAIT, QUICK_ASK, Asking, ask_over_socket  # noqa: F401 (re-exported)

log = logging.getLogger("vramd.daemon")

# A restore that the device memory does not hold is looked at again this many times, 0.1 s apart:
# a driver's budget may lag the frees parked peers just made for us.
ROOM_CHECKS = 5
# A restore waits at most this long for device memory that members released and whose residency
# core is still handing it back to the driver (their records' `freeing_bytes`; 16 GiB take ~110 ms
# on the H200), looking every FREEING_POLL s.  A member whose frees take longer is counted out.
FREEING_WAIT = 5.0
FREEING_POLL = 0.02
# What our own eviction gives up first: what is cheapest to bring back (no copy) goes first.
EVICTION_KINDS = ("encoder", "scratch", "state", "weights")


class Room(Asking):
    """The residency policy of one daemon.

    residency: its core (vramd.gpu.residency.Residency); regions: the model's regions in it
    (weights, KV, scratch: what going warm brings; the encoder's come and go on their own);
    budget: device bytes the arena's members may hold together; members(): the other
    members' records (vramd.arena.members.Member), is_member(pid): is that pid one;
    token: holders() and waiters() of the arena's token; sample(): a look at device memory
    (vramd.gpu.memview: "free", "bound", "outside_arena"); ask(peer, cmd, wait, **args): a
    control request to a peer, answered within `wait` s; metrics:
    vramd.server.metrics.Metrics; clock and sleep: time's (the deadlines given to the asking
    are the clock's)."""

    def __init__(self, name: str, residency, regions, budget: int, *, members: Callable[[], list],
                 is_member: Callable[[int], bool], token, sample: Callable[[], dict],
                 ask: Callable[..., dict] = ask_over_socket, metrics=None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 quick_ask: float = QUICK_ASK):
        self.name, self.residency, self.regions, self.budget = name, residency, regions, budget
        self.members, self.is_member, self.token, self.sample = members, is_member, token, sample
        self.ask_peer, self.quick_ask = ask, quick_ask
        self.metrics, self.clock, self.sleep = metrics, clock, sleep
        self.begin()

    def begin(self) -> None:
        """A new warm-up: every parked peer may be asked again (each at most once per warm-up)."""
        self.asked: dict[int, str] = {}   # pid -> what came of asking it ("b released 4096 B", ...)
        self.freed = 0                    # bytes the peers asked in this warm-up said they freed
        self._answered: set[int] = set()  # the peers asked that answered, releasing something
        self.steps = 0                    # steps aside in this warm-up
        self.rounds = 0                   # rounds of asking in this warm-up (ask())
        self._settled = 0.0               # until then the driver's free figure may lag their frees

    def _count_failure(self) -> None:
        if self.metrics is not None:
            self.metrics.count("restore_failures")

    # -- bytes ---------------------------------------------------------------------

    def device_total(self) -> int:
        return sum(v["device"] for v in self.residency.breakdown().values())

    def needed_bytes(self, kinds=("weights", "state", "scratch")) -> int:
        """Device bytes going warm will add (scratch included: it comes with the first compute)."""
        need = 0
        for region in self.regions:
            info = region.info()
            if info["kind"] in kinds and not info["resident"]:
                need += info["bytes"]
        return need

    def others_device_bytes(self) -> int:
        return sum(m.device_bytes() for m in self.members())

    def free_bytes(self) -> int:
        """The budget less what every member holds (the arena's accounting)."""
        return self.budget - self.others_device_bytes() - self.device_total()

    def freeing_bytes(self) -> int:
        """Device bytes we released that the core is still handing back to the driver."""
        return self.residency.stats()["reclaim_pending_bytes"]

    # -- going warm ------------------------------------------------------------------

    def check_within_reach(self, need: int) -> None:
        """Before ringing (cold): refuse at once a restore that would not fit even if every
        member gave up all its device memory, so a holder is not made to yield (and parked
        peers to evict) for a restore that is then refused anyway."""
        from vramd.gpu.memview import mib
        for attempt in range(ROOM_CHECKS):
            try:
                report = self.sample()
            except Exception as e:  # no look: the restore's own checks decide
                log.warning("%s: looking at device memory failed: %s", self.name, e)
                return
            members = sum(m.device_bytes() + m.freeing_bytes for m in self.members())
            if report["free"] + members >= need:
                return
            if attempt + 1 < ROOM_CHECKS:
                self.sleep(0.1)
        self.refuse(report, need, f"; the vramd members hold {mib(members)}, not enough to make room "
                                  "if they all gave it up, so none was asked to")

    def prepare_restore(self) -> None:
        """With the token, before our restore: the budget, the device memory, then room made by
        parked peers.  Either residency mode: --residency says what *we* keep when we yield;
        what parked peers hold is theirs to give up for our need.  Each check refuses before it
        asks anyone for anything (and before we allocate) when even that would not make room.
        Then the core is capped to what the budget leaves us."""
        before = self.device_total()
        need = self.needed_bytes()
        if need:
            self.check_budget(self.needed_bytes(("weights", "state")))
            self.check_device_memory(need)   # the device as the driver sees it
            self.make_room(need)             # the arena's budget (--vram-budget)
        room = self.budget - self.others_device_bytes()
        if room <= before:
            raise OutOfDeviceMemory(f"{self.name}: the device budget ({self.budget} B) is used up by "
                                    "other members' resident buffers")
        self.residency.set_device_limit(room)

    def check_budget(self, need: int) -> None:
        """The arena's budget: refuse, before any parked peer is asked to evict, a restore (of
        `need` bytes: weights and state) that would not fit even if every peer that may be
        asked gave up all it holds."""
        evictable = sum(m.device_bytes() for m in self.askable())
        if self.free_bytes() + evictable < need:
            self._count_failure()
            raise OutOfDeviceMemory(f"{self.name}: the device budget ({self.budget} B) is used up by "
                                    "other members' resident buffers that may not be evicted "
                                    f"({need} B needed, {self.free_bytes()} B free, {evictable} B evictable)"
                                    + self._asked_text())

    def check_device_memory(self, need: int) -> None:
        """Before a restore (token held, nothing of ours touched): have `need` bytes free on
        the device as the driver sees it, or refuse (cold, nothing lost, a 503).

        Memory a member released and is still freeing comes back by itself: wait
        for it (at most FREEING_WAIT s).  A shortfall that parked peers can cover
        (memory outside the arena, which the budget's accounting does not see) is
        asked of them in eviction order, need - free (ask(): quickly with the
        token, a StepAside for a slow one), then looked at again.  When even that
        cannot make room, refuse before asking anyone for anything."""
        deadline = self.clock() + FREEING_WAIT
        short = 0
        while True:
            report = self.sample()
            free = report["free"]
            if free >= need:
                return
            now = self.clock()
            freeing = sum(m.freeing_bytes for m in self.members()) if now < deadline else 0
            if free + freeing >= need:
                self.sleep(FREEING_POLL)   # on its way back to the driver
                continue
            # The driver's figure may rise by less than a peer released by its own count (freed
            # memory a driver or allocator keeps a while): askable() lets a peer that answered be
            # asked again for what is still short.
            peers = self.askable()
            if peers and free + freeing + sum(m.device_bytes() for m in peers) >= need:
                if now < self._settled:   # the driver's figure may still lag the last evictions
                    self.sleep(0.1)
                    continue
                self.ask(peers, need - free - freeing, why="the device has too little free")
                continue                  # looked at again: what they freed, with the token held
            short += 1   # the driver's figure may lag frees just made (a peer's eviction drains first)
            if short >= ROOM_CHECKS:
                break
            self.sleep(0.1)
        from vramd.gpu.memview import mib
        still = sum(m.freeing_bytes for m in self.members())
        self.refuse(report, need, (f"; {mib(still)} released by vramd members are still being freed "
                                   f"after {FREEING_WAIT:g} s" if still else "") + self._asked_text())

    def refuse(self, report: dict, need: int, detail: str = "") -> None:
        """The restore is refused: cold, nothing lost, one line that says why."""
        from vramd.gpu.memview import mib
        self._count_failure()
        msg = (f"{self.name}: not restored: the device has {mib(report['free'])} free and {mib(need)} are needed "
               f"({report['bound']}){detail}")
        if report["outside_arena"]:
            msg += (f"; {mib(report['outside_arena'])} are held outside the arena "
                    "by processes that are not vramd members")
        log.warning("%s", msg)
        raise OutOfDeviceMemory(msg + "; the model stays cold with nothing lost: retry when the memory is back")

    # -- the peers ---------------------------------------------------------------------

    def eviction_order(self) -> list:
        """Peers whose buffers may go to make room: not the holder, not pinned,
        least recently used (shifted by priority) first."""
        holders = set(self.token.holders())
        candidates = [m for m in self.members() if m.control and m.device_bytes() > 0 and not m.pinned
                      and m.pid not in holders and m.state in ("parked", "cold", "warming")]
        return sorted(candidates, key=lambda m: m.eviction_key())

    def askable(self) -> list:
        """The eviction order less the peers asked in this warm-up that did not answer, releasing.
        One that did may be asked again, in the first ROOM_CHECKS rounds of asking: what it gave
        up may have been taken by whoever had the token while we stepped aside, or the device's
        own figure may show less than it released.  One that timed out, was stopped or refused
        (or is still being waited for) is not asked again."""
        again = self.rounds < ROOM_CHECKS
        return [m for m in self.eviction_order() if m.pid not in self.asked or (again and m.pid in self._answered)]

    def make_room(self, need: int, refuse: bool = True) -> None:
        """`need` bytes free by the budget's accounting, else parked peers asked, in eviction
        order, until they are (ask()).  Still short once the peers asked have nothing more to
        give: refused (an OutOfDeviceMemory naming who was asked), or with `refuse` False left
        to the caller (`vramd exec --vram` warns and runs).  Short with nobody asked at all (no
        parked peer): left to the core's device limit, as it was before (a budget below one
        model's whole need serves: test_daemons.py::test_vram_budget_smaller_than_both_forces_real_switches)."""
        while True:
            shortfall = need - self.free_bytes()
            if shortfall <= 0:
                return
            peers = self.askable()
            if not peers:
                break
            self.ask(peers, shortfall, lambda: need - self.free_bytes(), why="the budget is short")
        if refuse and self.asked:
            self._count_failure()
            raise OutOfDeviceMemory(f"{self.name}: the device budget ({self.budget} B) is {shortfall} B short "
                                    f"of the {need} B going warm needs, and no parked peer is left to ask"
                                    + self._asked_text())

    def make_room_counted(self, need: int) -> None:
        """make_room without a budget to count by (a `vramd exec --vram` beside no daemon): the
        parked peers are asked until they said they freed `need` bytes in this warm-up."""
        while self.freed < need:
            peers = self.askable()
            if not peers:
                return
            self.ask(peers, need - self.freed, lambda: need - self.freed, why="asked for --vram")

    def empty_parked_peers(self) -> None:
        """A flock-only peer comes next and expects an empty GPU: every parked member releases."""
        for m in self.members():
            if m.control and m.device_bytes() > 0:
                try:
                    self.ask_peer(m, "evict", wait=EVICT_WAIT, everything=True)
                except VramdError as e:
                    log.warning("%s: could not empty %s: %s", self.name, m.name, e)

    def foreign_peer_waits(self, me: int) -> bool:
        """Is a process that is not a vramd member (nor us, pid `me`) blocked on the token?"""
        return any(pid != me and not self.is_member(pid) for pid in self.token.waiters())

    def foreign_ring(self, pids) -> bool:
        """A ring while we park: does it come from a non-member, with something of ours on the device?"""
        return bool(self.device_total()) and any(not self.is_member(pid) for pid in pids)

    # -- going cold ------------------------------------------------------------------

    def should_evict_state(self, policy: str, incoming_need: int | None, stopping: bool) -> bool:
        """--evict-state: copy the KV cache out when going cold?  auto: only if the next holder
        needs its room (or someone waits whose need is not known, or we stop)."""
        if policy != "auto" or not self._kv():
            return policy == "always"
        if incoming_need is None:
            return bool(self.token.waiters()) or stopping
        kv_device = self.residency.breakdown()["state"]["device"]
        free_after = self.budget - self.others_device_bytes() - kv_device
        return free_after < incoming_need

    def release(self, *, everything: bool, exclusive: bool, evict_state: str, foreign_next: bool,
                incoming_need: int | None, stopping: bool) -> int:
        """Going cold.  Exclusive mode (and idle sleep, shutdown, a flock-only peer next:
        `everything`) frees the device buffers; cache mode parks them.  Returns the state
        bytes copied back to the host."""
        state_before = self.residency.breakdown()["state"]["device"]
        if everything or exclusive:
            evict = everything or self.should_evict_state(evict_state, incoming_need, stopping)
            self._set_kv_evict(evict)
            self.residency.release(list(KINDS))
            if foreign_next:
                self.empty_parked_peers()
            if evict or foreign_next or incoming_need is None:
                # Someone who needs the room (or a foreign peer expecting an
                # empty GPU) comes next: be sure the driver has the memory back.
                self.residency.drain()
        elif evict_state == "always" and self._kv():
            self._set_kv_evict(True)
            self.residency.release(["state"])
        return state_before - self.residency.breakdown()["state"]["device"]

    def evict(self, nbytes: int = 0, everything: bool = False, holds_token: bool = False) -> int:
        """Release parked buffers for the token holder: encoder, scratch, then state, then
        weights, until `nbytes` are freed (or all of them).  Never while we hold the token."""
        if holds_token:
            raise PeerError(f"{self.name} holds the token; it is never asked to evict")
        breakdown = self.residency.breakdown()
        freed = 0
        for kind in EVICTION_KINDS:
            if freed >= nbytes and not everything:
                break
            on_device = breakdown[kind]["device"]
            if not on_device:
                continue
            if kind == "state":
                self._set_kv_evict(True)  # an evicted KV cache is copied to the host, never lost
            self.residency.release([kind])
            freed += on_device
        if freed:
            self.residency.drain()  # the holder allocates next: the memory must be back
            if self.metrics is not None:
                self.metrics.observe_eviction(freed)
        return freed

    def settle_frees(self, holds_token: bool, published_freeing: int) -> bool:
        """Cold after a release that did not drain (the next holder's need fit by the arena's
        accounting): our record said `published_freeing` bytes were still being freed; wait
        until they are back with the driver.  True if the record must say so now."""
        if holds_token or not published_freeing:
            return False
        self.residency.drain()
        return True

    def _kv(self) -> list:
        return [r for r in self.regions if r.kind == "state"]

    def _set_kv_evict(self, evict: bool) -> None:
        for r in self._kv():
            r.evict = evict

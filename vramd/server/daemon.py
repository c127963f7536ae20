"""`vramd serve`: one model, resident on the GPU only while it serves.

Threads and what each may touch:

    main      signals (handlers only queue), then shutdown
    loop      everything that touches the GPU or changes state: jobs run here
              one at a time, so a yield can only happen between them
    warden    (the Participant's) sets a flag when a peer rings, pokes the loop
    control   the Unix control socket: turns requests into jobs, waits
    http      /health, /vramd/status, /metrics: reads only; a generation request
              is validated and tokenized here (prompts.py), then queued
    guard     (guard.py) the token's inode and the arena every 100 ms, and
              systemd's watchdog while the loop's heartbeat moves

Life: validate and read the model into host shadows -> take the token (ring,
queue, flock) -> upload -> READY=1 -> serve jobs; at each idle point honour a
peer's ring (after the quantum) or the idle-sleep timeout by going cold
(weights and scratch freed, the KV cache kept on the device unless the
eviction policy or the incoming peer's need says otherwise); a job that
needs the GPU while cold goes warm first.  What to keep, what to ask of
parked peers and when to refuse is vramd/server/room.py's (`Room`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from vramd.arena.arbiter import WARDEN_JOIN, Participant
from vramd.arena.layout import Arena, default_base
from vramd.arena.members import Registry
from vramd.errors import (Interrupted, ModelError, OutOfDeviceMemory, PeerError, ShuttingDown, Timeout,
                           TokenError, UsageError, VramdError)
from vramd.server import systemd
from vramd.server.config import ServeConfig
from vramd.server.control import ControlServer
from vramd.server.guard import JOIN_WAIT, Guard
from vramd.server import embeddings, openai_api, prompts
from vramd.server.jobs import DEFAULT_WAKE_TIMEOUT, Job
from vramd.server.http import OPEN_PATHS, ClientGone, Exchange, HttpServer, json_route
from vramd.server.logs import LoadProgress, event
from vramd.server.metrics import Metrics
from vramd.server.room import Room
from vramd.server.hostcache import HostCache
from vramd.server.slots import DEFAULT_PARALLEL, Slots
from vramd.server.generating import BatchSession, Run

log = logging.getLogger("vramd.daemon")

# While holding the token, device memory is looked at this often for foreign users (memview.ForeignWatch).
VRAM_WATCH_INTERVAL = 5.0
# A status or /metrics call waits at most this long for the daemon's lock to look at device memory
# (never in the middle of our own restore or release); past it, it shows the last look.
SAMPLE_LOCK_WAIT = 0.5
# Stopping (SIGTERM): queued work fails at once and the generation in flight ends at its next
# step, so the loop is done in well under a second; it is waited for at most STOP_GRACE s in all
# (one deadline), the replies in flight at most REPLY_GRACE s more, then the guard and the warden
# threads are joined (at most guard.JOIN_WAIT and arbiter.WARDEN_JOIN s) and the buffers released
# (a KV cache copied to the host when it must be).  STOP_BOUND is that path less the release;
# systemd/vramd@.service's TimeoutStopSec= leaves room for the release on top of it
# (tests/server/test_systemd.py holds the two together).
STOP_GRACE = 10.0
REPLY_GRACE = 2.0
STOP_BOUND = STOP_GRACE + REPLY_GRACE + JOIN_WAIT + WARDEN_JOIN
# A second SIGTERM/SIGINT while stopping: exit at once with 128 + the signal's number.
# A non-streamed request's connection is looked at this often for a client that hung up.
CLIENT_CHECK = 0.1
# A stream that has nothing to send (waiting for the GPU, a long prefill) sends an SSE comment this often.
STREAM_KEEPALIVE = 2.0
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})


@dataclass
class _Choice:
    """One choice of a generation request: its builder, its prompt's request, its sampling
    (the choice's seed), its prompt's ids (None: made on the loop, an image prompt)."""
    builder: Any
    req: Any
    sampling: Any
    ids: list[int] | None


# Below this address-space limit (RLIMIT_AS, `ulimit -v`) Vulkan drivers cannot open a device:
# lavapipe segfaulted in vkCreateDevice at 400 MB; GPU drivers reserve far more.
MIN_ADDRESS_SPACE = 1 << 30


def check_address_space() -> None:
    import resource
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft < MIN_ADDRESS_SPACE:
        from vramd.errors import DeviceError
        raise DeviceError(f"the address-space limit (ulimit -v, systemd's LimitAS=) is {soft >> 20} MiB: a Vulkan "
                          f"driver needs at least {MIN_ADDRESS_SPACE >> 20} MiB to open the device (it would crash); "
                          "raise it")


def arena_for_device(cfg: ServeConfig, device) -> Arena:
    """The token is per GPU: the default arena is keyed by the device's UUID."""
    path = cfg.arena or os.environ.get("VRAMD_ARENA") or (default_base() / device.uuid)
    return Arena.open(path, allow_shared=cfg.allow_shared_arena)


class Daemon:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.metrics = Metrics()
        self.jobs: "queue.Queue[Job]" = queue.Queue()
        self.loaded = False
        self.stopping = False
        self.last_activity = time.monotonic()
        self.device = self.residency = self.model = self.participant = self.engine = self.encoder = None
        self.room: Room | None = None   # the residency policy (vramd/server/room.py), made in setup
        self.control = self.http = None
        # Residency calls come from the loop thread and, for evictions asked by
        # the token holder while we are parked, from a control thread.
        self.lock = threading.RLock()
        self._submit_lock = threading.Lock()
        self._stop_sent = False
        self._stop_deadline: float | None = None   # when the loop has had its STOP_GRACE
        self._loop: threading.Thread | None = None
        self.started = time.time()
        self._release_everything = False  # set for idle sleep, shutdown, an operator's --release
        self.vram_watch = None
        self._vram_lock = threading.Lock()
        self._vram_sampled = 0.0
        self._inflight = 0   # generation replies being written (shutdown lets them finish)
        self.beat = time.monotonic()   # the loop's heartbeat (guard.py feeds the watchdog by it)
        self.lost: str | None = None   # why the token or the arena is no longer ours (guard.py)
        self.exit_code = 0
        self.guard = None
        self.host_cache = HostCache(cfg.cache_ram << 20)   # --cache-ram (vramd/server/hostcache.py)
        self._current: tuple[str | None, float] = (None, 0.0)   # the job the loop runs, since when
        self._inflight_lock = threading.Lock()
        self.batched = BatchSession(self)   # --parallel above 1: the loop's continuous batching

    # -- set-up ------------------------------------------------------------

    def setup(self) -> None:
        from vramd.engine.arch import spec_for
        from vramd.engine.runner import Engine
        from vramd.gpu.device import Device
        from vramd.gpu.residency import Residency
        from vramd.model import loader

        cfg = self.cfg
        self.name = cfg.name or os.path.splitext(os.path.basename(cfg.model))[0]
        systemd.status(f"loading: checking {cfg.model}")
        # Validate the model before anything else: a bad file costs nothing.
        from vramd.model.gguf_check import validate_gguf
        mf = validate_gguf(cfg.model)
        engine_cfg = spec_for(mf)  # an unsupported model is a one-line error now, not at run time
        self.text = Engine.text_front(mf)  # so is a bad vocabulary or chat template
        from vramd.engine.embed import pooling_of
        pooling_of(mf, cfg.pooling)  # and a bad <arch>.pooling_type
        if cfg.mmproj:
            self._check_projector(mf, engine_cfg)  # and a bad or mismatched projector
        check_address_space()   # a driver that runs out of it crashes in vkCreateDevice, with no message
        self.device = Device(cfg.device)
        self._check_budget()
        self.arena = arena_for_device(cfg, self.device)
        self._refuse_duplicate_name()
        self.residency = Residency(self.device)
        self._choose_ctx(mf)
        self._choose_parallel(mf)
        fp = self._footprint(mf)
        # No terminal for the bar (the journal, a pipe): progress lines, and STATUS= for systemctl.
        progress = None if sys.stderr.isatty() else LoadProgress(log, self.name, cfg.model, systemd.status)
        self.model = loader.load(cfg.model, self.residency, cfg.ctx, name=self.name, mf=mf, progress=progress,
                                 scratch=fp.layouts["scratch"], host_tensors=fp.host_tensors,
                                 n_seq=cfg.parallel)
        if cfg.mmproj:
            self.encoder = self._load_encoder()
        for w in self.model.file.warnings:
            log.warning("%s: %s", cfg.model, w)
        if cfg.evict_state == "never" and self.model.kv is not None:
            self.model.kv.evict = False
        self.participant = Participant(
            self.arena, self.name, model=os.path.basename(cfg.model),
            restore=self._restore, release=self._release, breakdown=self.residency.breakdown,
            freeing=lambda: self.room.freeing_bytes(),
            on_yield_request=self.poke, on_ring_while_cold=self._ring_while_parked,
            quantum=cfg.quantum, max_hold=cfg.max_hold)
        # Between two steps of a generation: pause for a peer that rang, resume (vramd/server/slots.py).
        self.slots = Slots(cfg.parallel, cfg.max_queue, self.participant.yield_due_in,
                           lambda: self.participant.go_cold(reason="yield"),
                           lambda cancel: self._ensure_warm(cfg.wake_timeout, cancel, reason="resuming a paused generation"))
        registry = Registry(self.arena.members_dir)
        self.room = Room(self.name, self.residency, self.model.regions, self._budget(),
                         members=self._other_members, is_member=lambda pid: registry.read(pid) is not None,
                         token=self.participant.token, sample=self.sample_device_memory, metrics=self.metrics,
                         ask=self._ask_peer)
        from vramd.gpu.memview import ForeignWatch
        self.vram_watch = ForeignWatch(self.name)
        member = self.participant.member
        member.control = str(self.arena.control_dir / f"{self.name}.sock")
        member.pinned, member.priority, member.budget = cfg.pin, cfg.priority, self._budget()
        self.control = ControlServer(self.arena.control_dir / f"{self.name}.sock", self.control_request)
        self.http = HttpServer(cfg.host, cfg.port, self.routes(), on_error=openai_api.error_body,
                               api_key=cfg.api_key, max_request_bytes=cfg.max_request_bytes,
                               request_timeout=cfg.request_timeout,
                               open_paths=OPEN_PATHS | ({"/metrics"} if cfg.metrics_public else set()),
                               on_start=lambda ex: self.metrics.request_started("api"),
                               on_finish=self._http_finished, cors_origins=cfg.cors_origins)
        self.participant.member.endpoint = self.http.url
        member.aliases = self.listed_names()[1:]   # the gateway routes and lists them too (vramd/gateway/table.py)

    def _check_projector(self, mf, engine_cfg) -> None:
        """The --mmproj file against the model, from the files alone (before the device)."""
        from vramd.model.gguf_check import validate_gguf
        from vramd.model.mmproj import load_mmproj
        if not engine_cfg.takes_embeds:
            raise ModelError(f"{self.cfg.mmproj}: images are not supported with {mf.architecture} models yet")
        _cfg, info = load_mmproj(validate_gguf(self.cfg.mmproj))
        if info.n_embd_text != engine_cfg.n_embd:
            raise ModelError(f"{self.cfg.mmproj}: the projector makes {info.n_embd_text}-wide embeddings; "
                             f"{self.cfg.model} takes {engine_cfg.n_embd}")

    def _load_encoder(self):
        """The --mmproj vision encoder, in host memory until an image comes."""
        from vramd.engine.vision import VisionEncoder
        return VisionEncoder(self.cfg.mmproj, self.residency, name=f"{self.name}/mmproj",
                             resident=self.cfg.mmproj_resident)

    def _footprint(self, mf):
        """The model's regions as vramd/model/footprint.py sizes them (what `vramd plan` prints),
        with the expert tensors --n-cpu-moe keeps on the host."""
        from vramd.model import placement
        from vramd.model.footprint import footprint
        n = self.cfg.n_cpu_moe
        if n is not None and not placement.expert_tensors(mf):
            log.info("%s: %s has no expert tensors; --n-cpu-moe changes nothing", self.name, self.cfg.model)
            n = None
        fp = footprint(mf, self.cfg.ctx, n_cpu_moe=n, budget=self._budget(), limits=self.residency.limits,
                       chunk=self.cfg.prefill_chunk, n_seq=self.cfg.parallel)
        if self.cfg.prefill_chunk is not None and fp.chunk != self.cfg.prefill_chunk:
            log.info("%s: --prefill-chunk %d: cut to %d tokens (one activation buffer of a chunk must fit "
                     "a storage binding)", self.name, self.cfg.prefill_chunk, fp.chunk)
        self.chunk = fp.chunk
        if n is not None and placement.parse_n_cpu_moe(n) == "auto":
            log.info("%s: --n-cpu-moe auto: %g layers of experts on the host", self.name, fp.plan.n_cpu_moe)
        return fp

    def _choose_ctx(self, mf) -> None:
        """--ctx not given: the file's context length, capped by what fits the budget; one line says
        which and why (a file saying 32768 silently got 4096 before)."""
        from vramd.model.footprint import DEFAULT_CTX, auto_ctx, file_context_length
        from vramd.model.placement import parse_n_cpu_moe
        if self.cfg.ctx is not None:
            trained = file_context_length(mf)
            if trained and self.cfg.ctx > trained:
                log.warning("%s: --ctx %d is more than the %d the model was trained for: positions past it "
                            "may give poor text", self.name, self.cfg.ctx, trained)
            return
        n = self.cfg.n_cpu_moe
        if n is not None and parse_n_cpu_moe(n) == "auto":
            # The budget decides the experts' placement: the context is not also traded against it.
            trained = file_context_length(mf) or DEFAULT_CTX
            self.cfg.ctx = min(trained, DEFAULT_CTX)
            why = f"--n-cpu-moe auto: the file's {trained} capped at {DEFAULT_CTX}; give --ctx to choose"
        else:
            self.cfg.ctx, why = auto_ctx(mf, self._budget(), n_cpu_moe=n, limits=self.residency.limits,
                                         chunk=self.cfg.prefill_chunk)
        log.info("%s: --ctx %d: %s", self.name, self.cfg.ctx, why)

    def _choose_parallel(self, mf) -> None:
        """--parallel not given: DEFAULT_PARALLEL slots, fewer where their KV cache (each slot
        --ctx positions) does not fit the budget with the weights and scratch; 1 under
        --n-cpu-moe auto (the budget decides the experts' placement) and for a model that only
        embeds (no generation to batch).  One line says which and why."""
        from vramd.model.footprint import footprint
        from vramd.model.placement import parse_n_cpu_moe
        if self.cfg.parallel is not None:
            return
        n = self.cfg.n_cpu_moe
        if n is not None and parse_n_cpu_moe(n) == "auto":
            self.cfg.parallel, why = 1, "--n-cpu-moe auto gives the budget to the experts"
        elif self.text[0] is None:
            self.cfg.parallel, why = 1, "the model has no vocabulary to generate with"
        else:
            budget, k = self._budget(), DEFAULT_PARALLEL
            while k > 1 and footprint(mf, self.cfg.ctx, n_cpu_moe=n, limits=self.residency.limits,
                                      chunk=self.cfg.prefill_chunk, n_seq=k).device_bytes > budget:
                k -= 1
            self.cfg.parallel = k
            why = (f"{k} sequences of {self.cfg.ctx} positions fit the budget of {budget} bytes" if k == DEFAULT_PARALLEL
                   else f"the most sequences of {self.cfg.ctx} positions whose KV cache fits the budget of {budget} "
                        "bytes with the weights and scratch")
        log.info("%s: --parallel %d: %s; give --parallel to choose", self.name, self.cfg.parallel, why)

    def _refuse_duplicate_name(self) -> None:
        for m in Registry(self.arena.members_dir).list():
            if m.name == self.name and m.pid != os.getpid():
                raise UsageError(f"a member named {self.name!r} already runs in {self.arena.path} "
                                 f"(pid {m.pid}); choose another --name")

    # -- residency callbacks (called by the Participant on the loop thread) --

    def _other_members(self) -> list:
        return [m for m in Registry(self.arena.members_dir).list(clean=False) if m.pid != os.getpid()]

    def _settle_frees(self) -> None:
        """Cold after a release that did not drain: once what our record said was still being
        freed is back with the driver, say so.  On the loop thread, after the token is gone."""
        if self.room.settle_frees(self.participant.holds_token, self.participant.member.freeing_bytes):
            self.participant.set_resident_state()

    def _budget(self) -> int:
        """Device bytes the arena's members may hold together: --vram-budget (at most the device
        heap: a larger one would promise room that is not there), else the device heap."""
        heaps = [h["size"] for h in self.device.heaps if h["device_local"]] or [h["size"] for h in self.device.heaps]
        return min(self.cfg.vram_budget or max(heaps), max(heaps))

    def _check_budget(self) -> None:
        heap = self._budget()
        if self.cfg.vram_budget and self.cfg.vram_budget > heap:
            log.warning("%s: --vram-budget %d bytes is more than the device's %d (%s): clamped to the device",
                        self.name, self.cfg.vram_budget, heap, self.device.name)

    def _restore(self) -> int:
        with self.lock:
            before = self._device_total()
            # Room there, or refused before anything of ours moved, or a StepAside: parked peers
            # must be asked, which the Participant does without the token and without this lock
            # (a peer going warm meanwhile may ask *us* to evict: its request takes the lock).
            self.room.prepare_restore()
            try:
                self.residency.restore(["weights", "state"])
            except OutOfDeviceMemory:
                self.metrics.count("restore_failures")
                raise
            moved = self._device_total() - before
        systemd.status(f"warm: holding the GPU ({moved} bytes uploaded)")
        return moved

    def _release(self) -> int:
        """Going cold (vramd/server/room.py decides what goes)."""
        t0 = time.monotonic()
        with self.lock:
            foreign_next = self.room.foreign_peer_waits(os.getpid())
            everything = self._release_everything or foreign_next or self.stopping
            self._release_everything = False
            moved = self.room.release(everything=everything, exclusive=self.cfg.residency == "exclusive",
                                      evict_state=self.cfg.evict_state, foreign_next=foreign_next,
                                      incoming_need=self.participant.incoming_need(), stopping=self.stopping)
            self.metrics.observe_release(moved)
            parked = self._device_total()
        event(log, "cold", reason=self.participant.cold_reason or "yield", held_s=round(self.participant.held_for(), 3),
              copied_to_host_bytes=moved, kept_on_device_bytes=parked, release_s=round(time.monotonic() - t0, 6))
        systemd.status("parked: keeps its buffers on the device until a peer needs the room" if parked
                       else "cold: device buffers released")
        return moved

    # -- device memory as the machine sees it (vramd/gpu/memview.py) --------------

    def sample_device_memory(self, lock_wait: float | None = None) -> dict | None:
        """Free device memory and what others hold, now; the watchdog looks at it.

        Under the daemon's lock, so never in the middle of our own restore or
        release (whose bytes are then neither in our regions nor in the core's
        count of what it is still freeing).  With `lock_wait`, None if the lock
        was not had in that many seconds."""
        from vramd.gpu import memview
        if not self.lock.acquire(timeout=-1 if lock_wait is None else lock_wait):
            return None
        try:
            with self._vram_lock:
                view = memview.sample(self.device, self.residency)
                # The arena's: what other members hold, and what they released and are still freeing.
                arena = sum(m.device_bytes() + m.freeing_bytes for m in self._other_members())
                report = self.vram_watch.observe(view, arena, self.participant.holds_token)
                self._vram_sampled = time.monotonic()
            return report
        finally:
            self.lock.release()

    def _watch_device_memory(self) -> None:
        """The loop's periodic look while it holds the token (a foreign user is logged by the watch)."""
        if self.participant.holds_token and time.monotonic() - self._vram_sampled >= VRAM_WATCH_INTERVAL:
            try:
                self.sample_device_memory()
            except Exception as e:  # a look that fails must not stop the loop
                log.warning("%s: looking at device memory failed: %s", self.name, e)

    # -- the shared cache (--residency cache; the policy is vramd/server/room.py) -------------

    def _ring_while_parked(self, pids: set[int]) -> None:
        """Warden hook: a ring from a non-member while we park: release everything."""
        if self.room.foreign_ring(pids):
            threading.Thread(target=self._evict_for_foreign_peer, daemon=True).start()

    def _evict_for_foreign_peer(self) -> None:
        if self.participant.state == "warming":
            return  # we are about to take the token ourselves; its holder empties the GPU if needed
        try:
            self.evict(everything=True, reason="a peer that is not a vramd member rang (it expects an empty GPU)")
        except VramdError as e:  # took the token meanwhile: nothing to do
            log.info("%s: not emptied for a flock-only peer: %s", self.name, e)

    def evict(self, nbytes: int = 0, everything: bool = False, reason: str = "asked by the token's holder") -> int:
        """Release parked buffers for the token holder (Room.evict); never while we hold the token."""
        with self.lock:
            freed = self.room.evict(nbytes, everything, holds_token=self.participant.holds_token)
            self.participant.set_resident_state()
        if freed:
            event(log, "evict", reason=reason, asked_bytes=None if everything else nbytes, freed_bytes=freed,
                  kept_on_device_bytes=self._device_total())
        return freed

    def _device_total(self) -> int:
        return self.room.device_total()

    # -- the loop ------------------------------------------------------------

    def poke(self) -> None:
        """Wake the loop (from the warden): a yield may be due."""
        self.jobs.put(Job("poke"))

    def submit_nowait(self, job: Job) -> Job:
        with self._submit_lock:
            if self.stopping:
                raise ShuttingDown(f"{self.name} is shutting down")
            self.jobs.put(job)
        return job

    def submit(self, job: Job) -> Any:
        # Under the lock that request_stop also takes: a job is either queued
        # before the stop job (and failed or run by the loop) or refused here.
        with self._submit_lock:
            if self.stopping:
                raise ShuttingDown(f"{self.name} is shutting down")
            self.jobs.put(job)
        job.wait_taken(self._busy_text)
        return job.wait()

    def loop(self) -> None:
        """The one thread that touches the GPU."""
        wd = systemd.watchdog_interval()
        while True:
            self.beat = time.monotonic()   # the guard pings the watchdog while this moves
            try:
                job = self.jobs.get(timeout=self._next_wakeup(wd))
            except queue.Empty:
                job = None
            self.beat = time.monotonic()
            if self.lost is not None:
                self._leave_lost_token()
            if job is not None and job.kind == "stop":
                self._fail_pending("shutting down")
                job.finish()
                return
            if job is not None and job.kind != "poke":
                self._run(job)
            self._watch_device_memory()
            try:
                if job is None or self.jobs.empty():
                    self._idle_point()
                else:
                    self.participant.checkpoint()
            except Exception as e:  # the loop must outlive one failed yield (the token is released by then)
                log.error("%s: going cold failed: %s", self.name, e)
            try:
                self._settle_frees()
            except Exception as e:
                log.warning("%s: waiting for released memory failed: %s", self.name, e)

    def _beat_or_give_up(self) -> bool:
        """A wait's `cancel`, called every slice of it: the loop lives; give up when stopping."""
        self.beat = time.monotonic()
        return self.stopping or self.lost is not None

    def _before_pause(self, gone: Callable[[], bool]) -> bool:
        """A generation's `cancel` before it pauses for a peer: the token we hold is checked
        first, so a replaced or unlinked token stops us (exit 4) instead of a pause that would
        hand it on and wait for the arena's new one (the guard's next look may come after)."""
        if self.participant.holds_token:
            try:
                self.participant.token.check()
            except TokenError as e:
                self.on_lost(str(e))
        return self._beat_or_give_up() or gone()

    def on_lost(self, why: str) -> None:
        """The guard's call (its thread): the token we hold, or the arena, is no longer the arena's.
        The generation in flight stops at its next step; the loop goes cold and we exit 4."""
        if self.lost is not None:
            return
        self.lost = why
        self.exit_code = TokenError.exit_code
        log.error("%s: %s; stopping (exit %d) so that nothing computes beside another holder",
                  self.name, why, self.exit_code)
        self.poke()

    def _leave_lost_token(self) -> None:
        """On the loop: release what we hold and the orphaned flock, then stop (once)."""
        if self.stopping:
            return
        try:
            self._release_everything = True
            self.participant.go_cold(reason="token lost")
        except Exception as e:  # the token is released by then (go_cold's finally)
            log.error("%s: going cold failed: %s", self.name, e)
        threading.Thread(target=self.request_stop, name="vramd-stop", daemon=True,
                         kwargs={"why": "the GPU token or the arena is no longer ours"}).start()

    def _next_wakeup(self, watchdog_period: float | None) -> float:
        t = watchdog_period or 1.0
        due = self.participant.yield_due_in()
        if due is not None:
            t = min(t, due)
        if self.cfg.idle_sleep >= 0 and self.participant.holds_token:
            t = min(t, max(0.0, self.last_activity + self.cfg.idle_sleep - time.monotonic()))
        return max(t, 0.0)

    def _idle_point(self) -> None:
        if self.participant.idle():
            return
        if (self.cfg.idle_sleep >= 0 and self.participant.holds_token
                and time.monotonic() - self.last_activity >= self.cfg.idle_sleep):
            self._release_everything = True   # the `cold` line says reason=idle-sleep
            self.participant.go_cold(reason="idle-sleep")

    def _busy_text(self) -> str:
        """What a request queued behind others waits for (a 503's message)."""
        kind, since = self._current
        holder = self.participant.holder_text() if not self.participant.holds_token else f"{self.name} (this daemon)"
        if threading.current_thread() is self._loop:
            return f"the GPU token is held by {holder}"
        doing = f"the loop runs an earlier {kind} job, for {time.monotonic() - since:.1f} s" if kind else \
            "the loop has not reached it"
        return f"{doing}; the GPU token is held by {holder}"

    def _run(self, job: Job) -> None:
        if not job.take():
            return   # its requester gave up waiting (a 503) before the loop reached it
        self._current = (job.kind, time.monotonic())
        result = error = None
        try:
            if self.lost is not None:
                raise ShuttingDown(f"{self.name}: {self.lost}; stopping")
            if job.needs_gpu:
                # A stop gives up the wait for the GPU at once (Interrupted, a 503).
                # The timeout counts from the request's arrival, not from here.
                left = job.left()
                if left is not None and left <= 0 and not self.participant.holds_token:
                    raise Timeout(f"waited {time.monotonic() - job.arrived:.1f} s for the GPU "
                                  f"(timeout {job.timeout:g} s): {self._busy_text()}")
                try:
                    self._ensure_warm(None if left is None else max(left, 0.0),
                                      cancel=lambda: self._beat_or_give_up() or job.cancelled.is_set(),
                                      reason=f"a {job.kind} request")
                except Timeout:
                    raise Timeout(f"waited {time.monotonic() - job.arrived:.1f} s for the GPU "
                                  f"(timeout {job.timeout:g} s): {self._busy_text()}") from None
                try:
                    self.participant.token.check()   # before computing, not only at the guard's next look
                except TokenError as e:
                    self.on_lost(str(e))
                    raise ShuttingDown(f"{self.name}: {e}; stopping") from None
            result = job.fn() if job.fn else None
            if job.needs_gpu:
                self.participant.publish()  # compute may have brought scratch in: peers size by our record
        except BaseException as e:  # the job's requester gets it; the loop goes on
            error = e
        if job.needs_gpu:
            self._cold_unless_whole()   # before the requester hears: the next request sees us cold
        self._current = (None, 0.0)
        job.finish(result, error)
        self.last_activity = time.monotonic()

    def _cold_unless_whole(self) -> None:
        """Warm means weights and state on the device.  A step that failed half-way (an image's
        encoder sent the weights out and they could not come back) goes cold properly:
        everything released, the token dropped, the record published; the next request
        restores through `_restore` (and its 503 when the memory is held by others)."""
        if not self.participant.holds_token:
            return
        missing = [r.name for r in self.model.regions if r.kind in ("weights", "state") and not r.resident]
        if not missing:
            return
        log.warning("%s: %s not on the device after a failed step; going cold (the next request restores it)",
                    self.name, ", ".join(missing))
        try:
            self._release_everything = True
            self.participant.go_cold(reason="incomplete")
        except Exception as e:  # the token is released by then (go_cold's finally)
            log.error("%s: going cold failed: %s", self.name, e)

    def _ask_peer(self, peer, cmd: str, wait: float, **args) -> dict:
        """Room's control request to a peer (an eviction, asked without the token while we go
        warm): answered within `wait` s (Room bounds it by what is left of our request)."""
        from vramd.server.room import ask_over_socket
        try:
            st, ours = os.stat(peer.control), os.stat(self.control.path)
        except OSError:
            st = ours = None
        if st is not None and (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
            # A forged record (any member may write one) naming our own socket: asking ourselves
            # to evict would give up our own buffers on a forger's word (and, when the asking was
            # done holding the token and our lock, waited for ever).
            raise PeerError(f"the record of {peer.name!r} (pid {peer.pid}) names this daemon's own control "
                            "socket: forged, not asked")
        return ask_over_socket(peer, cmd, wait=wait, **args)

    def _ensure_warm(self, timeout: float | None, cancel=None, reason: str = "start-up") -> None:
        if self.participant.holds_token:
            return
        need = self.participant.member.wants_bytes = self.room.needed_bytes()
        if need:
            self.room.check_within_reach(need)   # before anyone is rung: a hopeless restore is a 503 now
        self.room.begin()   # a peer that does not answer is asked to evict once while we go warm
        h2d_before = self.participant.member.bytes_h2d
        holder = self.participant.holder_text()
        if holder != "none":
            systemd.status(f"waiting for the GPU token ({reason}): held by {holder}")
        self.participant.ensure_warm(timeout, cancel)
        m = self.participant.member
        self.metrics.observe_switch((m.last_switch_ms or 0.0) / 1000, m.bytes_h2d - h2d_before)
        event(log, "switch", reason=reason, switch_s=round((m.last_switch_ms or 0.0) / 1000, 6),
              restore_s=round(self.participant.last_restore_s, 6),
              uploaded_bytes=m.bytes_h2d - h2d_before, holder_before=holder)

    def _fail_pending(self, why: str) -> None:
        """Fail every queued job now (pokes and the stop job are the loop's: put back)."""
        keep = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job.kind in ("poke", "stop"):
                keep.append(job)
            else:
                job.finish(error=ShuttingDown(f"{self.name}: {why}"))
        for job in keep:
            self.jobs.put(job)

    # -- requests --------------------------------------------------------------

    def control_request(self, request: dict) -> dict:
        """The control socket's handler: counted, timed and logged (a `control` line), then handled."""
        self.metrics.request_started("control")
        t0 = time.monotonic()
        cmd = request.get("cmd") if isinstance(request, dict) else None
        level = logging.DEBUG if cmd == "status" else logging.INFO   # `vramd status` polls
        try:
            reply = self.handle_control(request)
        except VramdError as e:
            self.metrics.request_failed("control", e.exit_code)
            event(log, "control", level, cmd=cmd, ok=False, code=e.exit_code,
                  total_s=round(time.monotonic() - t0, 6), error=str(e))
            raise
        except Exception:
            self.metrics.request_failed("control", 1)
            raise
        event(log, "control", level, cmd=cmd, ok=True, total_s=round(time.monotonic() - t0, 6))
        return reply

    def handle_control(self, request: dict) -> dict:
        cmd = request["cmd"]
        timeout = request.get("timeout", DEFAULT_WAKE_TIMEOUT)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 <= timeout <= 86400:
            raise UsageError("timeout must be a number of seconds between 0 and 86400")
        if cmd == "status":
            return {"ok": True, **self.status()}
        if cmd == "wake":
            t0 = time.monotonic()
            was_cold = not self.participant.holds_token
            h2d = self.participant.member.bytes_h2d
            self.submit(Job("wake", needs_gpu=True, timeout=timeout))
            m = self.participant.member
            return {"ok": True, "state": m.state, "was_cold": was_cold, "moved_bytes": m.bytes_h2d - h2d,
                    "wait_ms": (time.monotonic() - t0) * 1000,
                    "switch_ms": m.last_switch_ms if was_cold else 0.0,
                    "device_bytes": self._device_total()}
        if cmd == "yield":
            release = bool(request.get("release", False))

            def go_cold():
                self._release_everything = release
                self.participant.go_cold(reason="yield")
                if release and self._device_total():  # parked before: drop what is left
                    self.evict(everything=True, reason="an operator's yield --release")
            self.submit(Job("yield", fn=go_cold))
            return {"ok": True, "state": self.participant.state}
        if cmd == "evict":
            nbytes = request.get("bytes", 0)
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise UsageError("bytes must be a non-negative integer")
            freed = self.evict(nbytes, everything=bool(request.get("everything", False)),
                               reason="asked over the control socket (the token's holder needs the room)")
            return {"ok": True, "freed": freed, "state": self.participant.state}
        if cmd == "verify":
            return {"ok": True, **self.submit(Job("verify", fn=self.verify, needs_gpu=True, timeout=timeout))}
        if cmd == "shutdown":
            threading.Thread(target=self.request_stop, daemon=True,
                             kwargs={"why": "a shutdown request on the control socket"}).start()
            return {"ok": True, "state": "stopping"}
        raise UsageError(f"unknown command {cmd!r} (status, wake, yield, evict, verify, shutdown)")

    def verify(self) -> dict:
        """Read every weight back from the device and compare with the model file."""
        mf = self.model.file
        bad = []
        fd = os.open(mf.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for t in mf.tensors:
                on_device = self.model.weights.tensors[t.name].read()
                if on_device.tobytes() != os.pread(fd, t.nbytes, t.offset):
                    bad.append(t.name)
        finally:
            os.close(fd)
        kv = hashlib.sha256()
        if self.model.kv is not None:
            for tensor in self.model.kv.tensors.values():
                kv.update(tensor.read().tobytes())
        return {"weights_ok": not bad, "mismatched": bad, "tensors": len(mf.tensors),
                "kv_sha256": kv.hexdigest()}

    def routes(self) -> dict:
        return {
            ("GET", "/health"): json_route(self.health),
            ("GET", "/vramd/status"): json_route(lambda: (200, self.status())),
            ("GET", "/metrics"): lambda ex: ex.reply(200, self.render_metrics().encode(),
                                                     "text/plain; version=0.0.4; charset=utf-8"),
            ("GET", "/v1/models"): json_route(lambda: (200, openai_api.models_list(self.listed_names(),
                                                                                  int(self.started)))),
            ("GET", "/v1/models/"): self.model_route,
            ("POST", "/v1/completions"): lambda ex: self.handle_generation("completion", ex),
            ("POST", "/v1/chat/completions"): lambda ex: self.handle_generation("chat", ex),
            ("POST", "/v1/embeddings"): lambda ex: embeddings.handle(self, ex),   # vramd/server/embeddings.py
        }

    # -- [surface] the names, the answer to a generation request ---------------------------

    def listed_names(self) -> list[str]:
        """/v1/models: the daemon's name, then each --alias (one entry each: UIs show every entry)."""
        return [self.name] + [a for a in self.cfg.aliases if a != self.name]

    def model_names(self) -> list[str]:
        """What a request's "model" may say: the listed names, and the model file's name (unlisted:
        it was listed before aliases existed, and clients configured with it keep working)."""
        return sorted(set(self.listed_names()) | {os.path.basename(self.cfg.model)})

    def model_route(self, ex: Exchange) -> None:
        """GET /v1/models/{id} (the SDK's models.retrieve): a name requests may give, else 404."""
        if ex.rest not in self.model_names():
            raise openai_api.NotFound(f"the model '{ex.rest}' does not exist here (this daemon serves "
                                      f"{', '.join(self.listed_names())})")
        ex.reply(200, openai_api.model_entry(ex.rest, int(self.started)))

    def handle_generation(self, kind: str, ex: Exchange) -> None:
        """One OpenAI request: a generation job on the loop thread, streamed or not.  Its choices
        (n per prompt) join the batch of every slot, or run one after another alone (--parallel 1,
        or what the batch cannot take: vramd/server/generating.py)."""
        ex.fields["model"] = self.name
        req = openai_api.parse_request(kind, ex.body(), set(self.model_names()))
        req.reasoning_format = req.reasoning_format or self.cfg.reasoning_format   # vramd/server/reasoning.py
        if req.user:
            ex.fields["user"] = req.user
        if self.engine is None:
            raise PeerError(f"{self.name} is still loading")
        if self.stopping:
            raise ShuttingDown(f"{self.name} is shutting down")
        self.slots.admit(self._queued())   # a full queue (--max-queue): 503 with Retry-After
        # Validated, rendered and tokenized here, before the job is queued: a bad request
        # is a 400 that never rings a peer nor takes the GPU (vramd/server/prompts.py).
        choices: list[_Choice] = []
        for sub in req.each_prompt():
            sampling, prepared, dropped = prompts.prepare(self.engine, sub, self.encoder is not None)
            for _ in range(req.n):
                index = len(choices)
                builder = openai_api.ResponseBuilder(sub, self.name, index=index,
                                                     like=choices[0].builder if choices else None)
                builder.context = dropped
                choices.append(_Choice(builder, sub, replace(sampling, seed=req.choice_seed(index)), prepared))
        run = Run(self, kind, choices, ex.started)
        events, cancelled, timing = run.events, run.cancelled, run.timing
        batched = len(self.slots.slots) > 1 and run.batchable
        job = Job("generate", needs_gpu=True, timeout=self.cfg.wake_timeout, cancelled=cancelled, run=run,
                  fn=(lambda: self.batched.run(job)) if batched else run.alone)
        run.job = job
        try:
            with self.in_flight(job):
                builders = [c.builder for c in choices]
                if req.stream:
                    # The headers at once, then comments until the loop takes the job: a client (or a
                    # proxy) sees a live stream while the request waits for the GPU.  What fails from
                    # here on is an SSE error event, then [DONE] (http.py's late error).
                    ex.start_stream()
                    job.wait_taken(self._busy_text, tick=lambda: self._stream_tick(ex, cancelled),
                                   every=STREAM_KEEPALIVE)
                    self._answer_stream(req, ex, builders, job, events, cancelled)
                else:
                    job.wait_taken(self._busy_text)
                    self._answer(req, ex, builders, job, events, cancelled)
        finally:
            if job.done.is_set():
                ex.fields.update(timing)

    @contextlib.contextmanager
    def in_flight(self, job: Job):
        """Submit a request's `job` and count it in flight until its reply is written (shutdown
        lets those finish; /metrics and `vramd status` show the count)."""
        self.submit_nowait(job)
        with self._inflight_lock:
            self._inflight += 1
        try:
            yield job
        finally:
            with self._inflight_lock:
                self._inflight -= 1

    @staticmethod
    def _stream_tick(ex: Exchange, cancelled: threading.Event) -> None:
        """A waiting stream's keep-alive; a client that went away raises ClientGone."""
        try:
            if ex.client_gone():
                raise ClientGone("the client went away while the request waited for the GPU")
            ex.keep_alive()
        except ClientGone:
            cancelled.set()
            raise

    def _http_finished(self, ex: Exchange, seconds: float) -> None:
        """An HTTP request ended (http.py's on_finish): errors by status (a stream's after its
        headers: the error event's), generation latency."""
        status = ex.fields.get("error_status", ex.status)
        if status is not None and status >= 400:
            self.metrics.request_failed("api", status)
        if ex.path in GENERATION_PATHS and ex.method == "POST":
            self.metrics.observe_request(seconds)

    def _answer(self, req, ex: Exchange, builders: list, job: Job, events: queue.Queue,
                cancelled: threading.Event) -> None:
        """The reply to a non-streamed generation job: one JSON body, every choice in it."""
        # Nobody reads a non-streamed reply until it is whole: look for a hang-up meanwhile,
        # so an abandoned request stops at its next step instead of generating on.
        while not job.done.wait(CLIENT_CHECK):
            if ex.client_gone():
                cancelled.set()
                ex.error = "the client went away: generation stopped"   # in its request line
                job.done.wait()
                return
        finishes = job.wait()
        while not events.empty():
            kind_, value = events.get()
            if kind_ == "piece":
                builders[value[0]].add(value[1])
        payload = openai_api.combined(builders, finishes, req.n)
        context = payload["usage"].get("context") if len(builders) > 1 else None
        ex.reply(200, payload, headers=builders[0].context_header(context))

    def _answer_stream(self, req, ex: Exchange, builders: list, job: Job, events: queue.Queue,
                       cancelled: threading.Event) -> None:
        """The stream of a generation job, its headers already sent: each choice's chunks (with
        its index) as the pieces come, its finish when it ends; comments while nothing comes."""
        first = [True] * len(builders)
        ended: set[int] = set()
        last = time.monotonic()
        try:
            while True:
                try:
                    kind_, (index, value) = events.get(timeout=0.05)
                except queue.Empty:
                    if job.done.is_set() and events.empty():
                        break
                    if time.monotonic() - last >= STREAM_KEEPALIVE:
                        ex.keep_alive()   # a long prefill: nothing else to send
                        last = time.monotonic()
                    continue
                b = builders[index]
                if kind_ == "piece":
                    b.add(value)
                    ex.send(openai_api.sse(b.chunk([value], first=first[index])))
                else:   # "end": this choice's finish
                    ex.send(openai_api.sse(b.chunk([], finish_reason=value, first=first[index])))
                    ended.add(index)
                first[index] = False
                last = time.monotonic()
        except Exception:
            cancelled.set()  # the client went away: the loop stops generating at the next token
            raise
        try:
            job.wait()
        except ShuttingDown as e:
            # Ended by a stop: a finish the client can see for each choice not ended, then why, then the end.
            for b in builders:
                if b.index not in ended:
                    ex.send(openai_api.sse(b.chunk([], finish_reason="abort", first=first[b.index])))
            ex.stream_error(*openai_api.error_body(e))
            return
        except VramdError as e:
            ex.stream_error(*openai_api.error_body(e))
            return
        if req.include_usage:
            chunk = builders[0].usage_chunk()
            chunk["usage"] = openai_api.summed_usage(builders, req.n)
            ex.send(openai_api.sse(chunk))
        ex.send(openai_api.sse(b"[DONE]"))

    def health(self) -> tuple[int, dict]:
        if self.stopping:
            return 503, {"status": "stopping", "name": getattr(self, "name", None)}
        if not self.loaded:
            return 503, {"status": "loading"}
        return 200, {"status": "ok", "name": self.name, "state": self.participant.state}

    def status(self) -> dict:
        from vramd.server.heapstats import heap_stats
        m = self.participant.member
        return {"name": self.name, "pid": os.getpid(), "model": self.cfg.model, "arena": str(self.arena.path),
                "device": self.device.describe(), "state": m.state, "holds_token": self.participant.holds_token,
                "breakdown": self.residency.breakdown(), "switches": m.switches, "yields": m.yields,
                # The part of the breakdown's `state` that is a recurrent state (qwen35), not K/V: as `vramd plan` says
                "recurrent_state_bytes": self._recurrent_state_bytes(),
                # Per heap: the driver's usage (VK_EXT_memory_budget), else the core's own count of its allocations.
                "heaps": self.residency.budget(), "device_peak": self.residency.stats()["device_peak"],
                "host_heap": heap_stats(),   # the C heap (glibc): bytes in use and freed but kept
                "bytes_h2d": m.bytes_h2d, "bytes_d2h": m.bytes_d2h, "last_switch_ms": m.last_switch_ms,
                "evict_state": self.cfg.evict_state, "idle_sleep": self.cfg.idle_sleep,
                "residency": self.cfg.residency, "pinned": self.cfg.pin, "priority": self.cfg.priority,
                "evictions": self.metrics.evictions, "evicted_bytes": self.metrics.evicted_bytes,
                "engine": dict(self.engine.stats) if self.engine else None,
                "vram_budget": self.cfg.vram_budget, "ctx": self.cfg.ctx, "endpoint": self.http.url,
                "slots": self.slots.status(self._queued(), self.engine.stats["reused_tokens"] if self.engine else 0),
                "host_cache": self.host_cache.status(),   # host memory beside the breakdown's regions
                "inflight": self._inflight,   # generation requests submitted and not yet answered
                "stopping": self.stopping,    # shutting down: draining its replies (`vramd status` says so)
                "device_memory": self._device_memory_status()}

    def _recurrent_state_bytes(self) -> int:
        """Tensor bytes of the recurrent state and its checkpoint (footprint.py's recurrent_bytes)."""
        model = getattr(self.engine, "model", None) if self.engine else None
        kv = getattr(model, "kv", None)
        return kv.layout.recurrent_bytes if kv is not None else 0

    def _device_memory_status(self) -> dict | None:
        """A fresh look (status and /metrics are how an operator asks); the last one if looking
        fails or the daemon is busy restoring or releasing for longer than SAMPLE_LOCK_WAIT."""
        if self.vram_watch is None:
            return None
        try:
            report = self.sample_device_memory(lock_wait=SAMPLE_LOCK_WAIT)
        except Exception as e:
            log.warning("%s: looking at device memory failed: %s", self.name, e)
            report = None
        return report if report is not None else self.vram_watch.last

    def render_metrics(self) -> str:
        from vramd.server.metrics import render_device_memory
        return self.metrics.render(self.name, self.participant.state, self.participant.holds_token,
                                   self.participant.member.yields, self.residency.breakdown(),
                                   tokens=dict(self.engine.stats) if self.engine else None,
                                   queued=self._queued(), inflight=self._inflight) + \
            "\n".join(self.slots.render_metrics(f'name="{self.name}"') +
                      self.host_cache.render_metrics(f'name="{self.name}"')) + "\n" + \
            render_device_memory(self.name, self._device_memory_status())

    def _queued(self) -> int:
        """Requests in the loop's queue that it has not started (its own pokes and stop left out)."""
        with self.jobs.mutex:
            n = sum(1 for j in self.jobs.queue if j.kind not in ("poke", "stop") and not j.taken.is_set())
        return n + self.batched.waiting   # and those the batch took that wait for a slot

    # -- life and death -------------------------------------------------------------

    def request_stop(self, why: str = "asked to stop") -> None:
        """Stop accepting, fail every queued job now, ask the loop to stop and wait for it
        (at most STOP_GRACE s: the job in flight ends at its next step)."""
        with self._submit_lock:
            first = not self.stopping
            self.stopping = True
            job = None
            if not self._stop_sent:
                self._stop_sent = True
                self._stop_deadline = time.monotonic() + STOP_GRACE
                job = Job("stop")
                self.jobs.put(job)
        if first:
            systemd.stopping(f"stopping: {why}; {self._inflight} generation requests in flight, "
                             f"{self._queued()} queued (failed now)")
        self._fail_pending("shutting down")
        if job is not None and self._loop is not None and self._loop.is_alive():
            job.done.wait(max(0.0, self._stop_deadline - time.monotonic()))

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT or a `shutdown` request; returns the exit code."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        pending: list[int] = []

        def on_signal(signum, _frame):  # only queue; the main thread acts
            if pending or self.stopping:
                # A second signal while stopping: the operator means now.  The kernel
                # drops our flocks with the process; a stale record is cleaned by its pid.
                os.write(2, f"vramd: signal {signum} while stopping: exiting now\n".encode())
                os._exit(128 + signum)
            pending.append(signum)
            os.write(wake_w, b"s")

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, on_signal)
        # The kernel may deliver a signal to any thread; Python runs the handler in the main
        # thread only once that thread returns from its select(), which the signal did not
        # interrupt: up to its 1 s timeout (measured: /health said "ok" 0.9 s after a SIGTERM).
        # With the wakeup fd the C-level handler writes to the pipe from whichever thread got it.
        signal.set_wakeup_fd(wake_w)
        # A daemon thread: a loop stuck in a driver call must not keep a
        # stopping process alive (systemd would only SIGKILL it later).
        self._loop = threading.Thread(target=self.loop, name="vramd-loop", daemon=True)
        self.participant.start()
        self.guard = Guard(self.name, self.arena, self.participant.token, lambda: self.beat, self.on_lost,
                           tend=(self.control.ensure_bound,)).start()
        try:
            # Acquire before the first upload, then upload: the seeds' rule.
            # A signal while we wait for the token gives up the wait.
            self._ensure_warm(None, cancel=lambda: bool(pending) or self._beat_or_give_up())
            from vramd.engine.runner import Engine
            self.engine = Engine(self.model, self.residency, self.cfg.ctx, encoder=self.encoder, text=self.text,
                                 overflow=self.cfg.context_overflow, pooling=self.cfg.pooling, chunk=self.chunk)
            self.sample_device_memory()   # while we hold the token: the watchdog's baseline
            self.loaded = True
            self.last_activity = time.monotonic()
            self._loop.start()
            self.control.start()
            self.http.start()
            self.participant.publish()
            log.info("%s: serving %s on %s (arena %s)", self.name, self.cfg.model, self.http.url, self.arena.path)
            systemd.ready(f"warm: {self.name} loaded, serving on {self.http.url}")
            while not self.stopping and not pending:
                select.select([wake_r], [], [], 1.0)
            if pending:
                log.info("%s: signal %d, shutting down", self.name, pending[-1])
        except Interrupted:
            if pending:
                log.info("%s: signal %d while waiting for the GPU, shutting down", self.name, pending[-1])
        finally:
            self.shutdown(f"signal {pending[-1]}" if pending else "asked to stop")
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)
        log.info("%s: stopped (exit %d)", self.name, self.exit_code)
        return self.exit_code

    def _wait_replies(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)

    def shutdown(self, why: str = "asked to stop") -> None:
        """Stop the loop, release the token, remove the member record and control socket; idempotent."""
        self.request_stop(why)
        loop_alive = self._loop is not None and self._loop.is_alive()
        if loop_alive:
            # What is left of the one STOP_GRACE (request_stop waited for part of it).
            self._loop.join(max(0.0, self._stop_deadline - time.monotonic()) if self._stop_deadline else STOP_GRACE)
            loop_alive = self._loop.is_alive()
        if loop_alive:
            # Never release buffers (or the token) under a loop that still computes: the
            # process's exit frees both once it is gone.
            log.error("%s: the loop did not stop within %g s (a device call that does not return); "
                      "exiting without releasing under it", self.name, STOP_GRACE)
            return
        self._wait_replies(REPLY_GRACE)   # the cut-short replies reach their clients
        if self.guard is not None:
            self.guard.close()
        for closer in (self.control, self.http):
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    pass
        if self.participant is not None:
            self.participant.close()
        if self.engine is not None:
            self.engine.close()
        if self.encoder is not None:
            self.encoder.close()
        if self.residency is not None:
            self.residency.close()
        if self.device is not None:
            self.device.close()


def serve(cfg: ServeConfig) -> int:
    daemon = Daemon(cfg)
    try:
        daemon.setup()
    except BaseException:
        daemon.shutdown()
        raise
    return daemon.run()

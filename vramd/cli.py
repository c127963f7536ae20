"""The `vramd` command: a thin client of the arena (and, later, of the daemons).

Every error a user can cause ends as one line `vramd: <what and where>` on
stderr and the exit code of its class (vramd/errors.py, docs/operations.md);
no traceback.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from vramd import __version__
from vramd.errors import ModelError, PeerError, Timeout, UsageError, VramdError


def arena_options(f):
    """--arena and --allow-shared-arena, accepted by every command that uses an arena."""
    @click.option("--arena", "arena_path", type=click.Path(path_type=Path), default=None,
                  help="Arena directory (default: $VRAMD_ARENA, else a per-user runtime directory).")
    @click.option("--allow-shared-arena", is_flag=True,
                  help="Accept a world-writable or foreign-owned arena (e.g. llama.cpp's /dev/shm/llama-vram).")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)
    return wrapper


def open_arena(arena_path, allow_shared, create=True):
    from vramd.arena.layout import Arena
    return Arena.open(arena_path, create=create, allow_shared=allow_shared)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vramd")
def cli():
    """vramd: several always-loaded models time-share one GPU."""


# -- status -------------------------------------------------------------------

@cli.command()
@arena_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(arena_path, allow_shared_arena, as_json):
    """Show the token holder, the waiters and every member of the arena(s)."""
    from vramd.arena.layout import Arena, ENV_ARENA, default_base
    from vramd.arena.status import arena_status, discover_arenas, drop_empty, flag_claims, member_totals

    explicit = bool(arena_path or os.environ.get(ENV_ARENA))
    if explicit:
        arenas = [Arena.open(arena_path, create=False, allow_shared=True)]
    else:
        arenas = [Arena.open(p, create=False) for p in discover_arenas()]
    reports = [member_totals(flag_claims(ask_daemons(arena_status(a)))) for a in arenas]
    left_out = []
    if not explicit:
        reports, left_out = drop_empty(reports)
    if as_json:
        out = reports[0] if len(reports) == 1 else {"arenas": reports}
        click.echo(json.dumps(out, indent=2))
        return
    if not reports:
        click.echo(f"no arena under {default_base()} (nothing has run yet)")
        return
    for i, report in enumerate(reports):
        if i:
            click.echo()
        click.echo(render_status(report))
    for path in left_out:
        click.echo(f"(also {path}: empty)")


def ask_daemons(report: dict) -> dict:
    """Complete each daemon's row with what it says over its control socket now
    (state, breakdown, configuration); a daemon that does not answer keeps its
    published record and is marked `"daemon": null`."""
    from vramd.server.control import request

    for row in report["members"]:
        path = row.pop("control", "")
        if not path:
            continue
        try:
            live = request(path, "status", wait=2.0)
        except VramdError:
            row["daemon"] = None
            continue
        # A daemon shutting down still answers (it drains its replies): say so, not its last state.
        row["state"] = "stopping" if live.get("stopping") else live["state"]
        row["device_bytes"] = {k: v["device"] for k, v in live["breakdown"].items()}
        row["host_bytes"] = {k: v["host"] for k, v in live["breakdown"].items()}
        row["device_total"] = sum(row["device_bytes"].values())
        row["host_total"] = sum(row["host_bytes"].values())
        row["daemon"] = {k: live.get(k) for k in ("endpoint", "residency", "evict_state", "ctx", "vram_budget",
                                                   "evictions", "evicted_bytes", "engine", "device_memory",
                                                   "recurrent_state_bytes", "slots", "host_cache")}
    return report


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def render_status(r: dict) -> str:
    lines = [f"arena   {r['arena']}" + ("  (shared)" if r["shared"] else "")]
    if r["holder_pid"] is None:
        lines.append("holder  none (the GPU is free)")
    else:
        what = "member" if r["holder_is_member"] else "not a vramd member"
        lines.append(f"holder  pid {r['holder_pid']} ({r['holder_name']}, {what})")
    if r["waiting"]:
        lines.append("waiting " + ", ".join(f"{w['name']} (pid {w['pid']})" for w in r["waiting"]))
    if r.get("budget_bytes"):
        lines.append(f"vram    {human_bytes(r['device_bytes_used'])} used by members of "
                     f"{human_bytes(r['budget_bytes'])}, {human_bytes(r['free_bytes'])} free")
    if r.get("eviction_order"):
        lines.append("evicts  " + " > ".join(r["eviction_order"]) + "  (first to go on the left)")
    if not r["members"]:
        lines.append("members none")
        return "\n".join(lines)
    header = ("", "NAME", "PID", "STATE", "ENDPOINT", "MODEL", "VRAM", "WEIGHTS", "KV/STATE", "ENCODER",
              "SCRATCH", "HOST", "SINCE", "SWITCHES")
    rows = [header]
    for m in r["members"]:
        d = m["device_bytes"]
        state = m["state"] + (" pinned" if m.get("pinned") else "") + \
            (" (stopped)" if m.get("stopped") else
             " (no answer)" if "daemon" in m and m["daemon"] is None else "")
        endpoint = (m.get("endpoint") or "-").removeprefix("http://")
        rows.append(("*" if m["holds_token"] else "", m["name"], str(m["pid"]), state, endpoint,
                     m.get("model") or "-", human_bytes(m["device_total"]), human_bytes(d["weights"]),
                     human_bytes(d["state"]), human_bytes(d["encoder"]), human_bytes(d["scratch"]),
                     human_bytes(m["host_total"]), human_age(m["for_s"]), str(m["switches"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if any(m["holds_token"] for m in r["members"]):
        lines.append("(* holds the token)")
    if r.get("split_brain"):
        lines.append(f"SPLIT   {len(r['claims_gpu'])} members claim the GPU at once: {', '.join(r['claims_gpu'])} "
                     "(token.lock was replaced while one held it: each holds its own inode; stop the one "
                     "without the * (a running daemon exits 4 by itself))")
    for m in r["members"]:
        if m.get("failpoints"):
            lines.append(f"failpoints {m['name']}: {m['failpoints']} armed (VRAMD_FAILPOINTS: fault injection "
                         "for tests; `kill` SIGKILLs it there)")
    for m in r["members"]:   # KV/STATE of a hybrid model (qwen35) is K/V and a recurrent state: say how much of each
        rec = (m.get("daemon") or {}).get("recurrent_state_bytes") or 0
        if rec:
            total = m["host_bytes"]["state"]
            lines.append(f"state   {m['name']}: KV/STATE {human_bytes(total)} = recurrent state and its checkpoint "
                         f"{human_bytes(rec)} + K/V and alignment {human_bytes(total - rec)}")
    for m in r["members"]:   # its slots: what each serves, a generation paused for a peer (vramd/server/slots.py)
        sl = (m.get("daemon") or {}).get("slots")
        if sl and (sl["busy"] or sl["queued"]):
            rows = ", ".join(f"slot {s['id']} {s['state']}" + (f" for {s['paused_for_s']:.1f}s (a peer holds the GPU)"
                                                               if s["state"] == "paused" else
                                                               f" {s['tokens']} tokens at {s['tokens_per_second']:g} tok/s")
                             for s in sl["slots"] if s["state"] != "idle")
            lines.append(f"slots   {m['name']}: {rows or 'all idle'} of {sl['parallel']}; {sl['queued']} queued; "
                         f"{sl['tokens_per_second']:g} tok/s in all")
    for m in r["members"]:
        hc = (m.get("daemon") or {}).get("host_cache")
        if hc and hc["entries"]:
            lines.append(f"cache   {m['name']}: host prompt cache {human_bytes(hc['bytes'])} of "
                         f"{human_bytes(hc['limit_bytes'])} ({hc['entries']} sequences, {hc['hits']} hits, "
                         f"{hc['restored_tokens']} tokens reused)")
    for m in r["members"]:
        dm = (m.get("daemon") or {}).get("device_memory") or {}
        if dm.get("foreign_since") is not None:
            lines.append(f"foreign {m['name']}: {human_bytes(dm['foreign'])} of device memory taken outside the arena "
                         f"while it held the token ({human_bytes(dm['free'])} free): a GPU user that ignores the token")
    return "\n".join(lines)


# -- ring / yield ---------------------------------------------------------------

@cli.command()
@arena_options
@click.option("--pid", type=click.IntRange(min=1), default=None,
              help="Ring as this pid (default: the calling process, i.e. your shell).")
def ring(arena_path, allow_shared_arena, pid):
    """Ring the doorbell: ask the token holder to yield at its next idle point.

    A ring names a live pid; by default the process that ran `vramd ring`
    (your shell or script), exactly like `echo 1 > <arena>/doorbell/$$`.
    """
    from vramd.arena import doorbell
    if pid is not None and not doorbell.pid_alive(pid):
        raise UsageError(f"--pid {pid}: no such process (a ring names a live pid; the holder ignores others)")
    arena = open_arena(arena_path, allow_shared_arena)
    path = doorbell.ring(arena.doorbell_dir, pid or os.getppid())
    click.echo(f"rang {path}")


@cli.command(name="yield")
@arena_options
@click.argument("name", required=False)
@click.option("--all", "all_", is_flag=True, help="Ask whoever holds the token, member or not.")
@click.option("--wait", is_flag=True, help="Return only once the holder went cold (exit 1 on timeout).")
@click.option("--release", is_flag=True, help="A daemon also frees its device memory instead of parking it.")
@click.option("--timeout", type=click.FloatRange(min=0, max=86400), default=30.0, show_default=True,
              help="Seconds --wait waits.")
def yield_(arena_path, allow_shared_arena, name, all_, wait, release, timeout):
    """Ask the token holder (or member NAME, if it holds it) to go cold."""
    from vramd.arena import doorbell
    from vramd.arena.members import Registry
    from vramd.arena.token import Token

    if name and all_:
        raise UsageError("give a NAME or --all, not both")
    arena = open_arena(arena_path, allow_shared_arena, create=False)
    token = Token(arena.token_path)
    registry = Registry(arena.members_dir)
    members = {m.pid: m for m in registry.list()}
    holders = token.holders()
    if name:
        named = [m for m in members.values() if m.name == name]
        if not named:
            raise PeerError(f"no member named {name!r} in {arena.path} (see `vramd status`)")
        targets = [m.pid for m in named if m.pid in holders]
        if not targets:
            parked = [m for m in named if m.device_bytes() and m.control]
            if release and parked:
                from vramd.server.control import request
                request(parked[0].control, "yield", wait=timeout, release=True)
                click.echo(f"{name} released its device memory")
            else:
                click.echo(f"{name} is already cold" + (" (parked: --release frees its memory)" if parked else ""))
            return
    else:
        targets = holders
        if not targets:
            click.echo("nobody holds the token")
            return
    target = targets[0]
    label = members[target].name if target in members else f"pid {target}"
    if target in members and members[target].control:
        # A daemon: ask it directly; it goes cold at its next idle point.
        from vramd.server.control import request
        request(members[target].control, "yield", wait=timeout if wait else 5.0, release=release)
        click.echo(f"{label} yielded")
        return
    yields_before = members[target].yields if target in members else None
    # A ring must name a live process until the holder has read it: with
    # --wait that is us; without, our caller (as `vramd ring` does).
    doorbell.ring(arena.doorbell_dir, os.getpid() if wait else os.getppid())
    if not wait:
        click.echo(f"asked {label} to yield")
        return
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if target not in token.holders():
                break
            if yields_before is not None:
                m = registry.read(target)
                if m is not None and m.yields > yields_before:
                    break
            time.sleep(0.002)
        else:
            raise Timeout(f"{label} did not yield within {timeout:g} s "
                          "(it yields between two generation steps after its hold quantum; a long prefill is one step)")
    finally:
        doorbell.remove_ring(arena.doorbell_dir)
    click.echo(f"{label} yielded")


# -- serve / wake -------------------------------------------------------------------

@cli.command()
@click.argument("model", required=False, type=click.Path(path_type=str))
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="TOML file with the same keys as the flags (flags override it).")
@click.option("--name", default=None, help="Member name (default: the model file's stem).")
@click.option("--arena", "arena", default=None, help="Arena (default: per user, keyed by the device's UUID).")
@click.option("--allow-shared-arena", is_flag=True, default=None, help="Accept a world-writable arena.")
@click.option("--device", default=None, help="Vulkan device index or UUID (default: first discrete GPU).")
@click.option("--ctx", type=int, default=None,
              help="Context length the KV cache is sized for [the file's context length, capped by what fits "
                   "--vram-budget or the device: the daemon logs which and why].")
@click.option("--context-overflow", type=click.Choice(["error", "truncate-oldest", "shift"]), default=None,
              help="A prompt longer than the context: error (a 400), truncate-oldest (drop the oldest chat turns "
                   "or prompt tokens), shift (as truncate-oldest, and when the context fills while generating, "
                   "drop the oldest half, llama.cpp's context shift); what was dropped is in usage.context [error].")
@click.option("--pooling", type=click.Choice(["none", "mean", "cls", "last"]), default=None,
              help="How /v1/embeddings pools a prompt's hidden states, over the file's <arch>.pooling_type (a "
                   "generative model's file has none: embeddings need this) [the file's].")
@click.option("--reasoning-format", type=click.Choice(["auto", "deepseek", "none"]), default=None,
              help="A thinking model's <think> block: auto (into reasoning_content when the chat template is a "
                   "thinking one, as llama.cpp's server does), deepseek (a leading block whatever the template), "
                   "none (left in content); a request's reasoning_format overrides it [auto].")
@click.option("--evict-state", type=click.Choice(["auto", "always", "never"]), default=None,
              help="Copy the KV cache to the host when going cold: auto (only if the next peer needs the room), "
                   "always, never [auto].")
@click.option("--idle-sleep", type=float, default=None,
              help="Release the GPU after this many idle seconds; negative: never [-1].")
@click.option("--vram-budget", default=None, help="Device bytes the arena's members may use together, e.g. 12GiB.")
@click.option("--host", default=None, help="HTTP address [127.0.0.1]; another address needs an API key to be safe.")
@click.option("--api-key", default=None, envvar="VRAMD_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health (prefer the env var or "
                   "--api-key-file: arguments show in ps).")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False),
              help="Read the API key from this file (not readable by other users).")
@click.option("--max-request-bytes", default=None, help="Largest request body, e.g. 32MiB [32MiB].")
@click.option("--request-timeout", type=float, default=None,
              help="Seconds a client may take to send a request (its head: at most 5), or to take a reply [30].")
@click.option("--port", type=int, default=None, help="HTTP port; 0 picks a free one [8080].")
@click.option("--quantum", type=float, default=None, help="Minimum seconds to hold the GPU before yielding [0.25].")
@click.option("--max-hold", type=float, default=None, help="Seconds after which a busy holder yields between "
              "requests when someone waits [5].")
@click.option("--residency", type=click.Choice(["cache", "exclusive"]), default=None,
              help="cache: stay on the device after yielding while there is room, evicted only for a peer's "
                   "need; exclusive: on the device only while holding the token, as llama.cpp's arbiter [cache].")
@click.option("--pin", is_flag=True, default=None, help="Never evicted by vramd peers while parked.")
@click.option("--n-cpu-moe", "n_cpu_moe", default=None,
              help="Mixture-of-experts: keep the experts of this many layers on the host and compute them on "
                   "the CPU (fractions in thirds: 1.5, 4/3), or auto (the least that fits --vram-budget).")
@click.option("--prefill-chunk", type=int, default=None,
              help="Prompt tokens per forward pass: the scratch is sized for one chunk (device memory while "
                   "warm; `vramd plan --prefill-chunk` shows it); cut to what one storage binding holds "
                   "[the architecture's: 512, mixture-of-experts 64].")
@click.option("--mmproj", default=None, type=click.Path(dir_okay=False),
              help="Vision encoder (projector) GGUF: images in chat requests; kept in host memory and brought to "
                   "the device just in time for an encode.")
@click.option("--mmproj-resident", is_flag=True, default=None,
              help="Keep the vision encoder on the device (lower latency, less VRAM for the rest).")
@click.option("--wake-timeout", type=float, default=None,
              help="Seconds a request waits for the GPU before it fails with 503 [60].")
@click.option("--parallel", type=int, default=None,
              help="Generation slots, 1-16: requests generated together, each slot a sequence of --ctx tokens "
                   "in the KV cache [auto: 4, fewer where their KV cache does not fit the budget].")
@click.option("--cache-ram", type=int, default=None, metavar="MIB",
              help="Host memory (MiB) for the prompt cache: a conversation's K/V kept when another takes the slot, "
                   "brought back instead of prefilled again; least recently used first out; 0: none [256].")
@click.option("--max-queue", type=int, default=None,
              help="Generation requests that may wait for the slot; one more is a 503 with Retry-After [64].")
@click.option("--priority", type=int, default=None,
              help="Eviction priority; each point counts as 60 s of recency (ages like it) [0].")
@click.option("--log-level", default=None, help="debug, info, warning or error [info].")
@click.option("--log-format", default=None,
              help="text (key=value fields) or json (one object per line) [text].")
@click.option("--metrics-public", is_flag=True, default=None,
              help="Answer /metrics without the API key (for scrapers).")
@click.option("--alias", "aliases", multiple=True, metavar="NAME",
              help="Another name a request's model may give; listed in /v1/models as its own entry (repeatable).")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Let browser pages from ORIGIN (https://host[:port], or * for any) call the API: CORS "
                   "headers and preflight answers; without it, none (repeatable).")
def serve(model, config_file, **flags):
    """Serve MODEL.gguf: resident on the GPU only while it serves."""
    import logging
    from vramd import failpoints
    from vramd.server import config as config_mod
    from vramd.server.daemon import serve as run_daemon
    if os.environ.get("VRAMD_API_KEY") == "":
        # click takes an empty variable for an unset one: the API would be open.
        raise UsageError("VRAMD_API_KEY is set but empty, which would leave the API open; "
                         "give it the key, or unset it")
    if flags.get("vram_budget") is not None:
        flags["vram_budget"] = config_mod.parse_size(flags["vram_budget"], "--vram-budget")
    if flags.get("max_request_bytes") is not None:
        flags["max_request_bytes"] = config_mod.parse_size(flags["max_request_bytes"], "--max-request-bytes")
    if flags.get("api_key_file") is not None and \
            click.get_current_context().get_parameter_source("api_key") == click.core.ParameterSource.ENVIRONMENT:
        flags["api_key"] = None  # --api-key-file on the command line beats VRAMD_API_KEY
    for key in ("aliases", "cors_origins"):   # repeatable: () when not given, so that a config file's count
        flags[key] = list(flags[key]) or None
    flags["model"] = model
    cfg = config_mod.build(config_file, flags)
    from vramd.server import logs
    logs.configure(cfg.log_level, cfg.log_format)
    armed = failpoints.describe_armed()
    if armed:
        logging.getLogger("vramd").warning(
            "%s arms failpoints in this daemon: %s (fault injection for tests: `kill` SIGKILLs the daemon, "
            "`raise` fails the step); unset it outside tests", failpoints.ENV, armed)
    sys.exit(run_daemon(cfg))


def find_daemon(arena, name: str):
    from vramd.arena.members import Registry
    for m in Registry(arena.members_dir).list():
        if m.name == name and m.control:
            return m
    raise PeerError(f"no daemon named {name!r} in {arena.path} (see `vramd status`)")


@cli.command()
@arena_options
@click.argument("name")
@click.option("--timeout", type=click.FloatRange(min=0, max=86400), default=60.0, show_default=True,
              help="Seconds to wait for the GPU.")
def wake(arena_path, allow_shared_arena, name, timeout):
    """Make daemon NAME go warm now (it rings and waits its turn)."""
    from vramd.server.control import request
    arena = open_arena(arena_path, allow_shared_arena, create=False)
    reply = request(find_daemon(arena, name).control, "wake", wait=timeout + 5, timeout=timeout)
    if reply["was_cold"]:
        click.echo(f"{name} is warm (switch {reply['switch_ms']:.1f} ms, waited {reply['wait_ms']:.1f} ms)")
    else:
        click.echo(f"{name} was already warm")


# -- gateway ------------------------------------------------------------------------

@cli.command()
@arena_options
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="TOML file with the same keys as the flags, and [aliases] and [member_key_files] tables.")
@click.option("--host", default=None, help="HTTP address [127.0.0.1]; another address needs an API key to be safe.")
@click.option("--port", type=int, default=None, help="HTTP port; 0 picks a free one [11434, Ollama's].")
@click.option("--api-key", default=None, envvar="VRAMD_GATEWAY_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health.")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False),
              help="Read the API key from this file (not readable by other users).")
@click.option("--alias", "aliases", multiple=True, metavar="NAME=MODEL",
              help="Another name for a member (its name or file name); repeatable.")
@click.option("--member-key-file", "member_key_files", multiple=True, metavar="MEMBER=PATH",
              help="The API key of a daemon that has one (else the client's Authorization is sent); repeatable. "
                   "Needs a gateway key (--api-key/--api-key-file) or --allow-open.")
@click.option("--allow-open", is_flag=True, default=None,
              help="Serve member keys (--member-key-file) without a gateway key: anyone who reaches the "
                   "gateway may use those daemons.")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Let browser pages from ORIGIN (https://host[:port], or * for any) call the gateway: CORS "
                   "headers and preflight answers; without it, none (repeatable).")
@click.option("--request-timeout", type=float, default=None,
              help="Seconds a client may take to send a request, or to take a reply [30].")
@click.option("--upstream-timeout", type=float, default=None,
              help="Seconds a daemon may stay silent before its reply (GPU wait, prefill) [900].")
@click.option("--max-request-bytes", default=None, help="Largest request body, e.g. 32MiB [32MiB].")
@click.option("--log-level", default=None, help="debug, info, warning or error [info].")
@click.option("--log-format", default=None, help="text or json [text].")
def gateway(arena_path, allow_shared_arena, config_file, **flags):
    """One endpoint for every daemon of the arena: routes by "model", lists each with its state."""
    from vramd.gateway import config as gw_config
    from vramd.gateway.server import Gateway
    from vramd.server import logs
    from vramd.server.config import parse_size
    if os.environ.get("VRAMD_GATEWAY_API_KEY") == "":
        raise UsageError("VRAMD_GATEWAY_API_KEY is set but empty, which would leave the gateway open; "
                         "give it the key, or unset it")
    flags["aliases"] = gw_config.pairs(flags["aliases"], "--alias")
    flags["member_key_files"] = gw_config.pairs(flags["member_key_files"], "--member-key-file")
    flags["cors_origins"] = list(flags["cors_origins"]) or None   # () when not given: the file's list stays
    if flags.get("max_request_bytes") is not None:
        flags["max_request_bytes"] = parse_size(flags["max_request_bytes"], "--max-request-bytes")
    flags["arena"] = str(arena_path) if arena_path else None
    flags["allow_shared_arena"] = allow_shared_arena or None
    cfg = gw_config.build(config_file, flags)
    logs.configure(cfg.log_level, cfg.log_format)
    from vramd.errors import ArenaError
    try:   # only read: the system arena is read-only to the gateway's unit
        arena = open_arena(cfg.arena, cfg.allow_shared_arena, create=False)
    except ArenaError:   # a per-user arena no daemon made yet: made now, so daemons started later join it
        arena = open_arena(cfg.arena, cfg.allow_shared_arena)
    sys.exit(Gateway(cfg, arena.members_dir).run())


# -- plan ---------------------------------------------------------------------------

@cli.command()
@click.argument("model", type=click.Path(path_type=str))
@click.option("--n-cpu-moe", "n_cpu_moe", default=None,
              help="Expert layers kept on the host: a number >= 0, fractions in thirds (1.5, 4/3).")
@click.option("--vram-budget", default=None, help="Find the smallest --n-cpu-moe (steps of 1/3) that fits.")
@click.option("--ctx", type=click.IntRange(min=1, max=1 << 20), default=None,
              help="Context length [the file's; with --vram-budget, what `vramd serve` would choose there].")
@click.option("--mmproj", default=None, type=click.Path(dir_okay=False, path_type=str),
              help="Vision encoder (projector) GGUF: its bytes too.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
              help="Tokens per prefill chunk, as `vramd serve --prefill-chunk`: the scratch it implies "
                   "[the architecture's].")
@click.option("--max-buffer", default=None,
              help="The device's maxStorageBufferRange (e.g. 4GiB for an H200): a prefill chunk is cut so that "
                   "no activation buffer passes it, as `vramd serve` cuts it on that device [128MiB, the Vulkan "
                   "minimum (lavapipe's)].")
@click.option("--parallel", type=click.IntRange(min=1, max=16), default=None,
              help="Generation slots, each a sequence of --ctx positions in the KV cache, as `vramd serve "
                   "--parallel` [4, as serve's auto where they fit; 1 with --vram-budget, as serve under "
                   "--n-cpu-moe auto].")
@click.option("--json", "as_json", is_flag=True)
def plan(model, n_cpu_moe, vram_budget, ctx, mmproj, prefill_chunk, max_buffer, parallel, as_json):
    """Where each tensor of MODEL goes (device or host), and the totals: what `vramd serve` allocates."""
    from vramd.model.footprint import footprint
    from vramd.model.gguf_check import validate_gguf
    from vramd.server.config import parse_size
    if n_cpu_moe is not None and vram_budget is not None:
        raise UsageError("give --n-cpu-moe or --vram-budget, not both")
    if n_cpu_moe is not None and n_cpu_moe.strip() == "auto" and vram_budget is None:
        raise UsageError("--n-cpu-moe auto needs --vram-budget here")
    mf = validate_gguf(model)
    budget = None if vram_budget is None else parse_size(vram_budget, "--vram-budget")
    cap = None if max_buffer is None else plan_max_buffer(max_buffer)
    if ctx is None:
        ctx = plan_ctx(mf, budget)
    if parallel is None:
        from vramd.server.slots import DEFAULT_PARALLEL
        parallel = 1 if budget is not None else DEFAULT_PARALLEL
    fp = footprint(mf, ctx, n_cpu_moe="auto" if budget is not None else n_cpu_moe, budget=budget,
                   mmproj=validate_gguf(mmproj) if mmproj else None, chunk=prefill_chunk, max_buffer=cap,
                   n_seq=parallel)
    if not fp.plan.has_experts and n_cpu_moe is not None:
        click.echo(f"note: {model} has no expert tensors; --n-cpu-moe changes nothing", err=True)
    if as_json:
        click.echo(json.dumps(fp.to_json(), indent=2))
    else:
        print_plan(fp, ctx, bool(mmproj), parallel)
    if not fp.runnable:
        # The plan is printed (the loader's scratch estimate), but the answer to "will it run" is no.
        from vramd.engine.arch import spec_for
        try:
            spec_for(mf)
        except VramdError as e:
            why = str(e).removeprefix(f"{model}: ")
            raise ModelError(f"{model}: the engine does not run it ({why}): vramd serve refuses it") from None


def plan_max_buffer(text) -> int:
    """--max-buffer: a size between Vulkan's least maxStorageBufferRange (2^27) and its most (2^32 - 1);
    "4GiB" means the most (what an H200 says)."""
    from vramd.server.config import parse_size
    n = parse_size(text, "--max-buffer")
    n = (1 << 32) - 1 if n == 1 << 32 else n
    if not (1 << 27) <= n < 1 << 32:
        raise UsageError(f"--max-buffer {text}: a maxStorageBufferRange, between 128MiB and 4GiB")
    return n


def plan_ctx(mf, budget: int | None) -> int:
    """plan's --ctx default, as serve picks it: the file's context length; with a budget (which
    places the experts: --n-cpu-moe auto) the file's capped at DEFAULT_CTX, as serve does then."""
    from vramd.model.footprint import DEFAULT_CTX, file_context_length
    trained = min(file_context_length(mf) or DEFAULT_CTX, 1 << 20)
    return min(trained, DEFAULT_CTX) if budget is not None else trained


def print_plan(fp, ctx: int, mmproj: bool, parallel: int = 1) -> None:
    width = max((len(t["name"]) for t in fp.plan.tensors), default=0)  # a file may hold no tensors
    for t in fp.plan.tensors:
        click.echo(f"{t['name']:<{width}}  {t['placement']:6s}  {human_bytes(t['bytes']):>10}")
    d, host = fp.device, fp.host
    rec = fp.recurrent_bytes   # a recurrent state (qwen35) shares the state region with K/V
    slots = f" in each of {parallel} slots" if parallel > 1 else ""
    state = (f"KV {human_bytes(d['state'] - rec)} for --ctx {ctx}{slots} + recurrent state {human_bytes(rec)}" if rec
             else f"KV {human_bytes(d['state'])} for --ctx {ctx}{slots}")
    device = (f"device {human_bytes(fp.device_bytes)} (weights {human_bytes(d['weights'])}, {state}, "
              f"scratch {human_bytes(d['scratch'])}" + (f" for prefill chunks of {fp.chunk} tokens)" if fp.chunk else ")"))
    if fp.plan.has_experts:
        click.echo(f"\n--n-cpu-moe {fp.plan.n_cpu_moe:g}: {device}, host {human_bytes(sum(host.values()))} "
                   f"(experts {human_bytes(host['experts'])})")
    else:   # a dense model: experts are no question here
        click.echo(f"\n{device}, host {human_bytes(sum(host.values()))} (the shadows going cold copies into)")
    if mmproj:
        click.echo(f"--mmproj: encoder {human_bytes(d['encoder'])} in host memory, on the device with "
                   f"{human_bytes(fp.encode_scratch)} of activations while it encodes")
    if fp.chunk:
        why = {"given": "--max-buffer", "device": "the device's maxStorageBufferRange",
               "assumed": "assumed: the Vulkan minimum, lavapipe's; give --max-buffer for a larger device's"}
        click.echo(f"prefill chunk cap: one activation buffer at most {human_bytes(fp.max_buffer)} "
                   f"({why[fp.max_buffer_source]})")


# -- exec -------------------------------------------------------------------------

@cli.command(name="exec", context_settings={"ignore_unknown_options": True})
@arena_options
@click.option("--name", default=None, help="Member name shown by `vramd status` (default: the command).")
@click.option("--timeout", type=click.FloatRange(min=0, max=86400), default=None,
              help="Give up (exit 1) if the GPU is not free within this many seconds.")
@click.option("--vram", "need", default=None,
              help="Device memory the job needs, e.g. 20GiB: parked daemons are evicted (least recently used "
                   "first) until that much of the arena's budget is free, once the job holds the token.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(arena_path, allow_shared_arena, name, timeout, need, command):
    """Run COMMAND holding the GPU token; release it when COMMAND exits.

    Rings, waits its turn, runs the command, and exits with its exit code
    (128+N if it died of signal N).  SIGINT, SIGTERM and SIGHUP are forwarded.
    A command that does not exist is refused (127, 126 not executable) before
    the token is taken: nobody is made to yield for it.
    """
    from vramd.arena.arbiter import Participant
    from vramd.server.config import parse_size
    nbytes = None if need is None else parse_size(need, "--vram")
    check_command(command[0])
    arena = open_arena(arena_path, allow_shared_arena)
    # The room is made as a daemon's restore makes it (asking without the token, then taking it again).
    participant = Participant(arena, name or os.path.basename(command[0]), model="(exec)",
                              restore=None if nbytes is None else (lambda: room.make(nbytes)))
    room = None if nbytes is None else JobRoom(participant)
    sys.exit(run_holding(participant, list(command), timeout))


def check_command(cmd: str) -> None:
    """What a shell would say before running `cmd`: not found (127) or not executable (126)."""
    import shutil
    if "/" not in cmd:
        if shutil.which(cmd) is None:
            raise VramdCommandError(f"{cmd}: command not found", 127)
        return
    if not os.path.exists(cmd):
        raise VramdCommandError(f"{cmd}: command not found", 127)
    if os.path.isdir(cmd) or not os.access(cmd, os.X_OK):
        raise VramdCommandError(f"{cmd}: permission denied (not an executable file)", 126)


class JobRoom:
    """`vramd exec --vram`'s restore: parked daemons asked to evict, in the arena's eviction
    order, until `need` bytes of the budget their records publish are free: the Room's own
    policy (vramd/server/room.py), for a job that holds nothing itself, so the asking is done
    without the token (a StepAside), as a daemon's is.  Without a published budget
    (no daemon), the parked members' bytes are all that can be counted: they give up `need`."""

    def __init__(self, participant):
        from vramd.arena.members import Registry
        from vramd.server.room import Room
        registry = Registry(participant.arena.members_dir)

        def others():
            return [m for m in registry.list(clean=False) if m.pid != os.getpid()]

        self.others = others
        self.room = Room(participant.member.name, _NothingResident(), [], 0, members=others,
                         is_member=lambda pid: registry.read(pid) is not None, token=participant.token,
                         sample=lambda: {})

    def make(self, need: int) -> None:
        budgets = [m.budget for m in self.others() if m.budget > 0]
        room = self.room
        room.budget = min(budgets) if budgets else 0
        if budgets:
            room.make_room(need, refuse=False)   # short: warned below, and the job runs
        else:
            room.make_room_counted(need)
        free = room.free_bytes()
        if budgets and free < need:
            click.echo(f"vramd: warning: {human_bytes(free)} of the arena's budget free after evicting, "
                       f"{human_bytes(need)} asked (--vram): pinned or unanswering members keep theirs", err=True)


class _NothingResident:
    """The residency of a job that holds no vramd buffers (make_room's Room)."""

    def breakdown(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {"reclaim_pending_bytes": 0}


def in_terminal_foreground() -> bool:
    """Is our process group the foreground group of our terminal (so it got the tty's signals)?"""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


PR_SET_PDEATHSIG = 1   # linux/prctl.h


def die_with_us():
    """A preexec_fn: the child gets SIGKILL when we die, even by SIGKILL.  Our token dies with
    us (the kernel drops the flock); a child computing on after that would share the GPU with
    the next holder unseen.  (PR_SET_PDEATHSIG survives exec, except of set-user-ID programs.)"""
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def in_child():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:   # we died before the prctl: nothing would signal it
            os.kill(os.getpid(), signal.SIGKILL)
    return in_child


def run_holding(participant, command: list[str], timeout: float | None) -> int:
    child: list[subprocess.Popen] = []
    # At a terminal the child shares our process group, so it keeps the
    # terminal and gets Ctrl-C from it directly.  Otherwise it gets a group of
    # its own, so a signal sent to our group reaches it once: through us.
    interactive = in_terminal_foreground()

    def forward(signum, _frame):
        # Only pass the signal on; all cleanup happens on the main path.
        if not child:
            raise SystemExit(128 + signum)
        if signum == signal.SIGINT and interactive:
            return  # Ctrl-C already reached the child (same process group): do not send it twice
        child[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with participant:
            participant.ensure_warm(timeout)
            try:
                child.append(subprocess.Popen(command, process_group=None if interactive else 0,
                                              preexec_fn=die_with_us()))
            except FileNotFoundError:
                raise VramdCommandError(f"{command[0]}: command not found", 127) from None
            except PermissionError:
                raise VramdCommandError(f"{command[0]}: permission denied", 126) from None
            rc = child[0].wait()
        return rc if rc >= 0 else 128 - rc
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class VramdCommandError(VramdError):
    """exec could not start its command; codes as a shell gives them."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = code


# -- arena ------------------------------------------------------------------------

@cli.group()
def arena():
    """Manage arenas."""


@arena.command(name="init")
@click.option("--path", type=click.Path(path_type=Path), default=Path("/run/vramd"), show_default=True)
@click.option("--group", required=True, help="Group whose members (the daemons) may take the token.")
@click.option("--ring-group", default=None, help="Group that may only ring the doorbell (default: --group).")
@click.option("--user", default=None,
              help="The daemons' user, owner of doorbell/ so that it may remove any ring file there "
                   "(default: the user named like --group, else root).")
def arena_init(path, group, ring_group, user):
    """Lay out a system arena shared by a group (run as root)."""
    from vramd.arena.layout import doorbell_owner, init_system_arena
    uid, owner = doorbell_owner(user, group)
    a = init_system_arena(path, group, ring_group, uid)
    click.echo(f"arena ready at {a.path} (token group {group}, ring group {ring_group or group}, "
               f"doorbell owned by {owner})")
    if uid == 0:
        click.echo(f"vramd: warning: {a.path}/doorbell belongs to root: a daemon not running as root cannot remove "
                   "a ring file another user left under its pid (pass --user with the daemons' user)", err=True)


# -- bench ------------------------------------------------------------------------

class BenchGroup(click.Group):
    """`vramd bench NAME` imports vramd.bench.NAME only when asked (they pull in Vulkan)."""

    def list_commands(self, ctx):
        from vramd.bench import NAMES
        return list(NAMES)

    def get_command(self, ctx, name):
        from vramd.bench import NAMES
        if name not in NAMES:
            return None
        return importlib.import_module(f"vramd.bench.{name}").command


@cli.group(cls=BenchGroup)
def bench():
    """Benchmarks (docs/benchmarks.md records their results)."""


# -- entry point ------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="vramd", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("vramd: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except VramdError as e:
        click.echo(f"vramd: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("vramd: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except (MemoryError, RuntimeError) as e:
        # Host memory or threads ran out (under `ulimit -v` a thread's stack is address space):
        # one line that says so, not a traceback.  Anything else is a bug and keeps its traceback.
        if isinstance(e, RuntimeError) and "can't start new thread" not in str(e):
            raise
        click.echo(f"vramd: out of host memory: {e or type(e).__name__}{address_space_hint()}", err=True)
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


def address_space_hint() -> str:
    import resource
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return ""
    return f" (the address-space limit, ulimit -v / systemd's LimitAS=, is {soft >> 20} MiB: raise it)"


if __name__ == "__main__":
    main()

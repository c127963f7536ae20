"""Hostile arenas: planted symlinks, FIFOs and directories, a replaced token, open permissions."""

import fcntl
import json
import os
import threading
import time

import pytest

from vramd.arena import doorbell
from vramd.arena.layout import Arena
from vramd.arena.members import Member, Registry
from vramd.arena.token import Token
from vramd.errors import ArenaError, TokenError


def test_symlinked_token_is_refused_and_its_target_untouched(arena_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    arena_dir.mkdir(mode=0o700)
    (arena_dir / "token.lock").symlink_to(victim)
    with pytest.raises((ArenaError, TokenError), match="symlink"):
        Arena.open(arena_dir)
    with pytest.raises((ArenaError, TokenError), match="symlink"):
        Token(arena_dir / "token.lock").try_acquire()
    assert victim.read_text() == "precious"


def test_fifo_token_is_refused_without_hanging(arena_dir):
    arena_dir.mkdir(mode=0o700)
    os.mkfifo(arena_dir / "token.lock")
    t0 = time.monotonic()
    with pytest.raises((ArenaError, TokenError), match="not a regular file"):
        Arena.open(arena_dir)
    assert time.monotonic() - t0 < 5


def test_directory_token_is_refused(arena_dir):
    (arena_dir / "token.lock").mkdir(parents=True)
    os.chmod(arena_dir, 0o700)
    with pytest.raises((ArenaError, TokenError), match="not a regular file|directory"):
        Arena.open(arena_dir)


def test_symlinked_arena_and_subdirectory_are_refused(tmp_path):
    real = tmp_path / "real"
    Arena.open(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ArenaError, match="symlink"):
        Arena.open(link)
    assert Arena.open(link, allow_shared=True).shared  # explicitly trusted

    other = tmp_path / "elsewhere"
    other.mkdir()
    os.rename(real / "doorbell", tmp_path / "old-doorbell")
    (real / "doorbell").symlink_to(other)
    with pytest.raises(ArenaError, match="symlink"):
        Arena.open(real)


def test_world_writable_arena_needs_explicit_consent(arena_dir):
    arena_dir.mkdir()
    os.chmod(arena_dir, 0o777)  # what llama.cpp's mkdir(…, 0777) makes under umask 0
    with pytest.raises(ArenaError, match="world-writable.*--allow-shared-arena"):
        Arena.open(arena_dir)
    arena = Arena.open(arena_dir, allow_shared=True)
    assert arena.shared
    assert Token(arena.token_path).try_acquire()


def test_replaced_token_is_detected_after_acquire(arena_dir):
    arena = Arena.open(arena_dir)
    holder = Token(arena.token_path)
    assert holder.try_acquire()
    waiter = Token(arena.token_path)
    result = {}

    def wait():
        try:
            waiter.acquire(timeout=10)
            result["ok"] = True
        except TokenError as e:
            result["error"] = str(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)  # the waiter is blocked on the old inode
    os.rename(arena.token_path, arena_dir / "old.lock")
    arena.token_path.write_text("")
    with pytest.raises(TokenError, match="replaced"):
        holder.check()
    holder.release()
    t.join(10)
    assert "replaced" in result.get("error", ""), result
    assert not waiter.held


def test_planted_ring_file_at_our_name_is_replaced(arena_dir):
    arena = Arena.open(arena_dir)
    mine = arena.doorbell_dir / str(os.getpid())
    os.mkfifo(mine)
    doorbell.ring(arena.doorbell_dir)  # must neither hang nor fail
    assert mine.read_text() == "1"
    os.unlink(mine)
    mine.symlink_to(arena_dir / "token.lock")
    doorbell.ring(arena.doorbell_dir)
    assert not mine.is_symlink() and (arena_dir / "token.lock").read_text() == ""


def test_malformed_and_planted_member_records_are_skipped(arena_dir):
    arena = Arena.open(arena_dir)
    reg = Registry(arena.members_dir)
    me = Member(name="me", pid=os.getpid(), start_time=__import__("psutil").Process().create_time())
    reg.write(me)
    os.mkfifo(arena.members_dir / "1.json")                      # would block a naive reader
    (arena.members_dir / "2.json").write_text("{not json")
    (arena.members_dir / "3.json").write_text(json.dumps({"name": 5, "pid": "x"}))
    (arena.members_dir / "4.json").write_bytes(b"x" * (1 << 20))  # oversize
    t0 = time.monotonic()
    assert [m.name for m in reg.list()] == ["me"]
    assert time.monotonic() - t0 < 5


def test_foreign_pid_reuse_of_a_member_record_is_stale(arena_dir):
    arena = Arena.open(arena_dir)
    reg = Registry(arena.members_dir)
    reg.write(Member(name="ghost", pid=os.getpid(), start_time=1.0))  # wrong start time
    assert reg.list() == []
    assert not reg.path_for(os.getpid()).exists()


def test_token_fd_is_not_inherited_by_exec(arena_dir):
    arena = Arena.open(arena_dir)
    t = Token(arena.token_path)
    assert t.try_acquire()
    assert fcntl.fcntl(t._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC


def test_planted_tickets_neither_block_nor_count(arena_dir):
    from vramd.arena.queue import Queue
    arena = Arena.open(arena_dir)
    q = Queue(arena.queue_dir)
    victim = arena_dir / "victim"
    victim.write_text("precious")
    # Ticket-shaped names ahead of everyone: a symlink (to a file nobody
    # holds), a FIFO, a directory.  None is a live ticket, none blocks.
    (arena.queue_dir / "0000000000000001-1").symlink_to(victim)
    os.mkfifo(arena.queue_dir / "0000000000000002-1")
    (arena.queue_dir / "0000000000000003-1").mkdir()
    t0 = time.monotonic()
    ticket = q.take()
    try:
        assert q.live() == [(ticket.number, os.getpid())]
        assert q.wait_turn(ticket, timeout=5)
    finally:
        q.done(ticket)
    assert time.monotonic() - t0 < 5
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("plant", ["symlink", "fifo", "dir"])
def test_planted_ticket_issue_lock_is_refused(arena_dir, plant):
    from vramd.arena.queue import Queue
    arena = Arena.open(arena_dir)
    lock = arena.queue_dir / ".issue.lock"
    {"symlink": lambda: lock.symlink_to(arena_dir / "token.lock"), "fifo": lambda: os.mkfifo(lock),
     "dir": lambda: lock.mkdir()}[plant]()
    t0 = time.monotonic()
    with pytest.raises(ArenaError, match=r"\.issue\.lock: .*(symlink|not a regular file|directory)"):
        Queue(arena.queue_dir).take()
    assert time.monotonic() - t0 < 5


def test_planted_hard_link_at_our_ring_name_keeps_its_target(arena_dir):
    arena = Arena.open(arena_dir)
    victim = arena_dir / "victim"
    victim.write_text("precious")
    mine = arena.doorbell_dir / str(os.getpid())
    os.link(victim, mine)
    doorbell.ring(arena.doorbell_dir)
    assert victim.read_text() == "precious"      # not truncated, not written
    assert mine.read_text() == "1" and os.stat(mine).st_nlink == 1


@pytest.mark.parametrize("plant", ["symlink", "fifo", "dir"])
def test_planted_control_files_are_refused(arena_dir, plant):
    from vramd.errors import PeerError
    from vramd.server.control import ControlServer
    arena = Arena.open(arena_dir)
    victim = arena_dir / "victim"
    victim.write_text("precious")
    for name in ("d.lock", "d.sock"):
        target = arena.control_dir / name
        {"symlink": lambda: target.symlink_to(victim), "fifo": lambda: os.mkfifo(target),
         "dir": lambda: target.mkdir()}[plant]()
        t0 = time.monotonic()
        with pytest.raises((ArenaError, PeerError), match=rf"{name}: .*(symlink|not a regular file|directory|"
                                                          "not a socket)"):
            ControlServer(arena.control_dir / "d.sock", lambda r: {"ok": True})
        assert time.monotonic() - t0 < 5
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
        else:
            target.unlink()
    assert victim.read_text() == "precious" and oct(victim.stat().st_mode & 0o777) != "0o660"


def test_system_arena_init_does_not_follow_a_planted_symlink(tmp_path):
    if os.getuid() != 0:
        pytest.fail("arena init changes groups: run the suite as root (CI does)")
    victim = tmp_path / "victim-dir"
    victim.mkdir(mode=0o700)
    arena = tmp_path / "sys"
    arena.mkdir(mode=0o755)
    (arena / "members").symlink_to(victim)
    from vramd.arena.layout import init_system_arena
    with pytest.raises(ArenaError, match="members: exists and is not a directory"):
        init_system_arena(arena, "daemon", None)
    st = os.stat(victim)
    assert oct(st.st_mode & 0o7777) == "0o700" and st.st_gid == 0  # no chmod, no chgrp through the link

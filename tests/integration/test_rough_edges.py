"""Issue 21, item 6: the CLI's rough edges, each as a user meets it (real processes, real exit codes).

The command a user mistyped is refused before anything changes: no token
taken, no second arena made, no ring under a dead pid; the hints say what to
do about the actual cause.
"""

import json
import os
import subprocess
import sys
import time

from tests.ggufgen.check import write_model
from vramd.arena.members import Registry

from .conftest import ROOT, SHAPE, daemon_env


def vramd(*args, timeout=60, **env):
    return subprocess.run([sys.executable, "-m", "vramd.cli", *args], capture_output=True, text=True,
                          env=daemon_env(**env), cwd=ROOT, timeout=timeout)


def test_exec_refuses_a_missing_command_before_it_takes_the_token(arena, models, daemons):
    a = daemons(arena, models[0], "alpha")
    yields = a.member().yields
    r = vramd("exec", "--arena", str(arena), "--", "no-such-command-vramd")
    assert r.returncode == 127 and "no-such-command-vramd: command not found" in r.stderr, r.stderr
    r = vramd("exec", "--arena", str(arena), "--", str(arena))   # a directory: not executable
    assert r.returncode == 126 and "permission denied" in r.stderr, r.stderr
    assert a.member().yields == yields and a.member().state == "warm"   # nobody was asked to yield


def test_exec_vram_evicts_parked_members_to_make_the_room(arena, models, daemons):
    from .conftest import planned
    one = planned(models[0]).device_bytes
    budget = str(int(one * 2.5))
    a = daemons(arena, models[0], "alpha", "--vram-budget", budget)
    b = daemons(arena, models[1], "beta", "--vram-budget", budget)
    b.ask("wake")
    a.ask("wake")   # both on the device: beta parked, alpha warm
    members = {m.name: m for m in Registry(arena / "members").list()}
    assert members["alpha"].device_bytes() and members["beta"].device_bytes()
    before = sum(m.device_bytes() for m in members.values())
    r = vramd("exec", "--arena", str(arena), "--", "true")   # without --vram: parked members keep theirs
    assert r.returncode == 0, r.stderr
    held = {m.name: m.device_bytes() for m in Registry(arena / "members").list()}
    assert all(held.values()), (before, held)
    # The job needs all but what one of them holds: the least recently used (beta) goes, alpha stays.
    need = int(budget) - held["alpha"]
    r = vramd("exec", "--arena", str(arena), "--vram", str(need), "--", "true")
    assert r.returncode == 0, r.stderr
    after = {m.name: m.device_bytes() for m in Registry(arena / "members").list()}
    assert after["beta"] == 0 and after["alpha"] == held["alpha"], (before, held, after)


def test_serve_arena_whose_parent_does_not_exist_is_an_error(tmp_path, models):
    typo = tmp_path / "no-such-dir" / "arena"
    r = vramd("serve", str(models[0]), "--arena", str(typo), "--port", "0")
    assert r.returncode == 3 and "does not exist" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not typo.parent.exists()


def test_status_on_an_empty_dir_and_on_tmp_say_what_is_wrong(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = vramd("status", "--arena", str(empty))
    assert r.returncode == 3 and f"vramd serve MODEL --arena {empty}" in r.stderr, r.stderr
    assert "arena init" not in r.stderr   # the root command is not what a user arena needs
    r = vramd("status", "--arena", "/tmp")
    assert r.returncode == 3 and "world-writable" in r.stderr and "doorbell/: missing" not in r.stderr, r.stderr


def test_ring_for_a_pid_that_does_not_exist_is_an_error(arena):
    dead = subprocess.Popen(["true"])
    dead.wait()
    r = vramd("ring", "--arena", str(arena), "--pid", str(dead.pid))
    assert r.returncode == 2 and "no such process" in r.stderr, r.stderr
    assert not (arena / "doorbell" / str(dead.pid)).exists()


def test_arena_init_with_a_missing_group_exits_2_with_a_plain_message(tmp_path):
    r = vramd("arena", "init", "--path", str(tmp_path / "sys"), "--group", "nosuchgroup-vramd")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("vramd: --group nosuchgroup-vramd: no such group "
                                "(create it with groupadd, or systemd-sysusers)")


def test_host_not_on_this_machine_gets_the_matching_hint(arena, models):
    # 192.0.2.1 (TEST-NET-1) is on no interface here.
    r = vramd("serve", str(models[0]), "--arena", str(arena), "--port", "0", "--ctx", "64", "--host", "192.0.2.1",
              "--api-key", "k")
    # 2 here; 1 once the address may still come up (a unit started before the network): either way
    # the hint names the address, not the port.
    assert r.returncode in (1, 2), r.stderr
    assert "the address is not on this machine" in r.stderr and "--port" not in r.stderr.splitlines()[-1], r.stderr


def test_vram_budget_larger_than_the_device_is_clamped_with_a_word(arena, models, daemons):
    a = daemons(arena, models[0], "alpha", "--vram-budget", "1000TiB")
    assert "clamped to the device" in a.output
    budget = a.ask("status")["vram_budget"]
    assert a.member().budget < 1000 << 40 and budget == 1000 << 40   # the flag as given, the budget clamped


def test_a_directory_as_the_model_is_exit_7(tmp_path):
    for cmd in ("serve", "plan"):
        r = vramd(cmd, str(tmp_path))
        assert r.returncode == 7 and r.stderr.strip() == f"vramd: {tmp_path}: is a directory", r.stderr


def test_plan_exits_non_zero_for_an_architecture_the_engine_cannot_run_and_no_experts_for_dense(tmp_path, models):
    r = vramd("plan", str(models[0]), "--ctx", "64")
    assert r.returncode == 0, r.stderr
    assert "expert" not in r.stdout and "n-cpu-moe" not in r.stdout, r.stdout
    odd = write_model(tmp_path / "odd.gguf", seed=1, arch="gpt2", shape=SHAPE)
    r = vramd("plan", str(odd), "--ctx", "64")
    assert r.returncode == 7 and "the engine does not run it" in r.stderr, (r.returncode, r.stderr)
    r = vramd("plan", str(odd), "--ctx", "64", "--json")
    assert r.returncode == 7 and json.loads(r.stdout)["runnable"] is False


def test_bench_residency_clamps_the_link_copy_to_the_device():
    from vramd.bench.residency import GiB, clamp_link
    from vramd.gpu.device import Device
    said = []
    with Device() as dev:
        heap = max(h["size"] for h in dev.heaps if h["device_local"]) if any(
            h["device_local"] for h in dev.heaps) else max(h["size"] for h in dev.heaps)
        assert clamp_link(4.0, dev, said.append) == min(4.0, heap / 4 / GiB)
        assert clamp_link(heap * 2 / GiB, dev, said.append) == heap / 4 / GiB
    assert said and "clamped" in said[-1]

"""`vramd serve` as systemd and users start it: config files, bad input, sd_notify."""

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.ggufgen.check import GGUFImage
from vramd.arena.token import Token

from .conftest import ROOT, DaemonProc, daemon_env


def serve(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "vramd.cli", "serve", *args], capture_output=True, text=True,
                          env=env or daemon_env(), cwd=ROOT, timeout=timeout)


def assert_one_line_error(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("vramd: ")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("mutate, words", [
    (lambda b: b"GGUX" + b[4:], ["not a GGUF file"]),
    (lambda b: b[:len(b) // 3], ["beyond end of file"]),
    (lambda b: b[:4] + (99).to_bytes(4, "little") + b[8:], ["version"]),
    (lambda b: b[:8] + (2**62).to_bytes(8, "little") + b[16:], ["tensor count"]),
])
def test_malformed_model_is_rejected_with_one_line_and_exit_7(tmp_path, models, mutate, words):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(models[0].read_bytes()))
    arena = tmp_path / "arena"
    r = serve(str(bad), "--arena", str(arena), "--port", "0")
    assert_one_line_error(r, 7, str(bad), *words)
    assert not (arena / "members").exists() or os.listdir(arena / "members") == []


def test_missing_required_key_is_rejected(tmp_path, models):
    bad = GGUFImage.from_file(models[0]).drop_kv("llama.block_count").write(tmp_path / "nokey.gguf")
    r = serve(str(bad), "--arena", str(tmp_path / "arena"), "--port", "0")
    assert_one_line_error(r, 7, "block_count")


def test_bad_flags_and_config_keys(tmp_path, models):
    assert_one_line_error(serve(str(models[0]), "--ctx", "0"), 2, "ctx")
    assert_one_line_error(serve(str(models[0]), "--vram-budget", "lots"), 2, "--vram-budget")
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'model = "{models[0]}"\nctxx = 5\n')
    assert_one_line_error(serve("--config", str(cfg)), 2, "unknown key 'ctxx'")
    cfg.write_text('model = [1]\n')
    assert_one_line_error(serve("--config", str(cfg)), 2, "expected a string")
    cfg.write_text('model = "x\n')
    assert_one_line_error(serve("--config", str(cfg)), 2, "not valid TOML")
    assert_one_line_error(serve(str(models[0]), "--device", "7"), 5, "no Vulkan device 7")
    # This session's serve flags: a bad value is one line and exit 2, before the model is read.
    for flag, value, word in (("--pooling", "median", "--pooling"), ("--reasoning-format", "r1", "--reasoning-format"),
                              ("--cors-origin", "not an origin", "cors origin"), ("--alias", "", "alias")):
        r = serve(str(models[0]), flag, value)
        assert r.returncode == 2 and "Traceback" not in r.stderr and word in r.stderr, (flag, r.stderr)
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "serve", "--bogus"], capture_output=True, text=True,
                       env=daemon_env(), cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_config_file_with_flag_overrides(tmp_path, models, daemons):
    arena = tmp_path / "arena"
    cfg = tmp_path / "alpha.toml"
    cfg.write_text(f'model = "{models[0]}"\nname = "from-file"\narena = "{arena}"\nctx = 32\n'
                   f'evict-state = "always"\nvram_budget = "64MiB"\nport = 0\n')
    d = DaemonProc(arena, models[0], "from-flag", "--config", str(cfg))
    try:
        status = d.ask("status")
        assert status["name"] == "from-flag"            # the flag wins
        assert status["ctx"] == 64                        # DaemonProc passes --ctx 64
        assert status["evict_state"] == "always"          # from the file
        assert status["vram_budget"] == 64 * 2**20
    finally:
        d.stop()


def test_sd_notify_ready_status_watchdog_stopping(tmp_path, models):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    env = daemon_env(NOTIFY_SOCKET=str(path), WATCHDOG_USEC="400000")
    d = DaemonProc(tmp_path / "arena", models[0], "alpha", env=env)
    got: list[str] = []

    def until(pred, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(pred(m) for m in got):
                return
            got.extend(sock.recv(4096).decode().splitlines())
        raise AssertionError(f"not received; got {got}")

    until(lambda m: m == "READY=1")
    assert any(m.startswith("STATUS=warm") for m in got)
    until(lambda m: m == "WATCHDOG=1")
    n = sum(m == "WATCHDOG=1" for m in got)
    until(lambda m: m == "WATCHDOG=1" and sum(x == "WATCHDOG=1" for x in got) > n)  # keeps pinging
    d.proc.terminate()
    until(lambda m: m == "STOPPING=1")
    assert d.proc.wait(30) == 0
    assert Token(tmp_path / "arena" / "token.lock").holders() == []


def test_port_in_use_is_a_clear_error_before_touching_the_gpu(tmp_path, models, daemons):
    arena = tmp_path / "arena"
    a = daemons(arena, models[0], "alpha")
    port = a.member().endpoint.rsplit(":", 1)[1]
    r = serve(str(models[1]), "--name", "beta", "--arena", str(arena), "--port", port)
    assert_one_line_error(r, 2, f"127.0.0.1:{port}", "--port")
    assert a.member().state == "warm" and a.member().switches == 1  # never asked to yield


def test_bad_mmproj_and_n_cpu_moe_are_one_line_errors(tmp_path, models):
    arena = str(tmp_path / "arena")
    missing = tmp_path / "nope.gguf"
    assert_one_line_error(serve(str(models[0]), "--arena", arena, "--port", "0", "--mmproj", str(missing)),
                          7, str(missing))
    # A language model is not a projector: refused at load, naming the file, before the
    # device is opened (no Vulkan driver to be found: a later check would exit 5, not 7).
    no_icd = str(tmp_path / "no-such-icd.json")
    assert_one_line_error(serve(str(models[0]), "--arena", arena, "--port", "0", "--mmproj", str(models[1]),
                                env=daemon_env(VK_DRIVER_FILES=no_icd, VK_ICD_FILENAMES=no_icd)),
                          7, str(models[1]))
    assert_one_line_error(serve(str(models[0]), "--arena", arena, "--port", "0", "--n-cpu-moe", "-1"),
                          2, "--n-cpu-moe")
    assert_one_line_error(serve(str(models[0]), "--arena", arena, "--port", "0", "--n-cpu-moe", "lots"),
                          2, "--n-cpu-moe")
    assert not (tmp_path / "arena" / "members").exists() or os.listdir(tmp_path / "arena" / "members") == []

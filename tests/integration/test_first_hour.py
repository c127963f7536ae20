"""docs/operations.md's "The first hour", replayed command by command.

The commands are parsed from the section's code blocks, so the doc and this
test cannot drift: the ```toml blocks are the config files, every line of the
```sh blocks runs in order.  This machine runs no systemd as PID 1, so the
systemd steps are replaced by what they run: `systemctl enable --now vramd@X`
starts `vramd serve` with the unit's own ExecStart= arguments (read from
systemd/vramd@.service) and a real datagram notify socket, and waits for
READY=1 as systemctl does; `systemctl status` reads the last STATUS= the
daemon sent; `journalctl -u vramd@X` is the daemon's output; `systemctl stop`
is SIGTERM.  Everything else (`vramd ...`, `curl ... | grep ...`) runs in bash
as written, with the paths and ports of this test put in.
"""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.ggufgen.llama import write_llama

from .conftest import ROOT, daemon_env

DOC = ROOT / "docs" / "operations.md"
UNIT = ROOT / "systemd" / "vramd@.service"


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def exec_start() -> list[str]:
    line = next(l for l in UNIT.read_text().splitlines() if l.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Unit:
    """One vramd@NAME instance: the daemon and its notify socket (what PID 1 holds)."""

    def __init__(self, name: str, argv: list[str], env: dict, sockdir: Path):
        self.name, self.lines, self.notes = name, [], []
        self.addr = str(sockdir / f"{name}.notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.addr)
        self.proc = subprocess.Popen(argv, env=dict(env, NOTIFY_SOCKET=self.addr), cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._listen, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def _listen(self):
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            self.notes += data.decode().splitlines()

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        while "READY=1" not in self.notes:
            assert self.proc.poll() is None, f"vramd@{self.name} exited {self.proc.returncode}:\n" + \
                "\n".join(self.lines)
            assert time.monotonic() < deadline, "\n".join(self.lines)
            time.sleep(0.02)

    def status_line(self) -> str:
        return next((n.removeprefix("STATUS=") for n in reversed(self.notes) if n.startswith("STATUS=")), "")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self.sock.close()


@pytest.fixture
def place(tmp_path):
    short = Path(tempfile.mkdtemp(prefix="vramd-1h-"))   # AF_UNIX paths are short
    yield tmp_path, short
    import shutil
    shutil.rmtree(short, ignore_errors=True)


def test_the_first_hour_walkthrough_replays(place):
    tmp_path, short = place
    doc = section(DOC.read_text(), "The first hour")
    etc, arena, models = tmp_path / "etc", short / "arena", tmp_path / "srv"
    etc.mkdir()
    models.mkdir()
    ports = {}
    subst = []

    def put(text: str) -> str:
        for old, new in subst:
            text = text.replace(old, new)
        return text

    # The config files: the doc's, with this test's models and ports.
    configs = {}
    for lang, body in blocks(doc):
        if lang == "toml":
            name = re.match(r"# /etc/vramd/(\S+)\.toml", body).group(1)
            configs[name] = body
    assert set(configs) == {"chat", "task"}
    for i, (name, body) in enumerate(sorted(configs.items())):
        doc_model = re.search(r'model = "(\S+)"', body).group(1)
        write_llama(models / Path(doc_model).name, seed=40 + i, n_vocab=384, vocab="spm", context_length=2048)
        doc_port = re.search(r"port = (\d+)", body).group(1)
        ports[doc_port] = str(free_port())
        subst += [(f"localhost:{doc_port}", f"localhost:{ports[doc_port]}"), (f"port = {doc_port}",
                                                                               f"port = {ports[doc_port]}")]
    subst += [("/srv/models", str(models)), ("/etc/vramd", str(etc)), ("/run/vramd", str(arena))]
    for name, body in configs.items():
        (etc / f"{name}.toml").write_text(put(body))
    arena.mkdir()   # what systemd-tmpfiles makes (a user arena here: the test's uid is the units')

    env = daemon_env(PYTHONUNBUFFERED="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    env.pop("VRAMD_ARENA", None)
    units: dict[str, Unit] = {}
    outputs = []
    try:
        for lang, body in blocks(doc):
            if lang != "sh":
                continue
            for line in body.splitlines():
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                outputs.append(run_line(line, put, units, env, short))
    finally:
        for u in units.values():
            u.stop()

    # What the walkthrough says one sees:
    by_cmd = dict(outputs)
    journals = [out for cmd, out in outputs if cmd.startswith("journalctl")]
    journal = journals[0]
    assert re.search(r"\brequest method=POST path=/v1/chat/completions status=200 model=task\b", journals[1]), \
        journals[1]
    assert re.search(r"\bswitch reason=", journals[1]), journals[1]
    assert re.search(r"chat: --ctx 2048: the file's context length 2048", journal), journal
    assert "serving" in journal and f"localhost:{ports['8081']}".replace("localhost", "127.0.0.1") in journal
    statuses = [out for cmd, out in outputs if cmd.startswith("vramd status")]
    assert " chat " in statuses[0] and " task " in statuses[0]
    assert f"127.0.0.1:{ports['8081']}" in statuses[0] and "chat.gguf" in statuses[0]
    assert " task " not in statuses[-1] and " chat " in statuses[-1]   # stopped, and gone from the arena
    replies = [json.loads(out) for cmd, out in outputs if "/v1/chat/completions" in cmd]
    assert len(replies) == 2 and all(r["choices"][0]["message"]["role"] == "assistant" for r in replies)
    metrics = [out for cmd, out in outputs if "/metrics" in cmd]
    assert "vramd_requests_total" in metrics[0] and "vramd_switch_seconds_count" in metrics[1]
    assert any("Status: warm" in out for cmd, out in outputs if cmd.startswith("systemctl status"))
    assert by_cmd


def settle(units, quiet=0.3, limit=10.0):
    """Until the units' output has been still for `quiet` s: a request line is written as its reply
    ends, after curl has its answer, and reaches us through the output pump."""
    deadline, last, still = time.monotonic() + limit, None, time.monotonic()
    while time.monotonic() < deadline:
        now = sum(len(u.lines) for u in units)
        if now != last:
            last, still = now, time.monotonic()
        elif time.monotonic() - still >= quiet:
            return
        time.sleep(0.02)


def run_line(line: str, put, units: dict, env: dict, short: Path) -> tuple[str, str]:
    """One command of the walkthrough; returns (the command, what it printed).  Fails on a non-zero exit."""
    words = shlex.split(line, comments=True)
    if words[0] == "systemctl":
        action, names = words[1], [w.removeprefix("vramd@") for w in words[2:] if w.startswith("vramd@")]
        if action == "enable":
            assert "--now" in words
            for name in names:
                argv = [put(a.replace("%i", name)) for a in exec_start()]
                assert argv[0] == "/usr/local/bin/vramd"
                units[name] = Unit(name, [sys.executable, "-m", "vramd.cli", *argv[1:]], env, short)
            for name in names:   # systemctl returns once each is READY=1 (Type=notify)
                units[name].wait_ready()
            return line, ""
        if action == "status":
            out = []
            for name in names:
                assert units[name].proc.poll() is None, f"vramd@{name} is not running"
                out.append(f"vramd@{name}.service\n     Active: active (running)\n     Status: "
                           f"{units[name].status_line()}")
                assert units[name].status_line(), units[name].notes
            return line, "\n".join(out)
        if action == "stop":
            for name in names:
                assert units[name].stop() == 0, "\n".join(units[name].lines)
                assert "STOPPING=1" in units[name].notes
                del units[name]
            return line, ""
        raise AssertionError(f"the walkthrough uses systemctl {action}, which this replay does not know")
    if words[0] == "journalctl":
        names = [words[i + 1].removeprefix("vramd@") for i, w in enumerate(words) if w == "-u"]
        settle([units[name] for name in names])
        out = "\n".join(l for name in names for l in units[name].lines)
        if "-n" in words:
            out = "\n".join(out.splitlines()[-int(words[words.index("-n") + 1]):])
        assert out, line
        return line, out
    r = subprocess.run(["bash", "-c", "set -o pipefail; " + put(line)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, (line, r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    return line, r.stdout


def test_the_docs_list_every_serve_flag_every_bench_and_a_max_tokens_in_every_chat_example():
    from vramd.bench import NAMES
    from vramd.cli import serve
    ops, readme = DOC.read_text(), (ROOT / "README.md").read_text()
    table = section(ops, "The daemon: `vramd serve`")
    for p in serve.params:
        for flag in p.opts:
            if flag.startswith("--"):
                assert f"`{flag}" in table, f"{flag} is not in docs/operations.md's table of serve flags"
    assert "bench " + "|".join(sorted(NAMES)) in readme, "README's bench list"
    assert "bench " + "|".join(sorted(NAMES)) in ops, "docs/operations.md's bench list"
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            if "/v1/chat/completions" in line and " -d " in line:
                assert "max_tokens" in line, f"{path.name}: a chat example without max_tokens: {line}"
    assert "A long generation pauses between two\nsteps when a peer rings" in readme
    assert "### What one long request does to the other models" in ops

"""The gateway's parts without daemons: its routing table over real member records, the Ollama
mapping, its configuration, and its systemd unit checked by systemd-analyze."""

import json
import os
import shutil
import subprocess
import time
import sys
from pathlib import Path

import pytest

from vramd.arena.members import Member, Registry, process_start_time
from vramd.errors import UsageError
from vramd.gateway import config, ollama, residency
from vramd.gateway.table import Ambiguous, MemberGone, Table, Target, UnknownModel

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "vramd-gateway.service"
REAL_EXEC = "/usr/local/bin/vramd"


# --- the routing table ------------------------------------------------------------

def record(registry, name, model, pid, state="cold", port=9000, aliases=()):
    registry.write(Member(name=name, pid=pid, start_time=process_start_time(pid) or 0.0, model=model, state=state,
                          endpoint=f"http://127.0.0.1:{port}", aliases=list(aliases)))


@pytest.fixture
def children():
    procs = []

    def spawn():
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        procs.append(p)
        return p
    yield spawn
    for p in procs:
        p.kill()
        p.wait()


def test_table_routes_names_files_aliases_and_knows_the_dead(tmp_path, children):
    registry = Registry(tmp_path)
    a, b, c = children(), children(), children()
    record(registry, "chat", "qwen.gguf", a.pid, "warm")
    record(registry, "task", "gemma.gguf", b.pid, "warming")
    record(registry, "old", "old.gguf", c.pid, "parked")
    table = Table(tmp_path, {"gpt-4o": "chat", "small": "gemma.gguf", "stale": "nowhere"}, refresh_s=60)
    assert table.resolve("chat").pid == a.pid
    assert table.resolve("qwen.gguf").name == "chat"
    assert table.resolve("gpt-4o").name == "chat" and table.resolve("small").name == "task"
    assert table.resolve("chat:latest").name == "chat"
    assert {t.name: t.state for t in table.members()} == {"chat": "warm", "task": "loading", "old": "parked"}
    with pytest.raises(UnknownModel, match=r"known models: chat, gemma.gguf, gpt-4o, old, old.gguf, qwen.gguf, "
                                           r"small, stale, task"):
        table.resolve("nope")
    # A member that joins is found at once, though the table was read a moment ago (refresh_s=60).
    d = children()
    record(registry, "new", "new.gguf", d.pid)
    assert table.resolve("new").pid == d.pid
    # One that dies: a 503 naming it, by its name and by its file's, also for a table that never saw it.
    c.kill()
    c.wait()
    table.members(fresh=True)   # what the gateway does when a member does not answer
    for t in (table, Table(tmp_path)):
        for name in ("old", "old.gguf"):
            with pytest.raises(MemberGone, match=rf"member 'old' \(pid {c.pid}.*not running"):
                t.resolve(name)
    registry.remove(c.pid)   # cleaned up by a peer: the table that saw it still knows
    with pytest.raises(MemberGone):
        table.resolve("old")
    with pytest.raises(UnknownModel):
        Table(tmp_path).resolve("old")
    # Two members serving files of one name: the file name is no route, their names are.
    e = children()
    record(registry, "twin", "qwen.gguf", e.pid)
    table.members(fresh=True)   # (refresh_s has not passed)
    with pytest.raises(Ambiguous, match="chat, twin"):
        table.resolve("qwen.gguf")
    assert table.resolve("twin").pid == e.pid


def test_member_aliases_from_the_records_are_routed_and_listed(tmp_path, children):
    registry = Registry(tmp_path)
    a, b, c = children(), children(), children()
    record(registry, "chat", "qwen.gguf", a.pid, "warm", aliases=("gpt-4o-mini", "qwen"))
    record(registry, "task", "gemma.gguf", b.pid, aliases=("small", "qwen"))
    # A record written before members had aliases (no such key) is read as one without any.
    old = Member(name="old", pid=c.pid, start_time=process_start_time(c.pid), model="old.gguf",
                 endpoint="http://127.0.0.1:9002").to_json()
    del old["aliases"]
    (tmp_path / f"{c.pid}.json").write_text(json.dumps(old))
    assert registry.read(c.pid).aliases == []
    table = Table(tmp_path, {"gpt": "gpt-4o-mini", "chat": "task"}, refresh_s=60)
    assert table.resolve("gpt-4o-mini").name == "chat" and table.resolve("small:latest").name == "task"
    assert table.resolve("gpt").name == "chat"             # the gateway's alias of a member's alias
    assert table.resolve("chat").name == "task"            # the gateway's own aliases come first
    with pytest.raises(Ambiguous, match="'qwen' is an alias of several members .chat, task."):
        table.resolve("qwen")
    assert "gpt-4o-mini" in table.known() and "small" in table.known() and "qwen" not in table.known()
    assert [(n, t.name, alias) for n, t, alias in table.named()] == [
        ("chat", "chat", False), ("old", "old", False), ("task", "task", False),
        ("gpt-4o-mini", "chat", True), ("small", "task", True), ("gpt", "chat", True)]   # not qwen: no route
    chat = table.resolve("gpt")
    assert table.aliases_of(chat) == ["gpt-4o-mini", "qwen", "gpt"]
    # A member that died is a 503 by its aliases too.
    b.kill()
    b.wait()
    table.members(fresh=True)
    with pytest.raises(MemberGone, match="member 'task'"):
        table.resolve("small")
    with pytest.raises(ValueError, match="aliases"):
        Member.from_json({**old, "aliases": "gpt"})       # a malformed record: skipped by readers


# --- the Ollama mapping -------------------------------------------------------------

def test_ollama_options_are_mapped_or_refused_by_name():
    path, body = ollama.chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
                                      "options": {"temperature": 0.2, "top_k": 5, "top_p": 0.9, "seed": 7,
                                                  "num_predict": 12, "stop": ["x"], "min_p": 0.1}})
    assert path == "/v1/chat/completions"
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2, "top_k": 5,
                    "top_p": 0.9, "seed": 7, "stop": ["x"], "min_p": 0.1, "max_tokens": 12, "stream": True,
                    "stream_options": {"include_usage": True}}
    assert "max_tokens" not in ollama.options({"options": {"num_predict": -1}})
    penalties = {"repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.5, "frequency_penalty": -0.2}
    assert ollama.options({"options": {**penalties, "seed": None}}) == penalties   # the daemon's names too
    for bad in ({"typical_p": 0.9}, {"num_ctx": 4096}, {"mirostat": 2}, {"num_gpu": 1}):
        with pytest.raises(UsageError, match=repr(next(iter(bad)))):
            ollama.options({"options": bad})
    with pytest.raises(UsageError, match="num_predict"):
        ollama.options({"options": {"num_predict": 0}})
    with pytest.raises(UsageError, match="'foo'"):
        ollama.chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "foo": 1})


def test_ollama_fields_map_onto_openai():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _, body = ollama.chat_request({"model": "m", "stream": False, "format": schema, "think": False,
                                   "messages": [{"role": "user", "content": "hi", "images": ["iVBORw0KGgo="]},
                                                {"role": "assistant", "content": "",
                                                 "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                                                {"role": "tool", "content": "2", "tool_name": "f"}]})
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "response", "schema": schema, "strict": True}}
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["stream"] is False
    assert body["reasoning_format"] == "none"   # as Ollama's without think: whatever is written is content
    assert body["messages"][0]["content"][1]["image_url"]["url"] == "data:image/png;base64,iVBORw0KGgo="
    assert body["messages"][1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert body["messages"][1]["content"] is None and body["messages"][2]["name"] == "f"
    path, body = ollama.generate_request({"model": "m", "prompt": "def f(", "suffix": "return 1", "format": "json"})
    assert path == "/v1/completions" and body["suffix"] == "return 1"
    assert body["response_format"] == {"type": "json_object"}
    path, body = ollama.generate_request({"model": "m", "prompt": "hi", "system": "be brief"})
    assert path == "/v1/chat/completions" and body["messages"][0] == {"role": "system", "content": "be brief"}
    for bad, word in (({"template": "{{ .Prompt }}"}, "template"), ({"context": [1, 2]}, "context"),
                      ({"think": "high"}, "think levels"), ({"think": True, "raw": True}, "'think' needs the chat"),
                      ({"think": False, "suffix": "x"}, "'think' needs the chat")):
        with pytest.raises(UsageError, match=word):
            ollama.generate_request({"model": "m", "prompt": "hi", **bad})
    _, body = ollama.generate_request({"model": "m", "prompt": "hi", "think": True})
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["reasoning_format"] == "deepseek"
    _, body = ollama.chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": "4", "thinking": "2+2"}]})
    assert "reasoning_format" not in body and body["messages"][1]["reasoning_content"] == "2+2"
    assert ollama.embed_request({"model": "m", "input": ["a", "b"], "truncate": True, "keep_alive": "5m"}) == \
        {"model": "m", "input": ["a", "b"], "encoding_format": "float"}
    assert ollama.embed_request({"model": "m", "input": "a", "dimensions": 64})["dimensions"] == 64   # the daemon's 400
    assert ollama.embed_request({"model": "m", "input": []}) is None                 # a load request
    assert ollama.embeddings_request({"model": "m", "prompt": "a"}) == {"model": "m", "input": "a",
                                                                        "encoding_format": "float"}
    assert ollama.embeddings_request({"model": "m"}) is None
    for bad, word in (({"truncate": "yes"}, "'truncate' must be true or false"), ({"options": {"num_ctx": 9}},
                      "'num_ctx'"), ({"options": [1]}, "'options' must be an object"), ({"input": [1]}, "'input'")):
        with pytest.raises(UsageError, match=word):
            ollama.embed_request({"model": "m", "input": "a", **bad})
    with pytest.raises(UsageError, match="'dimensions'"):
        ollama.embeddings_request({"model": "m", "prompt": "a", "dimensions": 3})   # not a field of the old route
    assert ollama.load_request({"model": "m"}, "/api/generate")
    assert ollama.load_request({"model": "m", "messages": []}, "/api/chat")
    assert not ollama.load_request({"model": "m", "prompt": "", "suffix": "x"}, "/api/generate")
    with pytest.raises(UsageError, match="mirostat"):
        ollama.load_request({"model": "m", "options": {"mirostat": 1}}, "/api/generate")
    assert ollama.tool_calls([{"function": {"name": "f", "arguments": '{"x": 1}'}}]) == \
        [{"function": {"name": "f", "arguments": {"x": 1}}}]


def test_keep_alive_values_and_a_member_the_gateway_cannot_unload(tmp_path):
    for v in (0, 0.0, "0", "0s", "0m", "0h0m0s", " 0 ", "0.0s"):
        assert residency.unload_asked({"keep_alive": v}), v
    for v in (None, 5, -1, 300.5, "5m", "-1m", "1h30m", "-1", "300", "1.5h", "10ms"):
        assert not residency.unload_asked({"keep_alive": v}), v
    for v in (True, "soon", "5 m", "m", "0x", [], {}, "inf", float("nan")):
        with pytest.raises(UsageError, match="'keep_alive' must be a number of seconds or a duration"):
            residency.unload_asked({"keep_alive": v})
    # keep_alive 0 for a member whose control socket the gateway cannot use: a 400 before anything is done.
    gone = Target("m", 1, "m.gguf", "http://127.0.0.1:1", "warm", 0.0, 0.0, 0, 0, str(tmp_path / "m.sock"))
    with pytest.raises(UsageError, match=r"'keep_alive' 0 cannot be done: the gateway cannot ask member 'm' to "
                                         r"unload \(.*no daemon answers"):
        residency.Residency(5).check(gone)
    with pytest.raises(UsageError, match="it has no control socket"):
        residency.Residency(5).check(Target("m", 1, "m.gguf", "http://127.0.0.1:1", "warm", 0.0, 0.0, 0, 0))
    # A socket that hangs up without a reply (a daemon dying, a refusal): the same 400, and load/unload a 502.
    import socket
    import threading
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(tmp_path / "m.sock"))
    srv.listen(4)
    threading.Thread(target=lambda: [srv.accept()[0].close() for _ in range(3)], daemon=True).start()
    hung_up = "closed the connection without a reply|the connection failed"
    with pytest.raises(UsageError, match=hung_up):
        residency.Residency(5).check(gone)
    for fn, word in ((residency.Residency(5).unload, "unload"), (residency.Residency(5).load, "load")):
        with pytest.raises(residency.ControlFailed, match=f"member 'm' did not {word}: .*({hung_up})") as e:
            fn(gone)
        assert e.value.http_status == 502
    srv.close()


# --- configuration --------------------------------------------------------------------

def test_config_file_and_flags(tmp_path):
    key = tmp_path / "chat.key"
    key.write_text("k-123\n")
    key.chmod(0o600)
    f = tmp_path / "gateway.toml"
    f.write_text(f'port = 9999\n[aliases]\n"gpt-4o" = "chat"\n[member_key_files]\nchat = "{key}"\n')
    cfg = config.build(f, {"aliases": {"small": "task"}, "host": None, "api_key": "gw-key"})
    assert cfg.port == 9999 and cfg.aliases == {"gpt-4o": "chat", "small": "task"}
    assert cfg.member_keys == {"chat": "k-123"}
    f.write_text("prot = 1\n")
    with pytest.raises(UsageError, match="unknown key 'prot'"):
        config.build(f, {})
    with pytest.raises(UsageError, match="names alias"):
        config.build(None, {"aliases": {"x": "y", "y": "chat"}})
    with pytest.raises(UsageError, match="NAME=VALUE"):
        config.pairs(("chat",), "--alias")
    key.chmod(0o644)
    with pytest.raises(UsageError, match="open to other users"):
        config.build(None, {"member_key_files": {"chat": str(key)}, "api_key": "gw-key"})


def test_member_keys_without_a_gateway_key_are_refused_unless_meant(tmp_path):
    """A gateway without a key would give anyone who reaches it the members' keys."""
    key = tmp_path / "chat.key"
    key.write_text("k-123\n")
    key.chmod(0o600)
    with pytest.raises(UsageError, match=r"member keys \(chat\) but no API key for the gateway.*--allow-open"):
        config.build(None, {"member_key_files": {"chat": str(key)}})
    f = tmp_path / "gateway.toml"
    f.write_text(f'[member_key_files]\nchat = "{key}"\n')
    with pytest.raises(UsageError, match="api_key_file"):
        config.build(f, {})
    assert config.build(None, {"member_key_files": {"chat": str(key)}, "allow_open": True}).member_keys
    f.write_text(f'allow_open = true\n[member_key_files]\nchat = "{key}"\n')
    assert config.build(f, {}).allow_open
    gw_key = tmp_path / "gw.key"
    gw_key.write_text("gw-456\n")
    gw_key.chmod(0o600)
    f.write_text(f'api_key_file = "{gw_key}"\n[member_key_files]\nchat = "{key}"\n')
    assert config.build(f, {}).api_key == "gw-456"
    assert config.build(None, {}).api_key is None   # no member keys: an open gateway is fine
    # The command: exit 2, one line, before anything is served.
    r = subprocess.run([sys.executable, "-m", "vramd.cli", "gateway", "--arena", str(tmp_path / "arena"),
                        "--port", "0", "--member-key-file", f"chat={key}"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "VRAMD_GATEWAY_API_KEY"})
    assert r.returncode == 2 and "--allow-open" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cors_origins_from_flags_and_the_file_and_their_check(tmp_path):
    f = tmp_path / "gateway.toml"
    f.write_text('cors_origins = ["http://localhost:8080"]\n')
    assert config.build(f, {}).cors_origins == ["http://localhost:8080"]
    assert config.build(f, {"cors_origins": ["*"]}).cors_origins == ["*"]   # the flag wins
    f.write_text('cors_origins = "https://ui.example:3000"\n')
    assert config.build(f, {}).cors_origins == ["https://ui.example:3000"]
    with pytest.raises(UsageError, match="cors origin 'http://x/'"):
        config.build(None, {"cors_origins": ["http://x/"]})


# --- the systemd unit -------------------------------------------------------------------

def unit_values(key):
    return [line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith(key + "=")]


def test_gateway_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: scripts/setup.sh installs Debian's systemd package"
    original = UNIT.read_text()
    assert original.count(REAL_EXEC) == 1
    fake = tmp_path / "bin" / "vramd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    unit = tmp_path / "vramd-gateway.service"
    unit.write_text(original.replace(REAL_EXEC, str(fake)))
    r = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, SYSTEMD_LOG_LEVEL="info", SYSTEMD_LOG_COLOR="0"))
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, out
    assert [line for line in out.splitlines() if "vramd" in line] == [], out


def test_gateway_unit_reads_the_system_arena_and_opens_no_device():
    (exec_start,) = unit_values("ExecStart")
    argv = exec_start.split()
    assert argv[:2] == [REAL_EXEC, "gateway"] and argv[argv.index("--arena") + 1] == "/run/vramd"
    assert argv[argv.index("--config") + 1] == "/etc/vramd/gateway.toml"
    assert unit_values("ReadOnlyPaths") == ["/run/vramd"] and unit_values("ReadWritePaths") == []
    assert unit_values("PrivateDevices") == ["yes"] and unit_values("DeviceAllow") == []
    assert unit_values("User") == ["vramd"] and unit_values("Group") == ["vramd"]
    assert unit_values("Type") == ["notify"] and unit_values("Restart") == ["on-failure"]


# --- the connection pool --------------------------------------------------------------

def echo_server(port=0):
    """A real vramd HTTP server whose one route answers with the client's port."""
    from vramd.server.http import HttpServer

    import socket

    def route(ex):
        ex.body()
        ex.reply(200, {"port": ex.h.client_address[1],
                       "nodelay": ex.h.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)})
    return HttpServer("127.0.0.1", port, {("POST", "/echo"): route}, on_error=lambda e: (500, {})).start()


def through(up, pool_ports):
    up.send("POST", "/echo", b"{}", {"Content-Type": "application/json"})
    r = up.response()
    got = json.loads(r.read())
    # The server's sockets send at once (Nagle off): a kept-alive connection's reply body would
    # otherwise wait for the client's delayed ACK of its head, ~40 ms.
    assert got["nodelay"]
    port = got["port"]
    up.release()
    pool_ports.append(port)
    return port


def test_a_path_http_client_cannot_send_is_refused_and_leaves_no_connection_open():
    from vramd.gateway.pool import Pool
    from vramd.gateway.proxy import BadPath, Upstream
    server = echo_server()
    t = Target("m", os.getpid(), "m.gguf", server.url, "warm", 0.0, 0.0, 0, 0)
    pool, ports = Pool(max_idle=2, idle_s=60), []
    try:
        first = through(Upstream(t, 10, pool), ports)
        for path in ("/echo\x7f", "/echo\x00", "/ec ho", "/echo\u00e9", "/echo\ud800"):
            u = Upstream(t, 10, pool)
            with pytest.raises(BadPath, match="no such route") as e:
                u.send("POST", path, b"{}", {})
            assert e.value.http_status == 404 and repr(path) in str(e.value)
            assert u.conn is None
        # The pooled connection was not spent on them: the next good request reuses it.
        assert pool.idle() == 1 and through(Upstream(t, 10, pool), ports) == first
    finally:
        pool.close()
        server.close()


def test_pool_reuses_a_good_connection_and_drops_closed_idle_and_extra_ones(monkeypatch):
    from vramd.gateway.pool import Pool
    from vramd.server import http
    from vramd.gateway.proxy import Upstream
    server = echo_server()
    t = Target("m", os.getpid(), "m.gguf", server.url, "warm", 0.0, 0.0, 0, 0)
    pool, ports = Pool(max_idle=2, idle_s=60), []
    try:
        first = through(Upstream(t, 10, pool), ports)
        assert through(Upstream(t, 10, pool), ports) == first and pool.reused == 1   # the same connection
        # Two at once: the second request gets a fresh connection; both go back, at most max_idle kept.
        u1, u2, u3 = Upstream(t, 10, pool), Upstream(t, 10, pool), Upstream(t, 10, pool)
        for u in (u1, u2, u3):
            u.send("POST", "/echo", b"{}", {})
        for u in (u1, u2, u3):
            u.response().read()
            u.release()
        assert pool.idle() == 2
        # The member closes its kept-alive connections (its idle timeout, made short here): the pooled
        # connections it closed are not used, the request goes on a fresh one.
        monkeypatch.setattr(http, "IDLE_TIMEOUT", 0.1)
        both = Upstream(t, 10, pool), Upstream(t, 10, pool)   # each pooled connection carries a request,
        for u in both:                                       # so the server's next wait on it is the short one
            u.send("POST", "/echo", b"{}", {})
        for u in both:
            ports.append(json.loads(u.response().read())["port"])
            u.release()
        assert pool.idle() == 2
        time.sleep(0.4)
        reused = pool.reused
        fresh = through(Upstream(t, 10, pool), ports)
        assert pool.reused == reused and fresh not in ports[:-1]
        # An unreleased connection (a reply not read whole, a client gone) is closed, never pooled.
        u = Upstream(t, 10, pool)
        u.send("POST", "/echo", b"{}", {})
        u.response()
        u.close()
        assert pool.idle() == 0
        # Idle longer than idle_s: closed at the next use of the pool, not reused.
        monkeypatch.setattr(http, "IDLE_TIMEOUT", 20.0)
        through(Upstream(t, 10, pool), ports)
        assert pool.idle() == 1
        pool.idle_s = 0.05
        time.sleep(0.1)
        assert pool.get(("m", os.getpid(), server.url)) is None and pool.idle() == 0
    finally:
        pool.close()
        server.close()

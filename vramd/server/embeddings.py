"""`POST /v1/embeddings`: the request, its inputs as token ids, the job on the loop, the reply.

    {"input": "text" | ["text", ...] | [id, ...] | [[id, ...], ...],
     "model": "...", "encoding_format": "float" | "base64", "dimensions": N, "user": "..."}

Owns the wire format of embeddings (OpenAI's): `parse` (every problem a 400
naming the field: an unknown field too, never ignored), `input_ids` (text
tokenized as llama.cpp's server does for embeddings: the vocabulary's BOS/EOS
added, special tokens in the text parsed; token ids taken as they are, no
BOS added; each input at most the context, never cut; done on the HTTP
thread, before the job is queued, so a bad request costs the GPU nothing),
`reply` and `handle` (one job on the daemon's loop for all the inputs of a
request: it takes the GPU as a generation does, is logged and counted as
one; a client that hangs up stops it between inputs).  The vectors are
the engine's (Engine.embed, vramd/engine/embed.py: pooled as the model's
metadata or --pooling says, L2-normalised).

`encoding_format`: "float" (a JSON list, the default of OpenAI's API) or
"base64" (the float32 values little-endian, base64: what the openai SDK asks
for unless told otherwise, and decodes itself).  `dimensions` only as the
model's width (n_embd): vramd does not shorten vectors.  `user` is accepted
and has no effect (it has none on the vectors at OpenAI either).
"""

from __future__ import annotations

import base64
import threading
import time

import numpy as np

from vramd.engine.embed import check_servable
from vramd.engine.prompt import check_token_ids
from vramd.errors import PeerError, ShuttingDown, UsageError
from vramd.server.openai_api import request_body

MAX_INPUTS = 2048          # per request, as OpenAI's API
FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
ENCODINGS = ("float", "base64")


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def parse(raw: bytes, model_names: set[str]) -> dict:
    """The validated request: {"inputs": [str | list[int]], "encoding": ..., "dimensions": int | None}."""
    body = request_body(raw, model_names)
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise UsageError(f"'{unknown[0]}' is not supported by /v1/embeddings (accepted: {', '.join(sorted(FIELDS))})")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise UsageError(f"'encoding_format' must be 'float' or 'base64', got {encoding!r}")
    dims = body.get("dimensions")
    if dims is not None and (not _is_id(dims) or dims < 1):
        raise UsageError(f"'dimensions' must be a positive integer, got {dims!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise UsageError("'user' must be a string")
    return {"inputs": _inputs(body.get("input")), "encoding": encoding, "dimensions": dims}


def _inputs(x) -> list[str | list[int]]:
    what = "'input' must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(x, str):
        inputs: list = [x]
    elif isinstance(x, list) and x and all(_is_id(t) for t in x):
        inputs = [x]
    elif isinstance(x, list) and x and (all(isinstance(s, str) for s in x) or
                                        all(isinstance(s, list) and all(_is_id(t) for t in s) for s in x)):
        inputs = x
    else:
        raise UsageError(what + (" (it is an empty list)" if x == [] else ""))
    if len(inputs) > MAX_INPUTS:
        raise UsageError(f"'input' has {len(inputs)} entries: at most {MAX_INPUTS} a request")
    for i, one in enumerate(inputs):
        if not one:
            raise UsageError(f"input[{i}] is empty")
    return inputs


def input_ids(engine, req: dict) -> list[list[int]]:
    """Each input's token ids (400s: the model's pooling, dimensions, the vocabulary, the context)."""
    check_servable(engine.pooling)
    width = engine.spec.n_embd
    if req["dimensions"] is not None and req["dimensions"] != width:
        raise UsageError(f"'dimensions' {req['dimensions']}: this model's embeddings have {width} "
                         "(vramd does not shorten them)")
    ctx, tok, n_vocab = engine.ctx, engine.tokenizer, engine.spec.n_vocab
    longest = max((len(t) for t in tok.tokens), default=1) if tok is not None else 1
    out = []
    for i, one in enumerate(req["inputs"]):
        if isinstance(one, str):
            if tok is None:
                raise UsageError("this model has no tokenizer in its file: send the inputs as token ids")
            if len(one) > ctx * longest:   # cannot fit whatever its tokens: refused before tokenizing
                raise UsageError(f"input[{i}] has {len(one)} characters: more than the context of {ctx} "
                                 f"tokens (--ctx) can hold")
            ids = tok.encode(one, add_special=True, parse_special=True)
        else:
            check_token_ids(one, n_vocab, f"input[{i}]: ")
            ids = list(one)
        if len(ids) > ctx:
            raise UsageError(f"input[{i}] has {len(ids)} tokens: the context holds {ctx} (--ctx); "
                             "an embedding input is never cut")
        out.append(ids)
    return out


def reply(vectors: list[np.ndarray], encoding: str, model: str, prompt_tokens: int) -> dict:
    def encode(v: np.ndarray):
        if encoding == "base64":
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return np.asarray(v, dtype=np.float32).tolist()
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def handle(daemon, ex) -> None:
    """One embeddings request on `daemon` (vramd/server/daemon.py's Daemon): a job on its loop."""
    from vramd.server.daemon import CLIENT_CHECK, Job
    ex.fields["model"] = daemon.name
    req = parse(ex.body(), set(daemon.model_names()))
    engine = daemon.engine
    if engine is None:
        raise PeerError(f"{daemon.name} is still loading")
    if daemon.stopping:
        raise ShuttingDown(f"{daemon.name} is shutting down")
    ids = input_ids(engine, req)
    cancelled = threading.Event()
    arrived = ex.started
    timing: dict = {"inputs": len(ids)}

    def work():
        timing["queue_s"] = round(time.monotonic() - arrived, 6)
        vectors = []
        for one in ids:
            if cancelled.is_set():
                break
            if daemon.stopping or daemon.lost is not None:
                raise ShuttingDown(f"{daemon.name} is shutting down: the embeddings were ended")
            daemon.host_cache.keep_slot(engine, one)   # an embedding overwrites the slot's rows from 0
            vectors.append(engine.embed(one))
            daemon.beat = time.monotonic()
        timing["prompt_tokens"] = sum(len(one) for one in ids[:len(vectors)])
        return vectors

    job = Job("embed", fn=work, needs_gpu=True, timeout=daemon.cfg.wake_timeout, cancelled=cancelled)
    try:
        with daemon.in_flight(job):
            job.wait_taken(daemon._busy_text)
            while not job.done.wait(CLIENT_CHECK):
                if ex.client_gone():
                    cancelled.set()
                    ex.error = "the client went away: embeddings stopped"
                    job.done.wait()
                    return
            vectors = job.wait()
            ex.reply(200, reply(vectors, req["encoding"], daemon.name, sum(map(len, ids))))
    finally:
        if job.done.is_set():
            ex.fields.update(timing)

"""The OpenAI-compatible endpoints: request validation, response and stream shapes.

    GET  /v1/models               the model once, and each --alias as its own entry
    GET  /v1/models/{id}          one of them (the SDK's models.retrieve)
    POST /v1/completions          prompts as text or token ids (several: several choices), echo, logprobs,
                                  suffix (fill-in-the-middle)
    POST /v1/chat/completions     messages through the model's chat template

Which request fields are taken, and what each does, is vramd/server/api_fields.py's
table; parse_request checks it first, so no field is silently ignored.

This module owns the wire format only: it turns a request body into a
`GenerationRequest` and a stream of `Piece`s (from the engine, on the
daemon's loop thread) into OpenAI JSON or server-sent events.  Errors use
OpenAI's shape {"error": {"message", "type", "param", "code"}} with the
status of the vramd error class (400 bad request, 404 unknown model, 503
when the GPU could not be had in time).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from dataclasses import replace

from vramd.engine.chat import MEDIA_MARKER
from vramd.engine.prompt import Prompt
from vramd.engine.sampler import Piece, SamplingParams
from vramd.errors import UsageError, VramdError
from vramd.server import api_fields, assistant, reasoning, structured
from vramd.server.bodies import json_object

MAX_IMAGES = 8
MAX_TEMPLATE_KWARGS = 16
MAX_CHOICES = 16    # n, times the prompts of a completions request: generated one after another


class NotFound(VramdError):
    exit_code = 8
    http_status = 404


@dataclass
class GenerationRequest:
    kind: str                       # "completion" or "chat"
    prompt: list[int] | str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    logprobs: int | None = None     # completions: how many top logprobs; chat: top_logprobs
    echo: bool = False
    include_usage: bool = False
    images: list[bytes] = field(default_factory=list)   # encoded PNG/JPEG, in prompt order
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs (e.g. enable_thinking)
    suffix: str | None = None       # completions: the text after the insertion (vramd/engine/fim.py)
    # -- [surface] more choices, penalties, what the log line says (api_fields.py's table)
    n: int = 1                      # choices per prompt
    prompts: list | None = None     # completions: every prompt (`prompt` is the first)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: dict = field(default_factory=dict)
    ignore_eos: bool = False        # llama.cpp's: the end-of-generation token does not end it
    user: str | None = None         # `user` / `safety_identifier`: for the request's log line
    # response_format and tools (vramd/server/structured.py); tool_format: how the answer's
    # tool calls are read (vramd/server/tools.py sets it; None: they are not)
    structured: structured.Structured = field(default_factory=structured.Structured)
    tool_format: str | None = None
    # <think> blocks (vramd/server/reasoning.py): the request's reasoning_format (None: the
    # daemon's --reasoning-format) and what tools.plan made of it (None: the text stays as is)
    reasoning_format: str | None = None
    reasoning: reasoning.Reasoning | None = None

    def sampling(self) -> SamplingParams:
        """What the engine samples with."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              seed=self.seed, max_tokens=self.max_tokens, stop=tuple(self.stop),
                              logprobs=self.logprobs, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, repeat_penalty=self.repeat_penalty,
                              repeat_last_n=self.repeat_last_n, logit_bias=self.logit_bias,
                              ignore_eos=self.ignore_eos)

    def each_prompt(self) -> list["GenerationRequest"]:
        """One request per prompt (a completions request may carry several; a chat, one)."""
        if not self.prompts or len(self.prompts) == 1:
            return [self]
        return [replace(self, prompt=p, prompts=[p]) for p in self.prompts]

    def choice_seed(self, index: int) -> int | None:
        """Choice i samples with seed + i (mod 2^64): choice 0 is what n=1 gives with the same seed,
        and the others differ from it.  (llama.cpp gives every prompt of a list the same seed.)
        No seed: each choice draws its own."""
        return None if self.seed is None else (self.seed + index) % (1 << 64)

    def prompt_input(self) -> Prompt:
        """What the engine continues."""
        return Prompt(kind=self.kind, prompt=self.prompt, messages=self.messages, images=self.images,
                      template_kwargs=self.template_kwargs)


def error_body(e: BaseException) -> tuple[int, dict]:
    status = getattr(e, "http_status", 500)
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}.get(status, "server_error")
    return status, {"error": {"message": str(e), "type": kind, "param": getattr(e, "param", None), "code": None}}


def _number(body: dict, key: str, default, lo=None, hi=None, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise api_fields.FieldError(key, f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):   # JSON's NaN and Infinity, which every comparison lets through
        raise api_fields.FieldError(key, f"'{key}' must be a finite number, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise api_fields.FieldError(key, f"'{key}' must be between {lo} and {hi}, got {v!r}")
    return v


def _flag(body: dict, key: str, default: bool = False, within: str = "") -> bool:
    """A JSON boolean (or null: the default); "false" or 0 is refused, never read as truthy.
    `within`: the field `body` is the value of ("stream_options."), for the error's `param`."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise api_fields.FieldError(within + key, f"'{key}' must be true or false, got {v!r}")
    return v


def request_body(raw: bytes, model_names: set[str]) -> dict:
    """A request body as a JSON object whose "model", if any, is served here (400 or 404 else);
    every endpoint's first step (the embeddings' too: vramd/server/embeddings.py)."""
    body = json_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise UsageError(f"'model' must be a string, got {type(model).__name__}")
    if model is not None and model not in model_names:
        raise NotFound(f"the model '{model}' does not exist here (this daemon serves "
                       f"{', '.join(sorted(model_names))})")
    return body


def parse_request(kind: str, raw: bytes, model_names: set[str]) -> GenerationRequest:
    """Validate a request body; every problem is a UsageError (400) or NotFound (404)."""
    body = request_body(raw, model_names)
    api_fields.check(kind, body)   # [surface] a field not taken is a 400 naming it, before any other
    req = GenerationRequest(kind=kind)
    req.n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    req.max_tokens = _number(body, "max_tokens" if kind == "completion" else "max_completion_tokens",
                             None, 1, 1 << 20, integer=True)
    if kind == "chat" and req.max_tokens is None:
        req.max_tokens = _number(body, "max_tokens", None, 1, 1 << 20, integer=True)
    if kind == "completion" and body.get("max_tokens") is None:
        req.max_tokens = 16  # OpenAI's default for completions
    req.max_tokens = _n_predict(body, req.max_tokens)
    req.temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    req.top_p = float(_number(body, "top_p", 1.0, 0.0, 1.0))
    req.top_k = _number(body, "top_k", 0, 0, 1 << 20, integer=True)
    req.min_p = float(_number(body, "min_p", 0.0, 0.0, 1.0))
    req.seed = _number(body, "seed", None, 0, (1 << 64) - 1, integer=True)
    req.frequency_penalty = float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0))
    req.presence_penalty = float(_number(body, "presence_penalty", 0.0, -2.0, 2.0))
    req.repeat_penalty = float(_number(body, "repeat_penalty", 1.0, 0.0, 10.0))
    req.repeat_last_n = _number(body, "repeat_last_n", 64, -1, 1 << 20, integer=True)
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise UsageError("'logit_bias' must be an object mapping token ids to numbers from -100 to 100")
    req.logit_bias = bias or {}
    req.user = body.get("user") or body.get("safety_identifier")
    req.stream = _flag(body, "stream")
    req.ignore_eos = _flag(body, "ignore_eos")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise UsageError("'stream_options' must be an object")
    req.include_usage = _flag(opts or {}, "include_usage", within="stream_options.")
    stop = body.get("stop")
    if stop is None:
        req.stop = []
    elif isinstance(stop, str):
        req.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        req.stop = [s for s in stop if s]
    else:
        raise UsageError("'stop' must be a string or a list of at most 4 strings")
    req.structured = structured.parse(body, kind)
    req.reasoning_format = reasoning.request_format(body, kind)
    if kind == "completion":
        req.prompts = _prompts(body.get("prompt"))
        req.prompt = req.prompts[0]
        lp = body.get("logprobs")
        req.logprobs = None if lp is None else _number(body, "logprobs", 0, 0, 20, integer=True)
        req.echo = _flag(body, "echo")
        req.suffix = body.get("suffix")   # fill-in-the-middle: the prompt is the prefix (vramd/engine/fim.py)
        if req.suffix is not None and not isinstance(req.suffix, str):
            raise UsageError(f"'suffix' must be a string, got {type(req.suffix).__name__}")
        best_of = _number(body, "best_of", req.n, 1, MAX_CHOICES, integer=True)
        if best_of not in (1, req.n):
            raise UsageError(f"'best_of' {best_of} with 'n' {req.n} is not supported: vramd returns every "
                             "sequence it samples; ask 'n' and rank them yourself")
        if req.n * len(req.prompts) > MAX_CHOICES:
            raise UsageError(f"{len(req.prompts)} prompts x 'n' {req.n} = {req.n * len(req.prompts)} choices: at "
                             f"most {MAX_CHOICES} in one request (they are generated one after another)")
    else:
        req.messages, req.images = _messages(body.get("messages"))
        req.template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
        if _flag(body, "logprobs"):
            req.logprobs = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        elif body.get("top_logprobs") is not None:
            raise UsageError("'top_logprobs' needs 'logprobs': true")
    return req


def _n_predict(body: dict, max_tokens: int | None) -> int | None:
    """llama.cpp's name for max_tokens (-1: no limit); both given must agree."""
    n = body.get("n_predict")
    if n is None:
        return max_tokens
    n = _number(body, "n_predict", None, -1, 1 << 20, integer=True)
    n = None if n == -1 else n
    given = [body.get(k) for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if given and given[0] != n:
        raise UsageError(f"'n_predict' {body['n_predict']} and 'max_tokens' {given[0]} disagree: give one")
    if n == 0:
        raise UsageError("'n_predict' must be -1 (no limit) or at least 1")
    return n


def _template_kwargs(kw) -> dict:
    """chat_template_kwargs (as llama.cpp's server takes them, e.g.
    {"enable_thinking": false} for Qwen3): variables for the chat template,
    names it does not reserve, values JSON scalars."""
    if kw is None:
        return {}
    if not isinstance(kw, dict) or len(kw) > MAX_TEMPLATE_KWARGS:
        raise UsageError(f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} entries")
    for k, v in kw.items():
        if k in ("messages", "add_generation_prompt", "bos_token", "eos_token") or not k.isidentifier():
            raise UsageError(f"'chat_template_kwargs' cannot set {k!r}")
        if not isinstance(v, (bool, int, float, str)) or (isinstance(v, str) and len(v) > 4096):
            raise UsageError(f"'chat_template_kwargs.{k}' must be a boolean, number or short string")
    return dict(kw)


def _is_ids(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _prompts(p) -> list:
    """Every prompt of a completions request: a string, token ids, or a list of either."""
    if isinstance(p, str) or _is_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(q, str) or _is_ids(q) for q in p):
        if len(p) > MAX_CHOICES:
            raise UsageError(f"'prompt' is a list of {len(p)} prompts: at most {MAX_CHOICES} in one request")
        return list(p)
    raise UsageError("'prompt' must be a string, a list of token ids, or a list of strings or of token-id lists")


def _messages(m) -> tuple[list[dict], list[bytes]]:
    """Messages with their content as text (an image part becomes MEDIA_MARKER), and the images."""
    if not isinstance(m, list) or not m:
        raise UsageError("'messages' must be a non-empty list")
    out, images = [], []
    for i, msg in enumerate(m):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise UsageError(f"messages[{i}] needs a 'role'")
        content = msg.get("content", "")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "image_url":
                    images.append(_image_bytes(part.get("image_url"), f"messages[{i}].content[{j}]"))
                    texts.append(MEDIA_MARKER)
                else:
                    raise UsageError(f"messages[{i}].content[{j}]: only 'text' and 'image_url' parts are supported")
            content = "".join(texts)
        fields = structured.message_fields(msg, i)
        if content in (None, "") and fields.get("tool_calls"):
            # An assistant turn of calls only has no content: None, as llama.cpp gives templates, since
            # some render the calls only then (DeepSeek-R1's: `content is none`).
            content = None
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise UsageError(f"messages[{i}].content must be a string or a list of content parts")
        # developer is OpenAI's newer name for system: rendered as one, as llama.cpp's server does
        role = "system" if msg["role"] == "developer" else msg["role"]
        if role == "assistant" and isinstance(msg.get("reasoning_content"), str):
            fields["reasoning_content"] = msg["reasoning_content"]   # templates that keep a tool loop's thinking
        out.append({"role": role, "content": content, **fields})
    if len(images) > MAX_IMAGES:
        raise UsageError(f"{len(images)} images in one request: at most {MAX_IMAGES}")
    return out, images


def _image_bytes(image_url, where: str) -> bytes:
    """The bytes of a data: URI image; a URL to fetch is refused (the daemon fetches nothing)."""
    import base64
    import binascii
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise UsageError(f"{where}: image_url needs a 'url'")
    if not url.startswith("data:"):
        raise UsageError(f"{where}: only data: URIs (base64 PNG or JPEG) are accepted; vramd fetches nothing "
                         "from the network")
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise UsageError(f"{where}: a data: URI must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(f"{where}: the data: URI is not valid base64") from None


# -- responses --------------------------------------------------------------------

class ResponseBuilder:
    """Accumulates pieces and renders the final JSON or the stream's chunks."""

    def __init__(self, req: GenerationRequest, model: str, index: int = 0, like: "ResponseBuilder | None" = None):
        """index: the choice's; like: the request's first choice (its id and time are the response's)."""
        self.req, self.model, self.index = req, model, index
        self.id = like.id if like else ("cmpl-" if req.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        self.created = like.created if like else int(time.time())
        self.text: list[str] = []
        self.pieces: list[Piece] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0   # prompt tokens not prefilled: the slot's prefix or the host cache's (hostcache.py)
        self.echo_text = ""
        self.role_sent = False
        self.context: dict | None = None   # what --context-overflow dropped (vramd/engine/overflow.py)
        # tool calls and reasoning read out of the text (vramd/server/assistant.py)
        self.assistant = assistant.Assistant(req.tool_format, req.reasoning) \
            if req.tool_format or req.reasoning else None

    def add_shifts(self, stats: dict) -> None:
        """The context shifts of the generation (policy shift), beside any cut of the prompt."""
        c = self.context or {"policy": "shift", "dropped_tokens": 0, "dropped_messages": 0}
        c["shifts"] = stats["shifts"]
        c["dropped_tokens"] += stats["dropped_tokens"]
        self.context = c

    def context_header(self, context: dict | None = None) -> dict:
        """X-Vramd-Context-Dropped for this choice's context (or `context`: several choices' summed)."""
        c = context if context is not None else self.context
        if not c:
            return {}
        return {"X-Vramd-Context-Dropped": f"policy={c['policy']}; messages={c['dropped_messages']}; "
                                          f"tokens={c['dropped_tokens']}; shifts={c.get('shifts', 0)}"}

    def usage(self) -> dict:
        n = sum(1 for p in self.pieces if p.token >= 0)  # a text-only tail piece is no token
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}   # as OpenAI and llama.cpp say it
        if self.context:
            out["context"] = dict(self.context)
        return out

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self.text.append(piece.text)

    def _completion_logprobs(self, pieces: list[Piece]) -> dict | None:
        if self.req.logprobs is None:
            return None
        pieces = [p for p in pieces if p.token >= 0]
        offsets, pos = [], len(self.echo_text)
        for p in pieces:
            offsets.append(pos)
            pos += len(p.text)
        return {"tokens": [p.text for p in pieces], "token_logprobs": [p.logprob for p in pieces],
                "top_logprobs": [dict(p.top or []) for p in pieces], "text_offset": offsets}

    def _chat_logprobs(self, pieces: list[Piece]) -> dict | None:
        if self.req.logprobs is None:
            return None
        pieces = [p for p in pieces if p.token >= 0]
        return {"content": [{"token": p.text, "logprob": p.logprob, "bytes": list(p.text.encode()),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                              for t, lp in (p.top or [])]} for p in pieces]}

    def final(self, finish_reason: str) -> dict:
        text = "".join(self.text)
        if self.req.kind == "completion":
            choice = {"index": self.index, "text": (self.echo_text if self.req.echo else "") + text,
                      "logprobs": self._completion_logprobs(self.pieces), "finish_reason": finish_reason}
            obj = "text_completion"
        else:
            message: dict = {"role": "assistant", "content": text}
            if self.assistant is not None:
                message.update(assistant.message(self.req.tool_format, self.req.reasoning, text))
                if message.get("tool_calls") and finish_reason == "stop":
                    finish_reason = "tool_calls"
            choice = {"index": self.index, "message": message,
                      "logprobs": self._chat_logprobs(self.pieces), "finish_reason": finish_reason}
            obj = "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, pieces: list[Piece], finish_reason: str | None = None, first: bool = False) -> dict:
        text = "".join(p.text for p in pieces)
        if self.req.kind == "completion":
            if first and self.req.echo:
                text = self.echo_text + text
            choice = {"index": self.index, "text": text, "logprobs": self._completion_logprobs(pieces) if pieces else None,
                      "finish_reason": finish_reason}
            obj = "text_completion"
        else:
            delta: dict = {}
            if self.assistant is not None:
                delta = self.assistant.feed(text, final=finish_reason is not None)
                text = delta.pop("content", "")
                if finish_reason == "stop" and self.assistant.calls:
                    finish_reason = "tool_calls"
            if not self.role_sent:
                delta["role"] = "assistant"
                self.role_sent = True
            if text or (not finish_reason and not delta):
                delta["content"] = text
            choice = {"index": self.index, "delta": delta,
                      "logprobs": self._chat_logprobs(pieces) if pieces else None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict:
        obj = "text_completion" if self.req.kind == "completion" else "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage()}


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


# -- [surface] several choices in one response; the model list -----------------------

def combined(builders: list[ResponseBuilder], finishes: list[str], n: int) -> dict:
    """Every choice (builders in index order, n per prompt) as one response, the usage summed."""
    out = builders[0].final(finishes[0])
    if len(builders) > 1:
        out["choices"] = [b.final(f)["choices"][0] for b, f in zip(builders, finishes)]
        out["usage"] = summed_usage(builders, n)
    return out


def summed_usage(builders: list[ResponseBuilder], n: int) -> dict:
    """Completion tokens of every choice; each prompt's tokens once (as OpenAI counts n > 1)."""
    usages = [b.usage() for b in builders]
    prompt = sum(u["prompt_tokens"] for u in usages[::n])
    completion = sum(u["completion_tokens"] for u in usages)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                          for u in usages[::n])}}
    contexts = [u["context"] for u in usages[::n] if "context" in u]
    if contexts:
        merged = dict(contexts[0])
        for c in contexts[1:]:
            for k in ("dropped_tokens", "dropped_messages", "shifts"):
                merged[k] = merged.get(k, 0) + c.get(k, 0)
        out["context"] = merged
    return out


def model_entry(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "vramd"}


def models_list(names: list[str], created: int) -> dict:
    return {"object": "list", "data": [model_entry(n, created) for n in names]}

"""Ollama's request bodies mapped onto the daemons' OpenAI ones, and OpenAI replies back.

Pure functions, no I/O (ollama_routes.py does the HTTP):

- `chat_request` (/api/chat) and `generate_request` (/api/generate) give the
  daemon path and the OpenAI body; `embed_request` (/api/embed) and
  `embeddings_request` (the older /api/embeddings: one `prompt`) the
  /v1/embeddings body (OpenAI's shape: `input` a string or a list of them).
  `load_request` tells a load request (no prompt, no messages) from a
  generation; embed_request and embeddings_request give None for one.
- Options: temperature, top_p, top_k, min_p, seed, stop, the penalties
  (repeat_penalty and repeat_last_n, llama.cpp's as Ollama's are;
  presence_penalty, frequency_penalty: the daemon's, vramd/engine/penalties.py,
  under the same names), num_predict (-1 and -2, "until the model stops / the
  context is full", are the daemon's default).  An option not given is the
  daemon's default (penalties off), not Ollama's Modelfile defaults.  Any
  other option is a 400 naming it, never ignored: the sampler has no mirostat
  or typical_p, and load options (num_ctx, num_gpu, num_thread...) are the
  daemon's flags, fixed when it starts.  Embeddings take no options.
- Top-level fields: `format` ("json" or a JSON schema: OpenAI's
  response_format), `tools` and tool messages (OpenAI's tools; arguments as
  objects here, JSON text there), `images` (data: URIs), `system`, `raw`
  (/v1/completions, no template), `suffix` (/v1/completions' suffix),
  `think` (below), `logprobs`/`top_logprobs`, `keep_alive`
  (vramd/gateway/residency.py: 0 unloads the member after the reply, any
  other value is what vramd does anyway).  `template`, a non-empty `context`
  and image-generation fields are refused with a 400.  /api/embed's
  `truncate` and `dimensions`: see embed_request.
- Thinking, as Ollama's server does it: `think` true asks the template to
  think (its `enable_thinking`) and splits a leading <think> block off the
  answer whatever the template (the daemon's reasoning_format "deepseek");
  false asks it not to, and whatever the model still writes is `content`
  (reasoning_format "none": Ollama parses no thinking then); absent, the
  daemon's own --reasoning-format (auto: split for thinking templates, as
  Ollama thinks by default with a thinking model).  The split-off text,
  OpenAI's `reasoning_content`, is Ollama's `thinking`: `message.thinking`
  (/api/chat) or `thinking` (/api/generate), streamed as it comes.  Ollama's
  think levels ("low", "medium", "high": gpt-oss's reasoning effort) are a
  400, and so is `think` with raw or suffix (no template to think in).  A
  history message's `thinking` goes to the template as `reasoning_content`.
"""

from __future__ import annotations

import base64
import binascii
import json
import time

from vramd.errors import UsageError

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop",
            "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty")
OPTIONS = (*SAMPLING, "num_predict")
COMMON = ("model", "stream", "options", "format", "keep_alive", "think", "logprobs", "top_logprobs")
CHAT_FIELDS = (*COMMON, "messages", "tools")
GENERATE_FIELDS = (*COMMON, "prompt", "suffix", "system", "raw", "images", "context", "template")
EMBED_FIELDS = ("model", "input", "truncate", "options", "keep_alive", "dimensions")
EMBEDDINGS_FIELDS = ("model", "prompt", "options", "keep_alive")
REFUSED_WHY = {
    "template": "vramd renders the model file's own chat template (or none with raw: true)",
    "context": "vramd returns no context; send the history with /api/chat",
}


def _check_fields(body: dict, allowed: tuple[str, ...], route: str) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise UsageError(f"{route}: field {', '.join(repr(k) for k in unknown)} is not supported by vramd "
                         f"(supported: {', '.join(allowed)})")


def options(body: dict) -> dict:
    """The OpenAI sampling fields of Ollama's `options`; a 400 naming any other option."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise UsageError("'options' must be an object")
    unknown = sorted(k for k, v in opts.items() if k not in OPTIONS and v is not None)
    if unknown:
        raise UsageError(f"option {', '.join(repr(k) for k in unknown)} is not supported by vramd "
                         f"(supported options: {', '.join(OPTIONS)}; context length and GPU settings are the "
                         "daemon's flags)")
    out = {k: opts[k] for k in SAMPLING if opts.get(k) is not None}
    n = opts.get("num_predict")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < -2 or n == 0:
            raise UsageError(f"option 'num_predict' must be a positive integer, -1 or -2, got {n!r}")
        if n > 0:
            out["max_tokens"] = n
    return out


def _common(body: dict, out: dict) -> dict:
    out.update(options(body))
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt,
                                                                         "strict": True}}
    elif fmt not in (None, ""):
        raise UsageError(f"'format' must be \"json\" or a JSON schema object, got {fmt!r}")
    think = body.get("think")
    if think is not None:
        if not isinstance(think, bool):
            raise UsageError(f"'think' {think!r}: think levels (gpt-oss's reasoning effort) are not supported "
                             "by vramd: send true or false")
        if "messages" not in out:
            raise UsageError("'think' needs the chat template: not with raw or suffix")
        out["chat_template_kwargs"] = {"enable_thinking": think}
        out["reasoning_format"] = "deepseek" if think else "none"
    if body.get("logprobs"):
        out["logprobs"] = True
        if body.get("top_logprobs") is not None:
            out["top_logprobs"] = body["top_logprobs"]
    out["stream"] = body.get("stream", True) is not False
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


def image_url(data, where: str) -> dict:
    """An Ollama image (base64 text) as an OpenAI image part (a data: URI)."""
    if not isinstance(data, str):
        raise UsageError(f"{where}: an image must be base64 text")
    try:
        head = base64.b64decode(data[:24] + "=" * (-len(data[:24]) % 4), validate=False)
    except (binascii.Error, ValueError):
        raise UsageError(f"{where}: the image is not valid base64") from None
    mime = "image/png" if head.startswith(b"\x89PNG") else "image/jpeg" if head.startswith(b"\xff\xd8") else \
        "image/png"   # the daemon reads the bytes, whatever the type says
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _content(text, images, where: str):
    if not images:
        return text or ""
    if not isinstance(images, list):
        raise UsageError(f"{where}.images must be a list")
    return [{"type": "text", "text": text or ""}] + [image_url(im, f"{where}.images[{i}]")
                                                     for i, im in enumerate(images)]


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise UsageError(f"{where} needs a 'role'")
    unknown = sorted(set(m) - {"role", "content", "images", "tool_calls", "tool_name", "thinking"})
    if unknown:
        raise UsageError(f"{where}: field {', '.join(map(repr, unknown))} is not supported")
    out = {"role": m["role"], "content": _content(m.get("content"), m.get("images"), where)}
    if m.get("tool_calls"):
        calls = []
        for j, call in enumerate(m["tool_calls"]):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise UsageError(f"{where}.tool_calls[{j}] needs function.name")
            args = fn.get("arguments", {})
            calls.append({"id": f"call_{i}_{j}", "type": "function",
                          "function": {"name": fn["name"],
                                       "arguments": args if isinstance(args, str) else json.dumps(args)}})
        out["tool_calls"] = calls
        if not m.get("content"):
            out["content"] = None
    if m.get("tool_name"):
        out["name"] = m["tool_name"]
    if m.get("thinking"):
        if not isinstance(m["thinking"], str):
            raise UsageError(f"{where}.thinking must be a string")
        out["reasoning_content"] = m["thinking"]
    return out


def _answered(messages: list[dict]) -> list[dict]:
    """Each tool message with the `tool_call_id` of the call it answers, which OpenAI's tool messages
    carry and Ollama's do not: the earliest call not yet answered, of its `tool_name` if it has one."""
    pending: list[tuple[str, str]] = []   # (id, function name) of calls not answered yet
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or []:
            pending.append((c["id"], c["function"]["name"]))
        if m["role"] == "tool":
            hit = next((p for p in pending if m.get("name") in (None, p[1])), None)
            if hit is not None:
                pending.remove(hit)
            m["tool_call_id"] = hit[0] if hit else f"call_{i}"   # an answer to no call: its own id
    return messages


def chat_request(body: dict) -> tuple[str, dict]:
    _check_fields(body, CHAT_FIELDS, "/api/chat")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise UsageError("'messages' must be a non-empty list")
    out = {"model": body.get("model"), "messages": _answered([_message(m, i) for i, m in enumerate(msgs)])}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise UsageError("'tools' must be a list")
        out["tools"] = tools   # Ollama's tool objects are OpenAI's
    return "/v1/chat/completions", _common(body, out)


def generate_request(body: dict) -> tuple[str, dict]:
    _check_fields(body, GENERATE_FIELDS, "/api/generate")
    for key in ("template",):
        if body.get(key):
            raise UsageError(f"'{key}': {REFUSED_WHY[key]}")
    if body.get("context"):
        raise UsageError(f"'context': {REFUSED_WHY['context']}")
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise UsageError("'prompt' must be a string")
    raw = body.get("raw") is True
    if raw or body.get("suffix"):
        if body.get("system") or body.get("images"):
            raise UsageError("'system' and 'images' need the chat template: not with raw or suffix")
        out = {"model": body.get("model"), "prompt": prompt}
        if body.get("suffix"):
            out["suffix"] = body["suffix"]
        out = _common(body, out)
        if out.get("logprobs"):   # /v1/completions: logprobs is the number of top entries
            out["logprobs"] = out.pop("top_logprobs", 0) or 0
        return "/v1/completions", out
    msgs = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    msgs.append({"role": "user", "content": _content(prompt, body.get("images"), "generate")})
    return "/v1/chat/completions", _common(body, {"model": body.get("model"), "messages": msgs})


def load_request(body: dict, route: str) -> bool:
    """Is this /api/chat (no messages) or /api/generate (no prompt, suffix, system or images) request
    Ollama's load (or, with keep_alive 0, unload) request?  Its fields and options are checked."""
    _check_fields(body, CHAT_FIELDS if route == "/api/chat" else GENERATE_FIELDS, route)
    options(body)
    if route == "/api/chat":
        return body.get("messages") in (None, [])
    return not any(body.get(k) for k in ("prompt", "suffix", "system", "images"))


def _no_options(body: dict, route: str) -> None:
    opts = body.get("options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise UsageError(f"{route}: 'options' must be an object")
    given = sorted(k for k, v in opts.items() if v is not None)
    if given:
        raise UsageError(f"{route}: option {', '.join(map(repr, given))} is not supported: embeddings take no "
                         "options here (the context length is the daemon's --ctx)")


def embed_request(body: dict) -> dict | None:
    """/api/embed's /v1/embeddings body; None for a load request (no input).

    `truncate` (Ollama's default: true) is taken and has nothing to do while every input fits the
    context; vramd never cuts one, so an input that does not fit is the daemon's 400, which the
    route extends to name truncate.  `dimensions` goes to the daemon, which takes the model's
    own width only (a 400 naming it otherwise: vectors are not shortened)."""
    _check_fields(body, EMBED_FIELDS, "/api/embed")
    _no_options(body, "/api/embed")
    if body.get("truncate") is not None and not isinstance(body["truncate"], bool):
        raise UsageError(f"'truncate' must be true or false, got {body['truncate']!r}")
    inp = body.get("input")
    if inp in (None, "", []):
        return None
    if not (isinstance(inp, str) or isinstance(inp, list) and all(isinstance(s, str) for s in inp)):
        raise UsageError("'input' must be a string or a list of strings")
    out = {"model": body.get("model"), "input": inp, "encoding_format": "float"}
    if body.get("dimensions") is not None:
        out["dimensions"] = body["dimensions"]
    return out


def embeddings_request(body: dict) -> dict | None:
    """The older /api/embeddings (one `prompt`, one vector back); None for a load request (no prompt)."""
    _check_fields(body, EMBEDDINGS_FIELDS, "/api/embeddings")
    _no_options(body, "/api/embeddings")
    prompt = body.get("prompt")
    if prompt in (None, ""):
        return None
    if not isinstance(prompt, str):
        raise UsageError("'prompt' must be a string")
    return {"model": body.get("model"), "input": prompt, "encoding_format": "float"}


# -- replies --------------------------------------------------------------------

def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


DONE_REASON = {"stop": "stop", "length": "length", "tool_calls": "stop", "content_filter": "stop"}


def tool_calls(calls: list | None) -> list | None:
    """OpenAI tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    if not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = {"_raw": args}   # what the model wrote, unparsed, rather than dropped
        out.append({"function": {"name": fn.get("name", ""), "arguments": parsed}})
    return out


def logprobs(lp: dict | None) -> list | None:
    """OpenAI chat logprobs ({"content": [...]}) or completion logprobs as Ollama's list."""
    if not lp:
        return None
    if "content" in lp:
        return [{"token": e["token"], "logprob": e["logprob"],
                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e.get("top_logprobs") or []]}
                for e in lp["content"] or []]
    return [{"token": tok, "logprob": l, "top_logprobs": [{"token": k, "logprob": v} for k, v in (top or {}).items()]}
            for tok, l, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [],
                                   lp.get("top_logprobs") or [None] * len(lp.get("tokens") or []))]


def final_fields(finish: str | None, usage: dict | None, durations: dict) -> dict:
    usage = usage or {}
    out = {"done": True, "done_reason": DONE_REASON.get(finish or "stop", finish or "stop"), **durations}
    if "prompt_tokens" in usage:
        out["prompt_eval_count"] = usage["prompt_tokens"]
    if "completion_tokens" in usage:
        out["eval_count"] = usage["completion_tokens"]
    return out

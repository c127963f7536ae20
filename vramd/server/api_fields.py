"""Every field a request body of /v1/chat/completions or /v1/completions may carry, and what vramd does with it.

Owns `FIELDS`, the table (one row per field of the OpenAI API reference, as
the openai SDK's `types/chat/completion_create_params.py` and
`types/completion_create_params.py` list them, plus the llama.cpp server's
extras that clients send), and `check(kind, body)`, which parse_request
runs first: a field not in the table for the endpoint is a 400 naming it
and listing what is taken; a refused field is a 400 saying what is
supported instead; a field taken only for some values checks them.  No
field is silently ignored: each row says what vramd does with it, and
docs/operations.md ("Request fields") is `markdown()`'s rendering of the
table (tests/integration/test_api_surface.py holds the two together).

A JSON null is "not given", for every field (the SDKs send null for None).

Status of a field on an endpoint:

    yes        implemented (openai_api.parse_request and the engine)
    accepted   taken and checked, nothing to do: the note says why
    some       some values taken (the note says which), the others a 400
    refused    a 400 that says what is supported
    other      handled by another module, named in the note
    (absent)   not a field of this endpoint: a 400 as an unknown field
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vramd.errors import UsageError

STATUSES = ("yes", "accepted", "some", "refused", "other")
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class FieldError(UsageError):
    """A 400 about one field: OpenAI's error object names it in `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Field:
    name: str
    chat: str | None          # its status on /v1/chat/completions (None: not a field there)
    completion: str | None    # on /v1/completions
    note: str                 # what vramd does: the docs' table says it as written here
    check: Callable | None = None   # "some": raises FieldError for a value not taken
    origin: str = "OpenAI"    # "llama.cpp": one of llama-server's extras


def _only(name: str, allowed: tuple, why: str) -> Callable:
    def check(value) -> None:
        # JSON's true is not 1 (nor false 0), though Python's `in` says so.
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            shown = " or ".join(repr(a) if not isinstance(a, bool) else str(a).lower() for a in allowed)
            raise FieldError(name, f"'{name}': {value!r} is not supported, only {shown}: {why}")
    return check


def _string(name: str, limit: int) -> Callable:
    def check(value) -> None:
        if not isinstance(value, str) or len(value) > limit:
            raise FieldError(name, f"'{name}' must be a string of at most {limit} characters")
    return check


def _metadata(value) -> None:
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise FieldError("metadata", "'metadata' must be an object of at most 16 string values "
                                     "(keys up to 64 characters, values up to 512)")


def _modalities(value) -> None:
    if value != ["text"]:
        raise FieldError("modalities", f"'modalities': {value!r} is not supported, only [\"text\"]: "
                                       "vramd generates text only")


def _stream_options(value) -> None:
    if not isinstance(value, dict):
        raise FieldError("stream_options", "'stream_options' must be an object")
    for k in value:
        if k not in ("include_usage", "include_obfuscation"):
            raise FieldError("stream_options", f"'stream_options.{k}' is not supported: vramd takes include_usage "
                                               "and include_obfuscation (false)")
    if value.get("include_obfuscation") not in (None, False):
        raise FieldError("stream_options", "'stream_options.include_obfuscation': only false: vramd pads no "
                                           "stream (it serves a local model, not a shared service)")


def _refused(name: str, why: str) -> Callable:
    def check(_value) -> None:
        raise FieldError(name, f"'{name}' is not supported: {why}")
    return check


def _row(name, chat, completion, note, check=None, origin="OpenAI") -> Field:
    return Field(name, chat, completion, note, check, origin)


B = "yes"  # on both endpoints, the same
_CHAIN = ("vramd's sampler chain is logit_bias, the penalties, top_k, top_p, min_p, temperature, and no other "
          "(vramd/engine/sampler.py)")
_TOOLS = ("tool calls: vramd/server/structured.py (the field), tools.py (the template's format, the call's "
          "grammar), toolcalls.py (the calls parsed, streamed)")
_FORMAT = "constrained sampling: vramd/server/structured.py (the field), vramd/engine/grammar.py (the mask)"

FIELDS: dict[str, Field] = {f.name: f for f in [
    # -- the request itself
    _row("model", B, B, "the daemon's `--name`, an `--alias`, or the model file's name; another: 404 listing them"),
    _row("messages", "yes", None, "rendered with the model's chat template; `text` and `image_url` (data: URI) parts"),
    _row("prompt", None, "yes", "a string, a list of strings, token ids, or a list of token-id lists: several prompts "
                                "are several choices (`n` each)"),
    # -- how much, how many
    _row("max_tokens", B, B, "the most tokens to generate (completions: 16 when not given; chat: until the end or "
                             "the context is full)"),
    _row("max_completion_tokens", "yes", None, "the same as `max_tokens` (which it wins over)"),
    _row("n", B, B, "1 to 16 choices (at most 16 in all with several prompts), generated one after another; "
                    "choice i samples with `seed + i`"),
    _row("best_of", None, "some", "only equal to `n` (or 1): vramd returns every sequence it samples; ask `n` and "
                                  "rank them yourself (checked with `n`, in parse_request)"),
    _row("stop", B, B, "up to 4 strings; the text ends before the first"),
    _row("echo", None, "yes", "the prompt before the completion"),
    _row("stream", B, B, "server-sent events; the headers go out at once, `: keep-alive` comments every 2 s until "
                         "the first token"),
    _row("stream_options", "some", "some", "`include_usage` (a last chunk with the usage); `include_obfuscation` "
                                           "only false", check=_stream_options),
    # -- sampling
    _row("temperature", B, B, "0 to 2; 0 is greedy"),
    _row("top_p", B, B, "nucleus sampling, 0 to 1"),
    _row("seed", B, B, "0 to 2^64-1: the same seed, the same tokens (vramd's generator, not OpenAI's or llama.cpp's)"),
    _row("frequency_penalty", B, B, "-2 to 2, OpenAI's formula over the tokens generated so far"),
    _row("presence_penalty", B, B, "-2 to 2, OpenAI's formula over the tokens generated so far"),
    _row("logit_bias", B, B, "token id -> -100..100 added to its logit before sampling (ids checked against "
                             "the vocabulary)"),
    _row("logprobs", B, B, "chat: true for each token's log-probability; completions: 0 to 20 alternatives per "
                           "token (the model's distribution, before penalties and bias)"),
    _row("top_logprobs", "yes", None, "0 to 20 alternatives per token; needs `logprobs: true`"),
    # -- bookkeeping OpenAI does and a local daemon has no use for
    _row("user", B, B, "at most 256 characters, written in the request's log line (`user=`)",
         check=_string("user", 256)),
    _row("safety_identifier", "accepted", None, "at most 128 characters, written in the request's log line",
         check=_string("safety_identifier", 128)),
    _row("metadata", "accepted", None, "checked (16 string values at most) and not kept: OpenAI keeps it with a "
                                       "stored completion and vramd stores none", check=_metadata),
    _row("store", "some", None, "only false: vramd stores no completion",
         check=_only("store", (False,), "vramd stores no completion")),
    _row("service_tier", "some", None, "only `auto` or `default`: one tier",
         check=_only("service_tier", ("auto", "default"), "vramd has one service tier")),
    _row("prompt_cache_key", "accepted", None, "at most 1024 characters; not needed: the prefix cache is automatic "
                                               "(the one slot's tokens are reused whatever the key)",
         check=_string("prompt_cache_key", 1024)),
    _row("prompt_cache_retention", "some", None, "only `in_memory`: the KV cache lives with the daemon",
         check=_only("prompt_cache_retention", ("in_memory",), "the KV cache lives in the daemon's memory")),
    _row("modalities", "some", None, "only `[\"text\"]`", check=_modalities),
    # -- owned by other modules
    _row("tools", "other", None, _TOOLS),
    _row("tool_choice", "other", None, _TOOLS),
    _row("parallel_tool_calls", "other", None, _TOOLS),
    _row("response_format", "other", None, _FORMAT),
    _row("suffix", None, "other", "fill-in-the-middle with the vocabulary's FIM tokens, a 400 naming the missing "
                                  "ones (vramd/engine/fim.py, vramd/server/prompts.py)"),
    # -- refused: vramd has no such thing
    _row("audio", "refused", None, "vramd generates text only", check=_refused("audio", "vramd generates text only")),
    _row("prediction", "refused", None, "predicted outputs are not implemented",
         check=_refused("prediction", "predicted outputs are not implemented; send the text in the messages")),
    _row("web_search_options", "refused", None, "vramd searches nothing (it reaches no network)",
         check=_refused("web_search_options", "vramd searches nothing (it reaches no network)")),
    _row("moderation", "refused", None, "vramd runs no moderation",
         check=_refused("moderation", "vramd runs no moderation")),
    _row("reasoning_effort", "refused", None, "no such control; a template's own switch (Qwen3's `enable_thinking`) "
                                              "goes in `chat_template_kwargs`; where the reasoning goes, in "
                                              "`reasoning_format`",
         check=_refused("reasoning_effort", "no such control here; a chat template's own switch (Qwen3's "
                                            "enable_thinking) goes in chat_template_kwargs")),
    _row("verbosity", "refused", None, "no such control",
         check=_refused("verbosity", "no such control; say it in the messages")),
    _row("prompt_cache_options", "refused", None, "no cache breakpoints: the prefix cache is automatic",
         check=_refused("prompt_cache_options", "the prefix cache is automatic; there are no breakpoints to set")),
    _row("functions", "refused", None, "deprecated by OpenAI: send `tools`",
         check=_refused("functions", "it is deprecated by OpenAI: send 'tools'")),
    _row("function_call", "refused", None, "deprecated by OpenAI: send `tool_choice`",
         check=_refused("function_call", "it is deprecated by OpenAI: send 'tool_choice'")),
    # -- llama.cpp's server: the extras clients send
    _row("top_k", B, B, "the k most likely tokens (0: off)", origin="llama.cpp"),
    _row("min_p", B, B, "tokens within a factor of the best one's probability (0: off)", origin="llama.cpp"),
    _row("repeat_penalty", B, B, "llama.cpp's, over the last `repeat_last_n` tokens of prompt and answer (1: off)",
         origin="llama.cpp"),
    _row("repeat_last_n", B, B, "the window of `repeat_penalty` (64; -1: all, 0: off)", origin="llama.cpp"),
    _row("n_predict", B, B, "llama.cpp's `max_tokens` (-1: until the end); both given: the same value or a 400",
         origin="llama.cpp"),
    _row("cache_prompt", "some", "some", "only true: the cached prefix is always reused",
         check=_only("cache_prompt", (True,), "vramd always reuses the cached prefix"), origin="llama.cpp"),
    _row("reasoning_format", "other", None, "`none`, `deepseek` or `auto`: where a `<think>` block goes "
                                            "(`reasoning_content` or `content`; vramd/server/reasoning.py)",
         origin="llama.cpp"),
    _row("chat_template_kwargs", "yes", None, "variables for the chat template (e.g. `{\"enable_thinking\": false}`)",
         origin="llama.cpp"),
    _row("grammar", "some", "some", "only empty: GBNF grammars are not taken; send `response_format`",
         check=_only("grammar", ("",), "GBNF grammars are not taken; send 'response_format'"), origin="llama.cpp"),
    _row("json_schema", "refused", "refused", "send `response_format` with `json_schema`",
         check=_refused("json_schema", "send 'response_format': {\"type\": \"json_schema\", ...}"),
         origin="llama.cpp"),
    _row("n_probs", "some", "some", "only 0: send `logprobs` (and `top_logprobs`)",
         check=_only("n_probs", (0,), "send 'logprobs' (and 'top_logprobs' for chat)"), origin="llama.cpp"),
    _row("ignore_eos", B, B, "true: the end-of-generation tokens are never drawn (banned, as llama.cpp does), so "
                             "the generation runs to `max_tokens` or the full context", origin="llama.cpp"),
    _row("n_cmpl", "refused", "refused", "send `n`", check=_refused("n_cmpl", "send 'n'"), origin="llama.cpp"),
    _row("id_slot", "some", "some", "only -1 (any): a request takes the slot whose cached tokens share the longest "
                                    "prefix with its prompt, else the least recently used",
         check=_only("id_slot", (-1,), "the daemon chooses the slot (the longest shared prefix)"), origin="llama.cpp"),
    # Samplers vramd does not have: taken at the value that turns them off (clients send every knob).
    *(_row(name, "some", "some", f"only {off}, off: {_CHAIN}", check=_only(name, (off,), _CHAIN),
           origin="llama.cpp")
      for name, off in (("typical_p", 1), ("mirostat", 0), ("dry_multiplier", 0), ("xtc_probability", 0),
                        ("top_n_sigma", -1), ("dynatemp_range", 0))),
    _row("samplers", "refused", "refused", _CHAIN, check=_refused("samplers", _CHAIN), origin="llama.cpp"),
]}


def accepted(kind: str) -> list[str]:
    """The fields an endpoint takes (every status but refused)."""
    return sorted(name for name, f in FIELDS.items() if getattr(f, kind) not in (None, "refused"))


def check(kind: str, body: dict) -> None:
    """A 400 (FieldError) for the first field of `body` that `kind`'s endpoint does not take."""
    for name, value in body.items():
        f = FIELDS.get(name)
        status = getattr(f, kind) if f is not None else None
        if status is None:
            other = next((k for k, p in PATHS.items() if k != kind and f is not None and getattr(f, k)), None)
            where = f"it is a field of {PATHS[other]}" if other else "vramd does not know it"
            raise FieldError(name, f"unknown field '{name}' for {PATHS[kind]} ({where}); the fields taken are "
                                   f"{', '.join(accepted(kind))} (docs/operations.md, Request fields)")
        if value is None or status == "other":
            continue
        if status == "refused" and f.check is None:
            raise FieldError(name, f"'{name}' is not supported: {f.note}")
        if f.check is not None:
            f.check(value)


def markdown() -> str:
    """The table as docs/operations.md shows it."""
    rows = ["| field | chat | completions | from | what vramd does |", "| --- | --- | --- | --- | --- |"]
    for f in FIELDS.values():
        rows.append(f"| `{f.name}` | {f.chat or '—'} | {f.completion or '—'} | {f.origin} | {f.note} |")
    return "\n".join(rows)

"""Chat templates: the messages of a chat request rendered into one prompt.

Owns: compiling a model's `tokenizer.chat_template` (Jinja2) in a sandbox,
choosing a default template when the file has none (by architecture and
vocabulary), checking the messages' shape, and rendering them with the
variables Hugging Face's `apply_chat_template` provides (`messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text).

Does not own: tokenizing (vramd.engine.tokenizer; `encode_prompt` here is the
one rule for a rendered prompt: special tokens parsed, one BOS), HTTP
(vramd.server).

Templates come from untrusted files, so they run in Jinja2's
ImmutableSandboxedEnvironment (no attribute access to internals, no mutation of
the caller's objects), with the string/list repetition operator bounded and
the output size capped.  A template that does not compile is a `ModelError`
when the template is loaded; one that fails on a request's messages (its own
`raise_exception`, a type error, the caps) is a `UsageError`, an HTTP 400.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vramd.engine import chat_polyfill
from vramd.errors import ModelError, UsageError

MAX_OUTPUT_CHARS = 16 << 20       # far above any context window's worth of text
MEDIA_MARKER = "<__vramd_media__>"   # where an image sits in a rendered chat prompt
MAX_REPEAT_CHARS = 1 << 20        # "x" * n and [..] * n inside a template
# A template's source: compiling costs ~10 us a character on a slow core, so a file's
# 16 MiB string would take minutes at load; real templates are a few KiB (the longest
# known, with tool-calling sections, tens of KiB).
MAX_TEMPLATE_CHARS = 1 << 18

# --- default templates (used when the file carries none) --------------------------------

# Gemma 3's template as Google publishes it with the model (tokenizer_config.json).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Llama 2 chat ([INST] ... [/INST], <<SYS>> folded into the first user turn).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Gemma 4's turns, as its template (tests/ggufgen/templates/gemma-4.jinja) renders a
# conversation of plain text messages: no tools, thinking off (the empty thought channel
# after the generation prompt), a system or developer message as a system turn.
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% set loop_messages = messages %}"
    "{% if messages[0]['role'] in ['system', 'developer'] %}"
    "{{ '<|turn>system\n' + messages[0]['content'] | trim + '<turn|>\n' }}"
    "{% set loop_messages = messages[1:] %}{% endif %}"
    "{% for message in loop_messages %}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + message['content'] | trim + '<turn|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}{% endif %}"
)

# Llama 3 (header tokens around the role, <|eot_id|> after each turn).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# ChatML (Qwen2 and many others).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def default_template(architecture: str | None, tokenizer) -> tuple[str, str]:
    """(name, source) of the template used when a file has none."""
    if architecture == "gemma4" or tokenizer.token_id("<|turn>") is not None:
        return "gemma4", GEMMA4_TEMPLATE
    if architecture in ("gemma", "gemma2", "gemma3") or tokenizer.token_id("<start_of_turn>") is not None:
        return "gemma", GEMMA_TEMPLATE
    if tokenizer.token_id("<|start_header_id|>") is not None:
        return "llama3", LLAMA3_TEMPLATE
    if architecture == "qwen2" or tokenizer.token_id("<|im_start|>") is not None:
        return "chatml", CHATML_TEMPLATE
    if architecture == "llama" and tokenizer.kind == "spm":
        return "llama2", LLAMA2_TEMPLATE
    # llama.cpp falls back to ChatML too when it recognises nothing.
    return "chatml", CHATML_TEMPLATE


# --- the sandbox ------------------------------------------------------------------

class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, with `*` and `**` unable to build huge values."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("exponent too large in a chat template")
            return left ** right
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * max(count, 0) > MAX_REPEAT_CHARS:
                        raise SecurityError("repetition too large in a chat template")
            return left * right
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str = "the chat template refused the messages"):
    raise TemplateError(str(message))


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # As transformers' chat templates: non-ASCII text stays as it is.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                   extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# --- the template --------------------------------------------------------------------

class ChatTemplate:
    """A compiled chat template and the special-token strings it is given."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 name: str = "file"):
        self.source = source
        self.name = name                      # "file", or the default's name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._caps: chat_polyfill.Capabilities | None = None
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ModelError(f"the chat template has {len(source)} characters, more than the "
                             f"limit {MAX_TEMPLATE_CHARS}")
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
            raise ModelError(f"the chat template does not compile{where}: "
                             f"{_one_line(exc)}") from None
        except RecursionError:  # Jinja's parser and Python's compiler recurse on nesting
            raise ModelError("the chat template does not compile: expressions or blocks "
                             "nested too deeply") from None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokenizer) -> "ChatTemplate":
        """The file's `tokenizer.chat_template`, or the default for its
        architecture; `bos_token`/`eos_token` are the pieces of the vocabulary's
        BOS and EOS tokens."""
        bos = tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
        eos = tokenizer.tokens[tokenizer.eos_id] if tokenizer.eos_id is not None else ""
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, bos_token=bos, eos_token=eos, name="file")
        name, source = default_template(metadata.get("general.architecture"), tokenizer)
        return cls(source, bos_token=bos, eos_token=eos, name=name)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).
        `extra` variables (e.g. `tools`) are passed to the template as they are; tool
        messages and tools a template cannot render are rewritten as llama.cpp does
        (vramd/engine/chat_polyfill.py)."""
        messages = _check_messages(messages)
        if chat_polyfill.needs_adapting(messages, extra):
            messages = chat_polyfill.adapt(messages, extra, self.capabilities)
        return self._render(messages, add_generation_prompt, extra)

    @property
    def capabilities(self) -> chat_polyfill.Capabilities:
        """What this template renders of tools and tool messages (probed once)."""
        if self._caps is None:
            self._caps = chat_polyfill.Capabilities.probe(
                lambda messages, **extra: self._render(_check_messages(messages), True, extra), self.source)
        return self._caps

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: dict) -> str:
        context = {**extra, "messages": messages,
                   "add_generation_prompt": bool(add_generation_prompt),
                   "bos_token": self.bos_token, "eos_token": self.eos_token}
        size = 0
        parts = []
        try:
            for chunk in self._template.generate(context):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise SecurityError(f"output exceeds {MAX_OUTPUT_CHARS} characters")
                parts.append(chunk)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                ZeroDivisionError, OverflowError, RecursionError) as exc:
            raise UsageError(f"chat template ({self.name}): {_one_line(exc)}") from None
        return "".join(parts)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a rendered chat prompt, with exactly one BOS where the
    vocabulary wants one.  Templates write the BOS token as text; as llama.cpp
    does, a leading BOS text is dropped and the tokenizer adds the token, and
    the rest is tokenized with special tokens parsed."""
    bos = tokenizer.tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else None
    if bos and tokenizer.add_bos and prompt.startswith(bos):
        prompt = prompt[len(bos):]
    return tokenizer.encode(prompt, add_special=True, parse_special=True)


def render_chat(source: str, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                **extra: Any) -> str:
    """One-shot: compile `source` and render `messages`."""
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token).render(
        messages, add_generation_prompt, **extra)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Plain copies of the messages, after checking their shape: a non-empty
    list of objects with a string `role` and a `content` that is a string, a
    list of content parts, or null (an assistant turn with tool calls only)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UsageError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise UsageError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise UsageError(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if content is None:
            # An assistant turn of tool calls only keeps None: some templates render the calls only then.
            content = None if message.get("tool_calls") else ""
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                    raise UsageError(f"messages[{i}].content[{j}] must be an object with a type")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise UsageError(f"messages[{i}].content[{j}].text must be a string")
            content = [dict(part) for part in content]
        elif not isinstance(content, str):
            raise UsageError(f"messages[{i}].content must be a string, a list of parts or null")
        out.append({**message, "role": role, "content": content})
    return out


def text_content(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose list-of-parts contents are joined into one string (text
    parts, separated by newlines), for templates that expect strings.  A part
    that is not text is refused: vramd serves text models."""
    out = []
    for i, message in enumerate(_check_messages(messages)):
        content = message["content"]
        if isinstance(content, list):
            kinds = {part["type"] for part in content} - {"text"}
            if kinds:
                raise UsageError(f"messages[{i}]: content parts of type "
                                 f"{', '.join(sorted(kinds))} are not supported")
            content = "\n".join(part["text"] for part in content)
        out.append({**message, "content": content})
    return out


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text

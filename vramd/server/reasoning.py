"""A thinking model's reasoning (`<think>...</think>`) split from its answer, as llama.cpp's
server does by default: `reasoning_content` beside `content`.

Owns the reasoning format of a request (`--reasoning-format`, the request's
`reasoning_format`, llama.cpp's names and default):
    auto      (default) the block is split off when the chat template is a
              thinking one (it mentions <think>: Qwen3, QwQ, DeepSeek-R1 and
              their distills)
    deepseek  split a leading <think> block whatever the template
    none      the text is left as the model wrote it, in `content`
`plan` (what a request gets: None, or `Reasoning(open)`, `open` when the
template's generation prompt already opens the block, as Qwen3-Thinking-2507's
and DeepSeek-R1-0528's do, so the model's output starts inside it) and
`ReasoningSplit`, the streamed split.  A block is only one at the very
start of the answer (after spaces), as llama.cpp reads it: a "<think>" later
in the text is text.  A generation that ends inside the block is all
reasoning, its content empty.

Does not own: the message's fields (vramd/server/assistant.py), nor the
grammar of a constrained answer, which under an open block must first close
it (vramd/server/tools.py puts `CLOSE` in front).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramd.errors import UsageError

FORMATS = ("auto", "deepseek", "none")
START, END = "<think>", "</think>"
CLOSE = END + "\n\n"      # what a constrained answer writes first under an open block


@dataclass(frozen=True)
class Reasoning:
    open: bool = False        # the prompt opened the block: the answer starts inside it
    harmony: bool = False     # gpt-oss's channels instead of a block (vramd/server/harmony.py)
    inline: bool = False      # harmony under reasoning_format "none": the analysis channel stays in content


def request_format(body: dict, kind: str) -> str | None:
    v = body.get("reasoning_format")
    if v is None:
        return None
    if kind != "chat":
        raise UsageError("'reasoning_format' is for /v1/chat/completions, not /v1/completions")
    if v not in FORMATS:
        raise UsageError(f"'reasoning_format' must be one of {', '.join(FORMATS)}, got {v!r}")
    return v


def plan(template, fmt: str | None, template_kwargs: dict) -> Reasoning | None:
    """What a chat request under `template` gets: None (the text stays as written) or a split."""
    fmt = fmt or "auto"
    if template is None:
        return None
    src = template.source
    from vramd.server.harmony import is_harmony
    if is_harmony(template):   # its channels are read whatever the format: "none" only keeps the analysis in content
        return Reasoning(harmony=True, inline=fmt == "none")
    if fmt == "none":
        return None
    if fmt == "auto" and START not in src and END not in src:
        return None
    return Reasoning(open=opens_block(template, template_kwargs))


def opens_block(template, template_kwargs: dict) -> bool:
    """Whether the template's generation prompt ends inside an open <think> block (found by
    rendering one probe turn with the request's own variables, enable_thinking among them)."""
    kwargs = {k: v for k, v in template_kwargs.items() if k != "tools"}
    # Rendered once per template and set of variables (a chat request's hot path), not per request.
    cache = template.__dict__.setdefault("_vramd_opens_block", {})
    try:
        key = tuple(sorted(kwargs.items()))
        hash(key)
    except TypeError:     # a variable that is not a scalar: probed every time
        key = None
    if key is not None and key in cache:
        return cache[key]
    try:
        text = template.render([{"role": "user", "content": "vramd_probe"}], add_generation_prompt=True, **kwargs)
        opens = text.rstrip().endswith(START)
    except Exception:     # the template's refusal of the probe: it opens nothing we can see
        opens = False
    if key is not None and len(cache) < 64:
        cache[key] = opens
    return opens


class ReasoningSplit:
    """Streamed text in, (reasoning text, answer text) out."""

    def __init__(self, open_: bool):
        self.state = "in" if open_ else "lead"
        self.pending = ""        # text not yet judged: a possible "<think>" or "</think>"

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.pending = self.pending + text, ""
        if self.state == "lead":
            lead = buf.lstrip()
            if len(lead) < len(START) and START.startswith(lead):
                self.pending = buf
                return "", ""
            if not lead.startswith(START):
                self.state = "after"
                return "", buf
            self.state, buf = "in", lead[len(START):]
        if self.state == "in":
            at = buf.find(END)
            if at >= 0:
                self.state = "after"
                return buf[:at], buf[at + len(END):]
            hold = next((n for n in range(min(len(buf), len(END) - 1), 0, -1) if END.startswith(buf[-n:])), 0)
            self.pending = buf[len(buf) - hold:]
            return buf[:len(buf) - hold], ""
        return "", buf

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "in" else ("", rest)

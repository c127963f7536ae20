"""OpenAI's harmony response format (gpt-oss): the answer's channels split into
`reasoning_content` and `content`, as llama.cpp's server does for gpt-oss.

The generation prompt ends with `<|start|>assistant`; the model then writes
messages of the form
    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>
(the header between `<|start|>` and `<|message|>` names the channel, and for
a tool call a recipient `to=functions.NAME` and `<|constrain|>json`; a call
ends with `<|call|>`).  The `analysis` channel is reasoning; `final` and
`commentary` (a preamble) are content.  The markers are control tokens, so a
harmony request decodes control tokens as text (vramd/server/tools.py).
Text that does not start with a header is content as written (with tools, a
leading ` to=functions.NAME` is a header: the recipient right after the
prompt's `<|start|>assistant`, llama.cpp's "^ to" trigger).

Owns `is_harmony(template)` and `HarmonySplit` (the interface of
reasoning.ReasoningSplit: feed(text) -> (reasoning, content), finish(); and
`take_calls()`, the tool calls completed so far).  A message whose header
names a recipient `to=functions.NAME` (before or after the channel, as
llama.cpp's gpt-oss parser accepts) is a call: its body is the arguments,
handed out whole as one tool_calls delta when the call ends (<|call|>, or
the end of the text).
"""

from __future__ import annotations

import re

from vramd.server.toolcalls import new_id

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_LONGEST = max(len(m) for m in (CHANNEL, MESSAGE, START, *ENDS))
ROLE_TO = "to=functions."
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def is_harmony(template) -> bool:
    """A template that renders harmony (gpt-oss's): it writes channels and messages."""
    src = getattr(template, "source", "") or ""
    return CHANNEL in src and MESSAGE in src


def _partial_marker(buf: str) -> int:
    """Chars at the end of buf that may begin a marker (a '<|' not yet closed)."""
    at = buf.rfind("<")
    if at < 0 or len(buf) - at >= _LONGEST or ">" in buf[at:]:
        return 0
    return len(buf) - at


class HarmonySplit:
    """Streamed text in, (reasoning text, content text) out."""

    def __init__(self, inline: bool = False, calls: bool = True):
        # inline (reasoning_format "none"): the analysis channel's text is content too, as llama.cpp
        # keeps it; calls False (the request has no tools to call): a message to a function is content,
        # not a tool call (llama.cpp's parser drops such unsolicited calls; here nothing is lost)
        self.inline, self.take_calls_at_all = inline, calls
        self.state = "lead"      # lead, header, body, plain (no harmony at all), done
        self.channel = ""
        self.pending = ""
        self.recipient: str | None = None   # the function the current message calls
        self.args = ""
        self.calls: list[dict] = []         # completed, not yet taken
        self.n_calls = 0
        self.role_lead = False              # the text began " to=functions.": a header only if one follows

    def take_calls(self) -> list[dict]:
        out, self.calls = self.calls, []
        return out

    def _close_call(self) -> None:
        if self.recipient is not None:
            self.calls.append({"index": self.n_calls, "id": new_id("harmony"), "type": "function",
                               "function": {"name": self.recipient, "arguments": self.args.strip()}})
            self.n_calls += 1
            self.recipient, self.args = None, ""

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.pending = self.pending + text, ""
        thought, content = [], []
        while buf:
            if self.state == "lead":
                lead = buf.lstrip()
                # a call may name its recipient first, right after the prompt's <|start|>assistant
                heads = (CHANNEL, START, ROLE_TO) if self.take_calls_at_all else (CHANNEL, START)
                if len(lead) < len(ROLE_TO) and any(h.startswith(lead) for h in heads):
                    self.pending = buf
                    break
                self.state = "header" if lead.startswith(heads) else "plain"
                self.role_lead = lead.startswith(ROLE_TO)
                buf = lead if self.state == "header" else buf
            elif self.state == "plain":
                content.append(buf)
                buf = ""
            elif self.state == "header":
                at = buf.find(MESSAGE)
                if at < 0:
                    self.pending = buf
                    break
                head = buf[:at]
                name = head.split(CHANNEL, 1)[1] if CHANNEL in head else ""
                self.channel = name.split("<|", 1)[0].split(" ", 1)[0].strip()
                to = _RECIPIENT.search(head) if self.take_calls_at_all else None
                self.recipient = to.group(1) if to else None
                self.state, buf, self.role_lead = "body", buf[at + len(MESSAGE):], False
            elif self.state == "body":
                ends = [(buf.find(m), m) for m in ENDS if m in buf]
                if ends:
                    at, marker = min(ends)
                    out, buf = buf[:at], buf[at + len(marker):]
                    self.state = "header" if marker in ("<|end|>", "<|call|>") else "done"
                else:
                    hold = _partial_marker(buf)
                    out, self.pending, buf = buf[:len(buf) - hold], buf[len(buf) - hold:], ""
                if self.recipient is not None:
                    self.args += out
                    if ends:
                        self._close_call()
                else:
                    (thought if self.channel == "analysis" and not self.inline else content).append(out)
            else:   # done: whatever follows a <|return|> or <|call|> is not part of the answer
                buf = ""
        return "".join(thought), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if self.state == "body" and self.recipient is not None:
            self.args += rest
            self._close_call()
            return "", ""
        if self.state == "body":
            return (rest, "") if self.channel == "analysis" and not self.inline else ("", rest)
        # plain text that only began like a recipient (no <|message|> came) stays content
        return ("", rest) if self.state in ("lead", "plain") or self.role_lead else ("", "")

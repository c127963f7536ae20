"""An incremental JSON scanner: one value's text fed in pieces, with where each
nested value starts and ends, as the text arrives.

Owns `JsonScan`.  vramd/server/toolcalls.py runs one over a tool call's JSON
so that it can send the call's name as soon as it is whole and its
`arguments` text as it is generated, which a parser of whole documents
(json) cannot do, and a partial-JSON parser from PyPI (partial-json-parser,
jiter's partial mode) does not either: they give the *value* of a prefix,
re-serialized, not the positions of the raw text, and the raw text is what
OpenAI streams and what must add up to the non-streamed `arguments`.

`feed(text)` consumes characters until the value is complete (the rest is
not its business: a `</tool_call>` after the JSON) and returns how many it
took; `events` collects ("start" | "end", path, position) for every value,
path being the keys and indices from the root (() for the root itself),
position an offset in the characters fed so far (an end's is one past the
value's last character).  A key is reported as the path of the value after
it.  Anything that is not JSON sets `error` (and `feed` stops there):
strings are checked for their escapes and control characters, numbers
against JSON's grammar, literals letter by letter.
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_WS = frozenset(" \t\n\r")


class JsonScan:
    def __init__(self):
        # frames of the open containers: [kind "{" or "[", state, key or index]
        self.stack: list[list] = []
        self.state = "value"         # at the root: "value", then "done"
        self.pos = 0                 # characters consumed
        self.events: list[tuple[str, tuple, int]] = []
        self.error = False
        self._tok: str | None = None     # "key", "str", "num", "lit": a token in progress
        self._tok_start = 0
        self._tok_text: list[str] = []
        self._esc = 0                # in a string: 1 after a backslash, 2..5 the hex digits of \\u

    @property
    def done(self) -> bool:
        return self.state == "done"

    def path(self) -> tuple:
        return tuple(f[2] for f in self.stack)

    def feed(self, text: str) -> int:
        """Consume from `text` up to the end of the value; the number of characters taken."""
        for i, ch in enumerate(text):
            if self.done or self.error:
                return i
            if not self._step(ch):
                self.error = True
                return i
            self.pos += 1
        return len(text)

    def finish(self) -> None:
        """The text ended: a number at the root ends with it."""
        if self._tok == "num" and not self.stack:
            self._end_number()

    # -- one character --------------------------------------------------------------

    def _step(self, ch: str) -> bool:
        if self._tok in ("key", "str"):
            return self._string(ch)
        if self._tok == "num":
            if ch in _NUMBER_CHARS:
                self._tok_text.append(ch)
                return True
            if not self._end_number():
                return False
        elif self._tok == "lit":
            word = "".join(self._tok_text) + ch
            if not any(w.startswith(word) for w in _LITERALS):
                return False
            self._tok_text.append(ch)
            if word in _LITERALS:
                self._tok = None
                self._value_done(self.pos + 1)
            return True
        if ch in _WS:
            return True
        frame = self.stack[-1] if self.stack else None
        state = frame[1] if frame else self.state
        if state in ("value", "value_or_end"):
            if ch == "]" and state == "value_or_end":
                return self._close("[")
            return self._value(ch)
        if state in ("key", "key_or_end"):
            if ch == "}" and state == "key_or_end":
                return self._close("{")
            if ch != '"':
                return False
            self._begin("key")
            return True
        if state == "colon":
            if ch != ":":
                return False
            frame[1] = "value"
            return True
        if state == "comma_or_end":
            if ch == ",":
                if frame[0] == "{":
                    frame[1] = "key"
                else:
                    frame[1], frame[2] = "value", frame[2] + 1
                return True
            if ch in "}]":
                return self._close("{" if ch == "}" else "[")
        return False

    def _value(self, ch: str) -> bool:
        path, at = self.path(), self.pos
        if ch == "{" or ch == "[":
            self.events.append(("start", path, at))
            self.stack.append([ch, "key_or_end" if ch == "{" else "value_or_end", None if ch == "{" else 0])
            return True
        if ch == '"':
            self.events.append(("start", path, at))
            self._begin("str")
            return True
        if ch == "-" or ch.isdigit():
            self.events.append(("start", path, at))
            self._begin("num", ch)
            return True
        if ch in "tfn":
            self.events.append(("start", path, at))
            self._begin("lit", ch)
            return True
        return False

    def _begin(self, kind: str, first: str = "") -> None:
        self._tok, self._tok_start, self._tok_text, self._esc = kind, self.pos, [first] if first else [], 0

    def _string(self, ch: str) -> bool:
        if self._esc == 1:
            if ch not in _ESCAPES:
                return False
            self._esc = 2 if ch == "u" else 0
        elif self._esc >= 2:
            if ch not in _HEX:
                return False
            self._esc = 0 if self._esc == 5 else self._esc + 1
        elif ch == "\\":
            self._esc = 1
        elif ch == '"':
            kind, self._tok = self._tok, None
            if kind == "key":
                frame = self.stack[-1]
                frame[1], frame[2] = "colon", json.loads('"' + "".join(self._tok_text) + '"')
            else:
                self._value_done(self.pos + 1)
            return True
        elif ord(ch) < 0x20:
            return False
        if self._tok == "key":
            self._tok_text.append(ch)
        return True

    def _end_number(self) -> bool:
        self._tok = None
        if not _NUMBER.match("".join(self._tok_text)):
            return False
        self._value_done(self.pos)
        return True

    def _close(self, kind: str) -> bool:
        if not self.stack or self.stack[-1][0] != kind:
            return False
        self.stack.pop()
        self._value_done(self.pos + 1)
        return True

    def _value_done(self, end: int) -> None:
        self.events.append(("end", self.path(), end))
        if self.stack:
            self.stack[-1][1] = "comma_or_end"
        else:
            self.state = "done"

"""What happens when a prompt, or a generation, outgrows the context (`--context-overflow`).

Owns the three policies and their arithmetic, apart from the engine that
applies them (vramd/engine/runner.py):

- `error` (the default): a prompt that does not fit is refused, a 400 that
  says how long it was and what the context holds; a generation stops when
  the context is full (finish_reason "length").
- `truncate-oldest`: a chat prompt loses its oldest turns (never the system
  messages at its start, never the last user turn) until it fits with room
  for `max_tokens` (or MIN_ROOM when the request gives none); a completion
  prompt loses its oldest tokens (a leading BOS stays).  A generation still
  stops when the context is full.
- `shift`: a prompt the context cannot hold at all is cut as by
  truncate-oldest (leaving MIN_ROOM, not max_tokens); when the context fills
  during the generation, llama.cpp's context shift: the first `n_keep`
  tokens stay (the BOS) and the oldest half of the rest goes.  vramd does it
  by prefilling the kept tokens again at their new positions (correct, and a
  prefill of at most ctx/2 tokens) rather than rotating the cached keys in
  place as llama.cpp does.

What was dropped is returned as a dict (`Dropped`), which the server puts in
the response's `usage.context` (and an `X-Vramd-Context-Dropped` header on a
non-streamed reply), so a client can tell a cut history from a whole one.
"""

from __future__ import annotations

from typing import Callable

from vramd.errors import UsageError

POLICIES = ("error", "truncate-oldest", "shift")
MIN_ROOM = 256   # tokens left for the reply when the request gives no max_tokens (at most a quarter of ctx)


def room_for(ctx: int, max_tokens: int | None) -> int:
    """Tokens to leave free after a cut prompt: max_tokens, else MIN_ROOM; at most half the context."""
    want = max_tokens if max_tokens else min(MIN_ROOM, max(ctx // 4, 1))
    return max(1, min(want, ctx // 2))


def too_long(n: int, ctx: int, what: str = "prompt") -> UsageError:
    return UsageError(f"the {what} has {n} tokens; the context holds {ctx} (--ctx {ctx}): shorten it, or start "
                      "the daemon with --context-overflow truncate-oldest (drops the oldest turns) or shift")


def cut_tokens(ids: list[int], ctx: int, room: int, bos: int | None) -> tuple[list[int], dict | None]:
    """A completion prompt's newest tokens that fit with `room` to spare (a leading BOS kept)."""
    if len(ids) + room <= ctx:
        return ids, None
    head = ids[:1] if bos is not None and ids and ids[0] == bos else []
    keep = max(ctx - room - len(head), 1)
    out = head + ids[-keep:]
    return out, {"dropped_tokens": len(ids) - len(out), "dropped_messages": 0}


def cut_turns(messages: list[dict], encode: Callable[[list[dict]], list[int]], ctx: int,
              room: int) -> tuple[list[int], dict | None]:
    """A chat's ids with its oldest turns dropped until they fit with `room` to spare.

    The system messages at the start and everything from the last user turn on
    stay; the fewest turns after the system messages are dropped, so that what
    is kept starts with a user message (templates that want the roles to
    alternate still render it), found by a binary search: each try renders and
    tokenizes once."""
    ids = encode(messages)
    if len(ids) + room <= ctx:
        return ids, None
    system = 0
    while system < len(messages) and messages[system].get("role") == "system":
        system += 1
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
    # How many messages may go: up to a user message, the last user turn at the most.
    cuts = [k for k in range(1, last_user - system + 1) if messages[system + k].get("role") == "user"]

    def fits(k: int) -> list[int] | None:
        got = encode(messages[:system] + messages[system + k:])
        return got if len(got) + room <= ctx else None

    best = fits(cuts[-1]) if cuts else None
    if best is None:
        kept = encode(messages[:system] + messages[system + (cuts[-1] if cuts else 0):])
        raise UsageError(f"the prompt has {len(kept)} tokens after dropping every older turn (the system "
                         f"messages and the last user turn stay); the context holds {ctx} (--ctx {ctx}) with "
                         f"{room} left for the reply: shorten the last turn or give a smaller max_tokens")
    lo, hi = 0, len(cuts) - 1      # cuts[hi] fits (best is its ids); find the first that does
    while lo < hi:
        mid = (lo + hi) // 2
        got = fits(cuts[mid])
        if got is not None:
            hi, best = mid, got
        else:
            lo = mid + 1
    return best, {"dropped_tokens": len(ids) - len(best), "dropped_messages": cuts[hi]}


def shifted(tokens: list[int], n_keep: int) -> list[int]:
    """llama.cpp's context shift: keep the first n_keep tokens, drop the oldest half of the rest."""
    rest = tokens[n_keep:]
    return tokens[:n_keep] + rest[len(rest) // 2:]

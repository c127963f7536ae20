"""What a generation continues, as the engine takes it: `Prompt`.

The server turns a request into a Prompt and SamplingParams
(vramd/engine/sampler.py); the engine (vramd/engine/runner.py) turns the
Prompt into token ids (rendering chat messages with the model's template)
and never sees the wire format.  Light on purpose: the HTTP side imports it
without the GPU stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramd.errors import UsageError


def check_token_ids(ids, n_vocab: int, where: str = "") -> None:
    """Token ids a client sent, each in 0..n_vocab-1 (else a UsageError, a 400, naming the
    first one outside): an id past the vocabulary would read past the embedding table."""
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise UsageError(f"{where}token id {bad} is outside the vocabulary (0..{n_vocab - 1})")



def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (a slot's cached tokens and a prompt)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Prompt:
    kind: str                                   # "completion" or "chat"
    prompt: list[int] | str | None = None       # completion: text or token ids
    messages: list[dict] | None = None          # chat: image parts already chat.MEDIA_MARKER
    images: list[bytes] = field(default_factory=list)   # encoded PNG/JPEG, in prompt order
    template_kwargs: dict = field(default_factory=dict)  # extra chat-template variables (enable_thinking)

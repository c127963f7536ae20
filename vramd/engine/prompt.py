"""What a generation continues, as the engine takes it: `Prompt`.

The server turns a request into a Prompt and SamplingParams
(vramd/engine/sampler.py); the engine (vramd/engine/runner.py) turns the
Prompt into token ids (rendering chat messages with the model's template)
and never sees the wire format.  Light on purpose: the HTTP side imports it
without the GPU stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Prompt:
    kind: str                                   # "completion" or "chat"
    prompt: list[int] | str | None = None       # completion: text or token ids
    messages: list[dict] | None = None          # chat: image parts already chat.MEDIA_MARKER
    images: list[bytes] = field(default_factory=list)   # encoded PNG/JPEG, in prompt order
    template_kwargs: dict = field(default_factory=dict)  # extra chat-template variables (enable_thinking)

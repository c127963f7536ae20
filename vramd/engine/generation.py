"""One request's generation, a token at a time: what a slot carries between engine steps.

Owns: `Generation`, the per-request state of the generation loop (its Sampler with the seed
and penalties' window, stop strings, the streaming decoder, a grammar's Constraint, the
max_tokens budget, the finish reason) and `take`, which turns one step's logits into the
next token: sample, end-of-generation, the grammar's advance, stop strings, logprobs, the
emit callback.  The engine (vramd/engine/runner.py) owns the forward passes that make the
logits, so one Generation steps the same whether its logits come from a solo decode
(`Engine.generate`, one slot) or from a row of a batch of several slots
(`Engine.generate_batch`, issue 16's continuous batching): a request's tokens depend only
on its own logits, never on what shares its step.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from vramd.engine.grammar import Constraint
from vramd.engine.sampler import Piece, Sampler, SamplingParams, StopMatcher, log_softmax, top_logprobs


class Generation:
    def __init__(self, engine, ids: list[int], params: SamplingParams, emit: Callable[[Piece], bool],
                 seq: int = 0):
        """engine: the Engine (tokenizer, stats, piece_text); ids: the prompt; emit gets each
        piece and returns False to cancel; seq: the KV cache sequence (slot) it runs on."""
        self.engine, self.ids, self.params, self.emit, self.seq = engine, list(ids), params, emit, seq
        self.sampler = Sampler(params, prompt=ids)   # repeat_penalty's window starts in the prompt
        self.stops = StopMatcher(params.stop)
        tok = engine.tokenizer
        self.decoder = tok.stream_decoder(params.special_text) if tok else None
        # A grammar masks the logits before the sampler's filters; without one, no mask work at all.
        self.constraint = Constraint(engine._need_tokenizer(), params.grammar) if params.grammar else None
        if self.constraint:
            self.constraint.prefetch()     # the first mask, beside the prefill
        # ignore_eos (llama.cpp's): the end-of-generation tokens cannot be drawn, so the generation
        # runs to max_tokens or the context and its text never holds one (llama.cpp bans them alike)
        eog = sorted(tok.eog_ids) if tok is not None and params.ignore_eos else []
        self.banned = np.array(eog, dtype=np.int64) if eog else None
        self.left = 0                      # tokens it may still sample (start sets it)
        self.finish: str | None = None     # None while it runs: "stop", "length" or "cancelled"
        self.made = 0

    def start(self, room: int | None) -> None:
        """The prompt is prefilled; room: the tokens the
        context leaves (None: no bound, the shift policy makes room)."""
        budget = self.params.max_tokens or self.engine.ctx
        self.left = max(budget if room is None else min(budget, room), 0)

    def take(self, logits) -> int | None:
        """The next token from this step's logits, emitted; None when the generation ends here
        (self.finish says why)."""
        if self.left <= 0:
            self.finish = "length"
            return None
        self.left -= 1
        c, params, tok = self.constraint, self.params, self.engine.tokenizer
        masked = c.masked(logits) if c else logits
        if self.banned is not None:
            masked = np.array(masked, dtype=np.float32)   # (a copy: the logits may be the engine's buffer)
            masked[self.banned] = -np.inf
        token = self.sampler.sample(masked)
        if tok is not None and tok.is_eog(token):
            self.finish = "stop"
            return None
        if c:
            c.advance(token)
            c.prefetch()     # the next mask, computed while the GPU runs the next step
        text = self.decoder.feed(token) if self.decoder else ""
        safe = self.stops.feed(text) if params.stop else text
        piece = Piece(token=token, text=safe)
        if params.logprobs is not None:
            lp = log_softmax(logits)
            piece.logprob = float(lp[token])
            piece.top = [(self.engine.piece_text(t), v) for t, v in top_logprobs(logits, params.logprobs)]
        self.engine.stats["generated_tokens"] += 1
        self.made += 1
        if not self.emit(piece):
            self.finish = "cancelled"
            return None
        if (params.stop and self.stops.stopped) or (c and c.done):
            self.finish = "stop"   # a stop string, or the grammar is complete
            return None
        if self.left <= 0:
            # The budget is spent: it ends here, not after one more forward pass of this token
            # (whose logits nobody samples: a step's time per request, and in a daemon a step
            # that could fall after a pause for a peer, costing two switches to run it).
            self.finish = "length"
            return None
        return token

    def end(self, finish: str | None = None) -> str:
        """The generation is over (finish: why, where the engine ends it, e.g. the context is
        full): the decoder's and stop matcher's held-back text emitted, unless cancelled."""
        if finish is not None and self.finish is None:
            self.finish = finish
        if self.finish != "cancelled":
            tail = self.decoder.flush() if self.decoder else ""
            if self.params.stop and not self.stops.stopped:
                tail = self.stops.feed(tail) + self.stops.flush()
            if tail:
                self.emit(Piece(token=-1, text=tail))
        return self.finish

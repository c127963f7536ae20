"""The decode step of n tokens, recorded once and replayed per step.

Owns what every architecture shares for decode (vramd/engine/model.py keeps
one per batch size): the mapped host buffer that carries the token ids and
positions in and the logits out ([0:4n] ids, [4n:8n] positions, in a step
of several sequences' tokens [8n:12n] their sequence ids (to the scratch's
"pos" at seq_at), then f32 logits of the last token, or of every row
(n_out = n), 16-byte aligned), the recorded graph, and when to record it
again — the residency generation moved (buffers may have), a timer was
attached, or the step's `key` changed (where the graph binds each row's
sequence's region of the KV cache instead of reading the ids).  The model gives the body: what runs between reading
the ids and positions and writing the logits.  Replaying means no Python
work per layer per token.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from vramd.engine.ops import view
from vramd.gpu.kernels import HostBuffer


class DecodeStep:
    def __init__(self, ops, residency, act: dict, n_vocab: int, n_tokens: int = 1, n_out: int = 1,
                 seq_at: int | None = None):
        self.ops, self.residency, self.act = ops, residency, act
        self.n_tokens, self.n_out, self.n_vocab, self.seq_at = n_tokens, n_out, n_vocab, seq_at
        self.n_logits = 4 * n_vocab * n_out
        self._inputs = 2 if seq_at is None else 3   # ids, positions (, sequence ids)
        self._at = -(-4 * self._inputs * n_tokens // 16) * 16   # where the logits start in the host buffer
        self.records = 0           # times the step was recorded (tests: replay, re-record after a move)
        self.runs = 0              # times it ran
        self.timer = None          # a vramd.gpu.timing.Timestamps: time each dispatch of the step
        self._graph = None         # the recorded step (a Batch)
        self._gen = None           # residency.generation it was recorded at; None: record again
        self._key = None           # the key it was recorded for
        self._io: HostBuffer | None = None

    def run(self, ids, pos, record_body: Callable[[], None], key=None, seq=None) -> np.ndarray:
        """n tokens (ids) at positions `pos` through the step: the logits of its n_out rows
        ([n_out, n_vocab]).  A `key` other than the last recording's records it again."""
        ops, a, n, t, at = self.ops, self.act, self.n_logits, 4 * self.n_tokens, self._at
        if self._io is None:
            self._io = HostBuffer(self.residency.device, at + n)
        io = self._io
        if self._graph is None:
            self._graph = ops.graph()
        if self._gen != self.residency.generation or key != self._key:
            ops.sync()
            self._gen = None       # a recording that fails half-way is never replayed
            self._graph.timer = self.timer
            with ops.record(self._graph):
                ops.copy(io.view(0, t), view(a["ids"], 0, t), t)
                ops.copy(io.view(t, t), view(a["pos"], 0, t), t)
                if self.seq_at is not None:
                    ops.copy(io.view(2 * t, t), view(a["pos"], self.seq_at, t), t)
                record_body()
                ops.copy(view(a["logits"], 0, n), io.view(at, n), n)
            self._gen, self._key = self.residency.generation, key
            self.records += 1
        ops.sync()  # the previous step is done with the host buffer
        inputs = [ids, pos] + ([seq] if self.seq_at is not None else [])
        io.array[:self._inputs * t].view(np.int32)[:] = np.concatenate([np.asarray(x, np.int32) for x in inputs])
        self._graph.submit()
        self.runs += 1
        ops.sync()
        return io.array[at:at + n].view(np.float32).reshape(self.n_out, self.n_vocab).copy()

    def profile(self, timer) -> None:
        """Times every dispatch of the step with `timer` (None: stop): re-records it."""
        self.timer = timer
        self._gen = None

    def close(self) -> None:
        if self._io is not None:
            self._io.close()
            self._io = None

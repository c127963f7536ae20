"""The one-token decode step, recorded once and replayed per token.

Owns what the llama, gemma3 and MoE models share for decode: the mapped host
buffer that carries the token id and position in and the logits out
([0:4] id, [4:8] position, [16:] f32 logits), the recorded graph, and when
to record it again — the residency generation moved (buffers may have), or
a timer was attached.  The model gives the body: what runs between reading
the id and position and writing the logits.  Replaying means no Python
work per layer per token.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from vramd.engine.ops import view
from vramd.gpu.kernels import HostBuffer


class DecodeStep:
    def __init__(self, ops, residency, act: dict, n_vocab: int):
        self.ops, self.residency, self.act = ops, residency, act
        self.n_logits = 4 * n_vocab
        self.records = 0           # times the step was recorded (tests: replay, re-record after a move)
        self.timer = None          # a vramd.gpu.timing.Timestamps: time each dispatch of the step
        self._graph = None         # the recorded step (a Batch)
        self._gen = None           # residency.generation it was recorded at; None: record again
        self._io: HostBuffer | None = None

    def run(self, token: int, pos: int, record_body: Callable[[], None]) -> np.ndarray:
        """One token at `pos` through the step: the logits ([n_vocab])."""
        ops, a, n = self.ops, self.act, self.n_logits
        if self._io is None:
            self._io = HostBuffer(self.residency.device, 16 + n)
        io = self._io
        if self._graph is None:
            self._graph = ops.graph()
        if self._gen != self.residency.generation:
            ops.sync()
            self._gen = None       # a recording that fails half-way is never replayed
            self._graph.timer = self.timer
            with ops.record(self._graph):
                ops.copy(io.view(0, 4), view(a["ids"], 0, 4), 4)
                ops.copy(io.view(4, 4), view(a["pos"], 0, 4), 4)
                record_body()
                ops.copy(view(a["logits"], 0, n), io.view(16, n), n)
            self._gen = self.residency.generation
            self.records += 1
        ops.sync()  # the previous step is done with the host buffer
        io.array[:8].view(np.int32)[:] = (token, pos)
        self._graph.submit()
        ops.sync()
        return io.array[16:16 + n].view(np.float32).copy()

    def profile(self, timer) -> None:
        """Times every dispatch of the step with `timer` (None: stop): re-records it."""
        self.timer = timer
        self._gen = None

    def close(self) -> None:
        if self._io is not None:
            self._io.close()
            self._io = None

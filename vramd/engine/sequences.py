"""The sequences of one model's KV cache (parallel slots): where each one's recurrent state is,
and the per-sequence operations on the cache.

Owns: `Sequences` (a TransformerModel's `seqs`): each sequence's recurrent-state position
(`positions`; qwen35's state holds every position before it and cannot go back, so a batch
continues it or starts over at 0: `continue_state`), a sequence's state to and from its
checkpoint (runner.py's prefix reuse), `copy` (fork a sequence into another slot), `clear`,
and whether the decode kernels read each row's sequence id (`kernels`, `input`: the whole
cache of a layer fits one binding; docs/architecture.md, "Several sequences").  The K/V and
state regions themselves are vramd/engine/kvcache.py's.
"""

from __future__ import annotations

import numpy as np

from vramd.engine.batch import TokenBatch
from vramd.errors import ModelError


class Sequences:
    def __init__(self, kv, ops, spec, path):
        self.kv, self.ops, self.path = kv, ops, path
        n, L = kv.n_seq, kv.layout
        self.positions = [0] * n
        # The decode rows of several sequences take one dispatch of each kernel reading their
        # ids where every sequence's rows of a layer fit one binding; else one per sequence.
        self.kernels = n > 1 and n * max(2 * L.ctx * L.k_width, 2 * L.ctx * L.v_width, L.conv_bytes,
                                         L.ssm_bytes) <= ops.max_range
        # ... and then a step of several sequences' decode rows reads their ids as an input:
        # one graph for any sequences (not where a layer narrower than the rows binds a region)
        self.input = self.kernels and all(spec.kv_width_of(i) == L.k_width == L.v_width
                                          for i in range(spec.n_layer) if not spec.layers[i].recurrent)

    def continue_state(self, batch: TokenBatch) -> dict:
        """With a recurrent state: each sequence's rows start at 0 or where its state is (else a
        ModelError: the caller, runner.py's prefix reuse, must re-prefill).  Returns {sequence:
        its state's position after the batch}; until the batch has run they are -1 (a failed
        batch leaves states that nothing may continue)."""
        if not self.kv.recurrent:
            return {}
        after = {}
        for r0, r1, seq in batch.segments():
            pos0, at = int(batch.pos[r0]), self.positions[seq]
            if pos0 not in (0, at) or not (batch.pos[r0:r1] == pos0 + np.arange(r1 - r0)).all():
                where = "" if self.kv.n_seq == 1 else f" of sequence {seq}"
                raise ModelError(f"{self.path}: the recurrent state{where} holds positions 0..{at - 1}: "
                                 f"a batch from position {pos0} cannot continue it (it restarts at 0)")
            after[seq] = pos0 + r1 - r0
        for seq in after:
            self.positions[seq] = -1
        return after

    def _copy_all(self, pairs) -> None:
        with self.ops.batch():
            for src, dst in pairs:
                self.ops.copy(src, dst, src[2])
        self.ops.sync()

    def save_checkpoint(self, seq: int = 0) -> int:
        """Copies sequence seq's recurrent state (at its position) to its checkpoint; returns the position."""
        self._copy_all(self.kv.checkpoint_pairs(seq))
        return self.positions[seq]

    def restore_checkpoint(self, pos: int, seq: int = 0) -> None:
        """Sequence seq's recurrent state back to its checkpoint, which holds positions 0..pos-1
        (the caller, runner.py, knows which tokens those were)."""
        self._copy_all([(ck, state) for state, ck in self.kv.checkpoint_pairs(seq)])
        self.positions[seq] = pos

    def copy(self, src: int, dst: int) -> None:
        """Sequence dst's K/V rows and recurrent state become src's (a shared prefix forked
        into another slot: dst then continues from src's positions)."""
        if src != dst:
            self.ops.sync()
            self._copy_all(list(zip(self.kv.seq_parts(src), self.kv.seq_parts(dst))))
            self.positions[dst] = self.positions[src]

    def clear(self, seq: int) -> None:
        """Sequence seq holds nothing: its recurrent state restarts with its next batch (which
        must start at position 0).  Its K/V rows need no clearing: a token attends only over
        the rows its sequence wrote up to its position."""
        self.kv.check(TokenBatch.of([0], 0, seq=seq))
        self.positions[seq] = 0

"""The forward pass of every architecture: a TokenBatch in, logits out, K/V into the cache.

Owns: `TransformerModel` (one loaded model: spec, tensor table, KV cache,
scratch; `forward(batch)`: chunking, input embeddings, logits rows, the
replayed decode steps, the per-kernel profile; `forward_batch(batch)`: a
batch of several sequences' tokens (parallel slots), and the per-sequence
helpers `copy_seq`, `clear_seq`, `save/restore_checkpoint(seq)` (vramd/
engine/sequences.py's); `hidden(tokens, rows)`: the
final-normed hidden states instead of logits, for embeddings).  The scratch it needs is
vramd/engine/scratch.py's `scratch_layout(spec)`.

Recording.  Every op of a chunk is recorded into one command buffer and
submitted once (vramd/engine/ops.py).  A mixture-of-experts layer routed on
the host needs its router's logits back, so such a model records in runs:
the GPU-recordable layers between host-routed ones go into one batch each.
A decode step (a batch the graph can run: no input embeddings, the last
row's logits) is recorded once per batch size into an `ops.graph()` and
replayed (vramd/engine/decode_step.py): no Python work per layer per
token; so is a step of one decode token of each of up to SLOTS_REPLAY
sequences (their ids an input beside the positions; recorded again when its
rows' sequences change only where a layer binds a sequence's region, qwen35's
state: docs/architecture.md, "Several sequences").  The recording binds device buffers as they are; a release or
restore of any region may move them, so a graph is re-recorded when the
residency core's generation has changed since.

What it computes is the numpy references' specification (tests/engine/
reference*), and llama.cpp's on the same file (tests/engine/test_conformance.py).
"""

from __future__ import annotations

import numpy as np

from vramd.engine import blocks, moe, ple
from vramd.engine.arch import spec_for
from vramd.engine.batch import TokenBatch
from vramd.engine.decode_step import DecodeStep
from vramd.engine.kvcache import KVCache, KVLayout
from vramd.engine.ops import Ops
from vramd.engine.scratch import buffer_cap, chunk_tokens, logit_rows
from vramd.engine.sequences import Sequences
from vramd.engine.tensors import TensorTable
from vramd.errors import ModelError

REPLAY_TOKENS = 8   # batches of up to this many tokens (and last-row logits) replay a recorded step
# A step of one decode token of each of up to this many sequences replays a recorded step (fewer where
# the scratch's logits rows are fewer: logit_rows).  The decode attention's partials share `tmp` and
# each sequence's rows take their own dispatches, so the bound is what one step's graph should hold.
SLOTS_REPLAY = 16

def _token_rows(segs: list, n: int):
    """(n, [(first row, rows, one token a sequence)]) of a batch's runs: consecutive decode rows
    together, each sequence's prompt rows on their own (the kernel their own count selects, as
    alone); None for one sequence's rows (a prefill chunk: no split)."""
    runs: list[list] = []
    for r0, r1, *_ in segs:
        single = r1 - r0 == 1
        if runs and single and runs[-1][2]:
            runs[-1][1] += 1
        else:
            runs.append([r0, r1 - r0, single])
    return (n, [tuple(r) for r in runs]) if len(segs) > 1 or runs[0][2] else None


class TransformerModel:
    """Forward passes of one loaded model (weights region, KV `state` region,
    scratch region).  gpu_routing=False routes every MoE layer on the host
    (the reference the GPU-routed path is tested against)."""

    def __init__(self, loaded, residency, ctx: int, scratch_region, batch: int | None = None, *,
                 gpu_routing: bool = True, spec=None):
        self.file = mf = loaded.file
        self.spec = spec or spec_for(mf)
        # Tokens per chunk: what the scratch was laid out for (scratch_layout cuts it the same way,
        # to this device's binding), and never more rows than it holds (a scratch laid out for
        # the conservative cap, without a device, under a larger device's)
        self.ctx = ctx
        self.batch = min(chunk_tokens(self.spec, batch, buffer_cap(residency.limits)),
                         scratch_region.tensors["ids"].nbytes // 4)
        self.ops = Ops(residency)
        self.residency = residency
        self.t = TensorTable(self.spec, mf, loaded.weights.tensors, loaded.host)
        # sequences: what the loaded KV region was laid out for (loader.kv_shape's n_seq, default 1)
        n_seq = loaded.kv_shape.n_seq if getattr(loaded, "kv_shape", None) is not None else 1
        self.kv = KVCache(KVLayout.for_spec(self.spec, ctx, n_seq), loaded.kv.tensors)
        self.act = scratch_region.tensors
        self.att_tmp = "up" if self.spec.n_ff else "part"   # free until the FFN (see blocks.attention)
        # Per layer: recorded with the rest (dense, or experts routed on the GPU) or host-routed.
        self.gpu_routed = [not layer.moe or (gpu_routing and moe.gpu_routable(self, i))
                           for i, layer in enumerate(self.spec.layers)]
        self._steps: dict[int, DecodeStep] = {}   # the replayed decode step, by batch size
        self._slot_steps: dict[int, DecodeStep] = {}   # one token of each of n sequences, by n
        self.seqs = Sequences(self.kv, self.ops, self.spec, self.file.path)
        self.segs: list[tuple[int, int, int, bool]] = []   # the recorded batch's runs (blocks.py)
        self.seq_at = self.act["pos"].nbytes // 2   # the rows' sequence ids: after the positions (scratch.py)
        self.seq_kernels, self.seq_input = self.seqs.kernels, self.seqs.input
        self._timer = None
        self._ple_gen = None   # residency generation at which ple.write_index last filled the scratch

    @property
    def n_seq(self) -> int:
        return self.kv.n_seq

    @property
    def rec_positions(self) -> list[int]:
        """Each sequence's recurrent state position (sequences.py)."""
        return self.seqs.positions

    @property
    def rec_pos(self) -> int:
        """Sequence 0's recurrent state position (the one-slot Engine's)."""
        return self.seqs.positions[0]

    @rec_pos.setter
    def rec_pos(self, value: int) -> None:
        self.seqs.positions[0] = value

    @property
    def replays_decode(self) -> bool:
        """Decode is a recorded step replayed per token: no layer needs a readback."""
        return all(self.gpu_routed)

    # -- forward -------------------------------------------------------------

    def forward(self, tokens, pos0: int = 0, all_logits: bool = False,
                embeds: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """`tokens` at positions pos0.. of sequence 0 (or a TokenBatch): the
        logits of the last token ([n_vocab]), or of every token ([n, n_vocab])
        with all_logits.  `embeds` maps indices into `tokens` to input
        embeddings ([n_embd] each, e.g. an image's from the vision encoder)
        used there instead of the token table (not scaled by the spec's
        embed_scale, as llama.cpp does not)."""
        if isinstance(tokens, TokenBatch):
            batch = tokens
        else:
            if not len(tokens):
                raise ValueError("no tokens")
            batch = TokenBatch.of(tokens, pos0, all_logits=all_logits, embeds=embeds)
        logits = self.forward_batch(batch)
        return logits if len(batch.out) != 1 or all_logits else logits[0]

    def forward_batch(self, batch: TokenBatch) -> np.ndarray:
        """The logits of batch.out's rows, [len(out), n_vocab], for a batch of any sequences
        (TokenBatch.mix: decode tokens of several plus a prefill chunk of one): each token
        attends over its own sequence's keys only, its K/V go to its sequence's rows, a
        recurrent layer continues its sequence's state."""
        if batch.embeds and not self.spec.takes_embeds:
            raise ModelError(f"{self.file.path}: {self.spec.arch} models do not take input embeddings")
        self.kv.check(batch)
        after = self.seqs.continue_state(batch)
        logits = self._run(batch)
        self._advance(after)
        return logits

    def _advance(self, after: dict) -> None:
        for seq, pos in after.items():
            self.seqs.positions[seq] = pos

    # the per-sequence operations (sequences.py), for the Engine and the scheduler
    def save_checkpoint(self, seq: int = 0) -> int:
        return self.seqs.save_checkpoint(seq)

    def restore_checkpoint(self, pos: int, seq: int = 0) -> None:
        self.seqs.restore_checkpoint(pos, seq)

    def copy_seq(self, src: int, dst: int) -> None:
        self.seqs.copy(src, dst)

    def clear_seq(self, seq: int) -> None:
        self.seqs.clear(seq)

    def _run(self, batch: TokenBatch) -> np.ndarray:
        """The logits of batch.out's rows, [len(out), n_vocab] (forward() checked the batch)."""
        n = len(batch)
        single = batch.decode_shape and n <= REPLAY_TOKENS and len(set(batch.seq.tolist())) == 1
        slots = batch.slots_decode_shape and n <= min(SLOTS_REPLAY, logit_rows(self.spec, self.batch), self.batch)
        if ((single or slots) and self.replays_decode
                and not (self.kv.recurrent and 0 in batch.pos[[r0 for r0, _r1, _s in batch.segments()]])):
            # (a step never resets a state).  Where its rows read their sequence ids (one token
            # a sequence, model.seq_input) one graph serves any sequences; else it binds each
            # row's sequence's region and is recorded again when they change (a slot joins or leaves).
            segs = [(r0, r1, seq, False) for r0, r1, seq in batch.segments()]
            key = n if self.seq_input and (slots or n == 1) else tuple(segs)
            step = self._step(n) if single else self._slot_step(n)
            if self.spec.ple and self._ple_gen != self.residency.generation:   # a rebuilt scratch
                ple.write_index(self)
                self._ple_gen = self.residency.generation
            return step.run(batch.ids, batch.pos, lambda: self._record(n, batch.out, segs), key=key, seq=batch.seq)
        size = min(self.batch, logit_rows(self.spec, self.batch)) if len(batch.out) > 1 else self.batch
        out = [o for o in (self._chunk(c) for c in batch.chunks(size)) if o is not None]
        return np.concatenate(out, axis=0) if out else np.empty((0, self.spec.n_vocab), np.float32)

    def hidden(self, tokens, rows: tuple) -> np.ndarray:
        """h = output_norm(x) of `rows` (ascending indices into `tokens`), [len(rows), n_embd]:
        the tokens run at positions 0.. of sequence 0 through every layer, no output head
        (the embedding path, vramd/engine/embed.py).  Their K/V are written into the cache as a
        prefill's are: the caller says what the cache holds afterwards (Engine.embed)."""
        batch = TokenBatch.of(tokens, 0)
        batch.out = ()
        self.kv.check(batch)
        after = self.seqs.continue_state(batch)
        out = []
        for k, chunk in enumerate(batch.chunks(self.batch)):
            start = k * self.batch
            out.append(self._chunk(chunk, hidden=tuple(r - start for r in rows if start <= r < start + len(chunk))))
        self._advance(after)
        return np.concatenate(out, axis=0)

    def _step(self, n: int) -> DecodeStep:
        step = self._steps.get(n)
        if step is None:
            step = self._steps[n] = DecodeStep(self.ops, self.residency, self.act, self.spec.n_vocab, n_tokens=n,
                                               seq_at=self.seq_at if self.seq_kernels else None)
            if n == 1:   # the profile times the one-token step only (steps of n > 1 never keep a timer)
                step.timer = self._timer
        return step

    def _slot_step(self, n: int) -> DecodeStep:
        """The step of one token of each of n sequences: every row's logits out."""
        step = self._slot_steps.get(n)
        if step is None:
            step = self._slot_steps[n] = DecodeStep(self.ops, self.residency, self.act, self.spec.n_vocab,
                                                    n_tokens=n, n_out=n, seq_at=self.seq_at)
        return step

    @property
    def slot_step_records(self) -> int:
        """Times the multi-sequence decode steps were recorded, all sizes (tests: replay)."""
        return sum(step.records for step in self._slot_steps.values())

    @property
    def slot_step_runs(self) -> int:
        """Times they ran (replayed or just recorded)."""
        return sum(step.runs for step in self._slot_steps.values())

    @property
    def step_records(self) -> int:
        """Times the one-token decode step was recorded (tests: replay, re-record after a move)."""
        return self._steps[1].records if 1 in self._steps else 0

    def profile(self, timer) -> None:
        """Times every dispatch of the decode step with `timer` (a
        vramd.gpu.timing.Timestamps; None: stop); read `timer.read()` after
        a forward of one token.  Re-records the step."""
        self._timer = timer
        self._step(1).profile(timer)

    def _record(self, n: int, rows: tuple, segs: list) -> None:
        """Records the whole pass of n tokens (ids and positions in the scratch
        buffers; every layer recordable; `segs`, their runs of one sequence, see
        blocks.py) and the logits of `rows` into logits[0..)."""
        self._set_segs(segs, n)
        try:
            blocks.embed(self, n)
            for i in range(self.spec.n_layer):
                self._layer(i, n)
            if rows:
                blocks.logits(self, n, rows)
        finally:
            self.ops.token_rows = None   # the split holds for this batch's recording only

    def _set_segs(self, segs: list, n: int) -> None:
        """The batch's runs of one sequence (blocks.py), and for the linear layers (Ops.matvec)
        its rows of one token a sequence: a mixed step's decode rows take the kernels they take
        alone, so a request's output does not depend on what it was batched with (a prefill
        chunk's rows may go to the f16 tensor-core matmuls)."""
        self.segs = segs
        self.ops.token_rows = _token_rows(segs, n)

    def _layer(self, i: int, n: int) -> None:
        blocks.mixer(self, i, n)
        if self.spec.layers[i].moe:
            moe.gpu_experts(self, i, n)
        else:
            blocks.dense_ffn(self, i, n)

    def _runs(self) -> list[tuple[bool, list[int]]]:
        """The layers in order, as (True, a run of consecutive recordable layers)
        and (False, [one host-routed layer])."""
        runs: list[tuple[bool, list[int]]] = []
        for i, gpu in enumerate(self.gpu_routed):
            if gpu and runs and runs[-1][0]:
                runs[-1][1].append(i)
            else:
                runs.append((gpu, [i]))
        return runs

    def _chunk(self, batch: TokenBatch, hidden: tuple | None = None) -> np.ndarray | None:
        """Runs one chunk; returns the logits of batch.out's rows, or with `hidden` (rows
        of this chunk) those rows of h = output_norm(x) ([len(hidden), n_embd], maybe empty)."""
        s, ops, a = self.spec, self.ops, self.act
        n = len(batch)
        ops.sync()  # the previous chunk is done with ids/pos
        ids = batch.ids.astype(np.int32)
        for i, row in batch.embeds.items():
            # get_rows leaves the row of an id outside the table alone: the row
            # written here stays where the token's would have gone.  It goes in
            # divided by the embedding scale so that the scale every row then
            # gets leaves it as given (images are not scaled, as in llama.cpp).
            ids[i] = -1
            row = np.asarray(row, dtype=np.float32).reshape(s.n_embd)
            if s.embed_scale != 1.0:
                row = row / np.float32(s.embed_scale)
            a["x"].write(np.ascontiguousarray(row), 4 * i * s.n_embd)
        a["ids"].write(ids)
        a["pos"].write(batch.pos.astype(np.int32))
        a["pos"].write(batch.seq.astype(np.int32), self.seq_at)
        # a recurrent state starts over with position 0
        segs = [(r0, r1, seq, int(batch.pos[r0]) == 0) for r0, r1, seq in batch.segments()]
        if s.ple:
            ple.write_index(self)
            self._ple_gen = self.residency.generation
        if self.replays_decode:
            with ops.batch():
                self._record(n, batch.out, segs)
        else:
            self._set_segs(segs, n)
            try:
                with ops.batch():
                    blocks.embed(self, n)
                for gpu, layers in self._runs():
                    if gpu:   # no readback: the whole run in one command buffer
                        with ops.batch():
                            for i in layers:
                                self._layer(i, n)
                    else:
                        moe.host_routed_layer(self, layers[0], n)
                if batch.out:
                    with ops.batch():
                        blocks.logits(self, n, batch.out)
            finally:
                ops.token_rows = None
        ops.sync()
        if hidden is not None:
            if not hidden:
                return np.empty((0, s.n_embd), np.float32)
            lo, hi = hidden[0], hidden[-1] + 1   # one read of the span, then the rows wanted
            span = a["h"].read(np.float32, 4 * lo * s.n_embd, 4 * (hi - lo) * s.n_embd).reshape(hi - lo, s.n_embd)
            return span[[r - lo for r in hidden]].copy()
        if not batch.out:
            return None
        rows = len(batch.out)
        return a["logits"].read(np.float32, 0, 4 * rows * s.n_vocab).reshape(rows, s.n_vocab).copy()

    def close(self) -> None:
        self.ops.close()
        for step in [*self._steps.values(), *self._slot_steps.values()]:
            step.close()

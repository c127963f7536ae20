"""Continuous batching: several requests' generations stepped together over an Engine's slots.

Owns: `Batcher`, the scheduler of one Engine whose KV cache holds N sequences (slots;
loader.load's n_seq).  A request (`submit`: prompt ids, SamplingParams, emit) waits in
arrival order for a free slot; it takes the free slot whose cached tokens share the longest
prefix with its prompt (that prefix is not prefilled again), else the least recently used.
Each `step` is one TokenBatch.mix through forward_batch: the next token of every decoding
slot, plus one chunk of the oldest pending prefill (arrival order, one chunk a step: a long
prompt advances at every step whatever short ones arrive after it; no starvation).  A
generation's tokens come from its own logits row through its own Generation
(vramd/engine/generation.py: sampler and seed, stop strings, grammar, penalties, logprobs),
so it gives what it gives alone (greedy: the same tokens; seeded: the same draws).  New
requests join and finished or cancelled ones leave between steps; `cancel` (a client gone)
frees the slot at the next step.

A recurrent model's slot (qwen35) keeps a checkpoint of its state after all but the last
token of its prompt, as the one-slot path does (Engine._prefill_recurrent): the same prompt
again, or one that continues it, resumes there instead of prefilling from 0.

Not here: the --context-overflow shift policy (a batched generation ends "length" at a full
context) and image embeddings (the daemon runs such requests alone).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from vramd.engine.batch import TokenBatch
from vramd.engine.generation import Generation
from vramd.engine.prompt import common_prefix
from vramd.engine.sampler import Piece, SamplingParams
from vramd.engine.scratch import logit_rows
from vramd.errors import UsageError


class Batcher:
    def __init__(self, engine, on_assign: Callable[[Generation, int], None] | None = None,
                 on_leave: Callable[[Generation], None] | None = None):
        """on_assign(gen, seq): gen is about to take slot seq (before its prefix is judged: the
        daemon's host prompt cache may bring a saved sequence back into it); on_leave(gen): gen
        has ended (gen.finish says why) and left its slot."""
        self.engine, self.model = engine, engine.model
        self.on_assign, self.on_leave = on_assign, on_leave
        self.waiting: deque[Generation] = deque()   # submitted, no slot yet (arrival order)
        self.prefilling: list[Generation] = []      # in a slot, prompt not all in the cache yet
        self.decoding: list[Generation] = []        # in a slot, a token to feed next
        self.busy: dict[int, Generation] = {}       # slot -> its generation
        self.steps = 0
        # the rows of a mixed step (every part's last row makes logits): model._run's chunk size
        self.rows = min(self.model.batch, logit_rows(self.model.spec, self.model.batch))

    def submit(self, ids: list[int], params: SamplingParams, emit: Callable[[Piece], bool]) -> Generation:
        """Queue a generation after `ids`; it joins at the next step a slot is free."""
        if not ids:
            raise UsageError("the prompt is empty")
        if len(ids) >= self.engine.ctx:
            raise UsageError(f"a prompt of {len(ids)} tokens: the context holds {self.engine.ctx} (--ctx)")
        gen = Generation(self.engine, ids, params, emit, seq=-1)
        gen.pos = 0           # tokens of its sequence in the cache
        gen.next = None       # the sampled token to feed at the next step
        self.waiting.append(gen)
        return gen

    def cancel(self, gen: Generation) -> None:
        """The request is gone: it leaves (and frees its slot) at the next step."""
        if gen.finish is None:
            gen.finish = "cancelled"

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.busy)

    @property
    def free(self) -> int:
        """Slots a newly submitted generation could take at the next step."""
        return self.engine.n_seq - len(self.busy) - len(self.waiting)

    def run(self, between: Callable[[], None] | None = None) -> None:
        """Step until every submitted generation is over; `between` runs between two steps
        (where requests join, or the daemon pauses the whole batch)."""
        while self.step():
            if between is not None:
                between()

    # -- one step ----------------------------------------------------------------

    def _assign(self) -> None:
        """Waiting generations into free slots: the longest shared prefix, else LRU."""
        e = self.engine
        while self.waiting:
            free = [s for s in range(e.n_seq) if s not in self.busy]
            if not free:
                return
            gen = self.waiting.popleft()
            if gen.finish is not None:   # cancelled before it had a slot
                gen.end()
                if self.on_leave is not None:
                    self.on_leave(gen)
                continue
            seq = max(free, key=lambda s: (common_prefix(e.seq_cached[s], gen.ids), -e.last_used[s]))
            if self.on_assign is not None:
                self.on_assign(gen, seq)
            keep = min(common_prefix(e.seq_cached[seq], gen.ids), len(gen.ids) - 1)   # >= 1 token for its logits
            ck = e.seq_checkpoint[seq]
            if self.model.kv.recurrent and (keep < len(e.seq_cached[seq])
                                            or self.model.rec_positions[seq] != len(e.seq_cached[seq])):
                # A recurrent state cannot go back: it resumes from the slot's checkpoint (the
                # state after its last prompt but that prompt's last token) when that is a
                # prefix of this prompt, as Engine._prefill_recurrent does, else from 0.
                keep = len(ck) if ck is not None and len(ck) < len(gen.ids) and gen.ids[:len(ck)] == ck else 0
                if keep:
                    self.model.restore_checkpoint(keep, seq)
            if keep == 0:
                self.model.clear_seq(seq)
            e.seq_cached[seq] = list(gen.ids[:keep])
            if ck is not None and keep < len(ck):
                e.seq_checkpoint[seq] = None   # its K/V rows are rewritten from here on
            if self.model.kv.recurrent and keep == len(gen.ids) - 1 and e.seq_checkpoint[seq] != gen.ids[:-1]:
                self.model.save_checkpoint(seq)   # already after all but the last token: checkpoint now
                e.seq_checkpoint[seq] = list(gen.ids[:-1])
            e.stats["prompt_tokens"] += len(gen.ids)
            e.stats["reused_tokens"] += keep
            gen.seq, gen.pos = seq, keep
            gen.reused = keep
            self.busy[seq] = gen
            self.prefilling.append(gen)

    def _leave(self, gen: Generation, finish: str | None = None) -> None:
        gen.end(finish)
        self.busy.pop(gen.seq, None)
        for group in (self.prefilling, self.decoding):
            if gen in group:
                group.remove(gen)
        if self.on_leave is not None:
            self.on_leave(gen)

    def step(self) -> bool:
        """One forward_batch of the decode tokens and one prefill chunk; False when idle."""
        for gen in [g for g in (*self.prefilling, *self.decoding) if g.finish is not None]:
            self._leave(gen)   # cancelled between steps
        self._assign()
        parts, owners = [], []
        for gen in self.decoding:
            parts.append((gen.seq, [gen.next], gen.pos))
            owners.append(gen)
        if self.prefilling:
            gen = self.prefilling[0]
            room = max(1, self.rows - len(parts))
            end = len(gen.ids)
            if self.model.kv.recurrent and gen.pos < end - 1:
                end -= 1   # the checkpoint is taken after all but the last token (a chunk ends there)
            parts.append((gen.seq, gen.ids[gen.pos:min(gen.pos + room, end)], gen.pos))
            owners.append(gen)
        if not parts:
            return bool(self.waiting)
        self.steps += 1
        logits = self.model.forward_batch(TokenBatch.mix(parts))
        e = self.engine
        for (seq, tokens, _pos0), gen, row in zip(parts, owners, logits):
            gen.pos += len(tokens)
            e.seq_cached[seq].extend(tokens)
            e.last_used[seq] = self.steps
            if gen in self.prefilling:
                if self.model.kv.recurrent and gen.pos == len(gen.ids) - 1 and \
                        e.seq_checkpoint[seq] != gen.ids[:-1]:
                    self.model.save_checkpoint(seq)   # the state after all but the last prompt token
                    e.seq_checkpoint[seq] = list(gen.ids[:-1])
                if gen.pos < len(gen.ids):
                    continue   # more chunks to come
                self.prefilling.remove(gen)
                self.decoding.append(gen)
                gen.start(e.ctx - gen.pos)
            token = gen.take(row)
            if token is None:
                self._leave(gen)
            elif gen.pos >= e.ctx:
                self._leave(gen, "length")
            else:
                gen.next = token
        return True


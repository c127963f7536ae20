"""A batch of tokens through the engine: ids, positions, sequences, and which rows make logits.

Owns: `TokenBatch`.  The forward pass (vramd/engine/model.py) takes one and
returns the logits of its `out` rows; a prompt becomes one batch cut into
chunks the scratch holds (`chunks`), a decode step is a batch of one token.
Tokens may belong to several sequences (`seq`, parallel slots: issue 16):
`mix` makes the step a scheduler runs, the decode tokens of every active
slot and a chunk of one prefill, each sequence's tokens consecutive rows
(`segments`), each part's last row an `out` row.  The KV cache
(vramd/engine/kvcache.py) holds a region per sequence.

`embeds` maps a row to an input embedding ([n_embd] f32, an image's from
the vision encoder) used there instead of the token's row of the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenBatch:
    ids: np.ndarray               # int64 [n]
    pos: np.ndarray               # int64 [n]
    seq: np.ndarray               # int32 [n]
    out: tuple                    # rows whose logits are wanted, ascending
    embeds: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tokens, pos0: int, *, all_logits: bool = False, embeds: dict | None = None,
           seq: int = 0) -> "TokenBatch":
        """Consecutive tokens of one sequence from position pos0: the last
        row's logits, or every row's with all_logits."""
        n = len(tokens)
        if n == 0:
            raise ValueError("no tokens")
        # int64 here: an image's placeholder ids (about -2^36) are replaced before
        # the ids go to the device, and positions are checked against the context
        # (KVCache.check) before they are written as int32.
        return cls(ids=np.asarray(tokens, dtype=np.int64), pos=np.arange(pos0, pos0 + n, dtype=np.int64),
                   seq=np.full(n, seq, dtype=np.int32), out=tuple(range(n)) if all_logits else (n - 1,),
                   embeds=dict(embeds or {}))

    @classmethod
    def mix(cls, parts) -> "TokenBatch":
        """Parts (seq, tokens, pos0) one after another, each sequence once: the logits of
        every part's last row (in the parts' order)."""
        if not parts:
            raise ValueError("no tokens")
        pieces = [cls.of(tokens, pos0, seq=seq) for seq, tokens, pos0 in parts]
        ends = np.cumsum([len(p) for p in pieces])
        return cls(ids=np.concatenate([p.ids for p in pieces]), pos=np.concatenate([p.pos for p in pieces]),
                   seq=np.concatenate([p.seq for p in pieces]), out=tuple(int(e) - 1 for e in ends))

    def segments(self) -> list[tuple[int, int, int]]:
        """(first row, end row, sequence) of each run of consecutive rows of one sequence."""
        cuts = [0, *(np.flatnonzero(np.diff(self.seq)) + 1).tolist(), len(self)]
        return [(a, b, int(self.seq[a])) for a, b in zip(cuts, cuts[1:])]

    @property
    def slots_decode_shape(self) -> bool:
        """A step of one token of each of several sequences, every row's logits wanted."""
        return (len(self) > 1 and not self.embeds and self.out == tuple(range(len(self)))
                and len(set(self.seq.tolist())) == len(self))

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def decode_shape(self) -> bool:
        """A step the replayed decode graph runs: no input embeddings, the last row's logits only."""
        return not self.embeds and self.out == (len(self) - 1,)

    def chunks(self, size: int) -> list["TokenBatch"]:
        """Consecutive pieces of at most `size` rows, each with its own out rows and embeds."""
        pieces = []
        for s in range(0, len(self), size):
            e = min(s + size, len(self))
            pieces.append(TokenBatch(self.ids[s:e], self.pos[s:e], self.seq[s:e],
                                     tuple(r - s for r in self.out if s <= r < e),
                                     {r - s: v for r, v in self.embeds.items() if s <= r < e}))
        return pieces

"""The host prompt cache (--cache-ram): a slot's sequence kept in host memory when another prompt takes the slot.

Owns `HostCache`: before a generation, when the request's prompt does not continue the
slot's cached tokens (the engine's prefix reuse would cut them), the slot's sequence (its
tokens and the K/V rows of positions 0..n-1 of every attention layer) is copied to host
memory; when a later prompt shares a longer prefix with a saved sequence than with the
slot, that sequence's rows are written back and the engine's prefix reuse takes them as its
own (Engine.cached), so only the rest is prefilled.  Bounded: the entries' bytes stay within
--cache-ram, the least recently used going first; a sequence saved again replaces its
older self.  Rows go through the residency core's tensor read/write (vramd/gpu/residency.py:
Tensor.read / write, offset and size: a device copy while warm, the shadow kept in step),
a sequence's rows starting at seq * ctx rows of each layer's tensor (vramd/engine/kvcache.py).

Not for a model with a recurrent state (qwen35): its state cannot be cut to a shared prefix
and its checkpoint is the engine's own (runner.py); such a daemon says so at start and keeps
no entries.  Images' slots (negative ids) are cached like tokens: the ids name the image.
On the loop thread only; status and /metrics read the counters.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import numpy as np

from vramd.engine.prompt import common_prefix

log = logging.getLogger("vramd.hostcache")

DEFAULT_CACHE_RAM = 256   # MiB (--cache-ram); 0: no host cache
MIN_TOKENS = 16           # shorter sequences are not worth an entry: prefilling them is about as quick


@dataclass
class Entry:
    tokens: list[int]
    rows: list[np.ndarray]    # per cached tensor, its first len(tokens) rows' bytes

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)


class HostCache:
    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.entries: "collections.OrderedDict[tuple, Entry]" = collections.OrderedDict()   # LRU first
        self._lock = threading.Lock()
        self.saves = self.hits = self.restored_tokens = self.evicted = 0

    @staticmethod
    def usable(engine) -> bool:
        kv = getattr(engine.model, "kv", None)
        return kv is not None and not kv.recurrent

    def _tensors(self, engine, seq: int = 0) -> list[tuple[object, int, int]]:
        """(tensor, bytes per row, where sequence seq's rows start) of each attention layer's K
        and V (sequence s owns rows [s * ctx, (s + 1) * ctx): vramd/engine/kvcache.py)."""
        kv = engine.model.kv
        lay = kv.layout
        if not 0 <= seq < kv.n_seq:
            raise ValueError(f"sequence {seq} outside the cache's {kv.n_seq}")
        out = []
        for i in range(lay.n_layer):
            for t, w in ((kv.k(i), lay.k_width * 2), (kv.v(i), lay.v_width * 2)):
                out.append((t, w, seq * lay.ctx * w))
        return out

    def bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self.entries.values())

    def before(self, engine, ids: list[int], seq: int = 0) -> int:
        """Before `ids` is prefilled in the slot of sequence seq: save what the slot would lose,
        bring back a saved sequence that shares more of `ids`.  Returns the tokens brought back
        (0: none)."""
        if self.limit <= 0 or not self.usable(engine):
            return 0
        cached = engine.seq_cached[seq]
        slot_keep = common_prefix(cached, ids)
        best, best_n = None, slot_keep
        with self._lock:
            for key, e in self.entries.items():
                n = common_prefix(e.tokens, ids)
                if n > best_n:
                    best, best_n = key, n
        if best is not None and best_n - slot_keep < MIN_TOKENS // 2:
            best = None   # a few tokens more than the slot holds: not worth the copy
        if slot_keep < len(cached) and len(cached) >= MIN_TOKENS:
            self._save(engine, list(cached), keep=best, seq=seq)
        return 0 if best is None else self._restore(engine, best, best_n, seq)

    def keep_slot(self, engine, ids: list[int], seq: int = 0) -> None:
        """Before rows 0.. of sequence seq are overwritten by `ids` (an embedding): save the
        slot's sequence if they cut it."""
        cached = engine.seq_cached[seq]
        if self.limit > 0 and self.usable(engine) and len(cached) >= MIN_TOKENS and \
                common_prefix(cached, ids) < len(cached):
            self._save(engine, list(cached), keep=None, seq=seq)

    def _save(self, engine, tokens: list[int], keep: tuple | None, seq: int = 0) -> None:
        """Save the slot's sequence, making room by the LRU order, but never by dropping `keep`
        (the entry this request is about to restore: then the slot's sequence is not saved)."""
        n = len(tokens)
        size = sum(w * n for _t, w, _at in self._tensors(engine, seq))
        key = tuple(tokens)
        with self._lock:
            others = sum(e.nbytes for k, e in self.entries.items() if k == keep)
            if size + others > self.limit:
                return
            # A saved sequence that this one continues (or repeats) is covered by it.
            for k in [k for k in self.entries if k != keep and len(k) <= n and key[:len(k)] == k]:
                del self.entries[k]
            while sum(e.nbytes for e in self.entries.values()) + size > self.limit:
                victim = next(k for k in self.entries if k != keep)
                del self.entries[victim]
                self.evicted += 1
        rows = [t.read(np.uint8, at, w * n) for t, w, at in self._tensors(engine, seq)]
        with self._lock:
            self.entries[key] = Entry(tokens, rows)
            self.saves += 1
        log.debug("host cache: saved %d tokens (%d bytes)", n, size)

    def _restore(self, engine, key: tuple, n: int, seq: int = 0) -> int:
        with self._lock:
            e = self.entries[key]
            self.entries.move_to_end(key)
        engine.seq_cached[seq] = []   # the rows are being replaced: nothing counts as held until they are
        for (t, w, at), data in zip(self._tensors(engine, seq), e.rows):
            t.write(data[:w * n], at)
        engine.seq_cached[seq] = list(e.tokens[:n])
        with self._lock:
            self.hits += 1
            self.restored_tokens += n
        log.debug("host cache: restored %d tokens", n)
        return n

    def status(self) -> dict:
        with self._lock:
            return {"limit_bytes": self.limit, "bytes": sum(e.nbytes for e in self.entries.values()),
                    "entries": len(self.entries), "saves": self.saves, "hits": self.hits,
                    "restored_tokens": self.restored_tokens, "evicted": self.evicted}

    def render_metrics(self, label: str) -> list[str]:
        from vramd.server.metrics import _one as one
        s = self.status()
        return [*one("vramd_host_cache_bytes", "gauge", "Host memory the prompt cache holds (--cache-ram).", label,
                     s["bytes"]),
                *one("vramd_host_cache_entries", "gauge", "Sequences in the host prompt cache.", label, s["entries"]),
                *one("vramd_host_cache_hits_total", "counter", "Prompts served from the host prompt cache.", label,
                     s["hits"]),
                *one("vramd_host_cache_tokens_total", "counter",
                     "Prompt tokens brought back from the host prompt cache instead of prefilled.", label,
                     s["restored_tokens"]),
                *one("vramd_host_cache_evictions_total", "counter",
                     "Sequences dropped from the host prompt cache for its bound (least recently used).", label,
                     s["evicted"])]

"""The KV cache's layout and binding: where layer l's keys and values for a position live.

Owns: `KVLayout` (the geometry: layers, context, widths, sequences; the
tensors a residency `state` region holds for it) and `KVCache` (a layout
bound to the region's tensors: the buffers the attention kernels read and
the KV writes fill, and the check that a batch's positions fit).

One sequence today: sequence s would own rows [s * ctx, (s + 1) * ctx) of
each layer's tensors; the kernels take a context and positions, so several
sequences (parallel slots) or a paged layout with a block table change this
module and the kernels' addressing, not the layers that call them.  The
cache is f16 (KV_BYTES), as llama.cpp's default.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramd.errors import ModelError

KV_BYTES = 2   # f16 K and V


@dataclass(frozen=True)
class KVLayout:
    n_layer: int
    ctx: int
    k_width: int      # head_dim * n_head_kv
    v_width: int
    n_seq: int = 1

    @classmethod
    def for_spec(cls, spec, ctx: int) -> "KVLayout":
        # every layer's rows as wide as the widest layer's (gemma4's sliding and global
        # layers differ; a narrower layer uses the front of its rows' space)
        return cls(spec.n_layer, ctx, spec.max_kv_width, spec.max_kv_width)

    def tensors(self) -> list[tuple[str, int]]:
        """[(name, bytes)] of the `state` region that holds the cache."""
        k, v = (self.n_seq * self.ctx * w * KV_BYTES for w in (self.k_width, self.v_width))
        return [t for i in range(self.n_layer) for t in ((f"cache_k_l{i}", k), (f"cache_v_l{i}", v))]

    @property
    def nbytes(self) -> int:
        return sum(n for _name, n in self.tensors())


class KVCache:
    """A layout bound to its region's tensors (`tensors`: name -> residency Tensor)."""

    def __init__(self, layout: KVLayout, tensors: dict):
        self.layout, self.ctx = layout, layout.ctx
        missing = [name for name, _n in layout.tensors() if name not in tensors]
        if missing:
            raise ModelError(f"the KV region has no {missing[0]!r}")
        self._k = [tensors[f"cache_k_l{i}"] for i in range(layout.n_layer)]
        self._v = [tensors[f"cache_v_l{i}"] for i in range(layout.n_layer)]

    def k(self, layer: int):
        return self._k[layer]

    def v(self, layer: int):
        return self._v[layer]

    def check(self, batch) -> None:
        """Every position of `batch` (a TokenBatch) lies inside its sequence's context."""
        lo, hi = int(batch.pos.min()), int(batch.pos.max())
        if lo < 0 or hi >= self.ctx:
            raise ModelError(f"positions {lo}..{hi} outside the context of {self.ctx}")
        bad = [int(q) for q in batch.seq if not 0 <= q < self.layout.n_seq]
        if bad:
            raise ModelError(f"sequence {bad[0]} outside the cache's {self.layout.n_seq}")

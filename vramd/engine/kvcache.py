"""The KV cache's layout and binding: where layer l's keys and values for a position live.

Owns: `KVLayout` (the geometry: layers, context, widths, sequences; the
tensors a residency `state` region holds for it) and `KVCache` (a layout
bound to the region's tensors: the buffers the attention kernels read and
the KV writes fill, and the check that a batch's positions fit).

One sequence today: sequence s would own rows [s * ctx, (s + 1) * ctx) of
each layer's tensors; the kernels take a context and positions, so several
sequences (parallel slots) or a paged layout with a block table change this
module and the kernels' addressing, not the layers that call them.  The
cache is f16 (KV_BYTES), as llama.cpp's default.  Qwen3.5's DeltaNet layers keep a recurrent
state instead (conv inputs and the delta rule's matrices, f32, as llama.cpp's r/s caches): in the
same region, so it goes cold, warm and to the host under --evict-state exactly as K/V do.
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
    recurrent: tuple = ()   # layers with a recurrent state instead of K/V (qwen35's DeltaNet)
    conv_bytes: int = 0     # per recurrent layer: the conv's last d - 1 inputs (f32)
    ssm_bytes: int = 0      # per recurrent layer: the delta rule's [hv, s, s] state (f32)

    @classmethod
    def for_spec(cls, spec, ctx: int) -> "KVLayout":
        d = spec.deltanet
        # every layer's rows as wide as the widest layer's (gemma4's sliding and global
        # layers differ; a narrower layer uses the front of its rows' space)
        if d is None:
            return cls(spec.n_layer, ctx, spec.max_kv_width, spec.max_kv_width)
        rec = tuple(i for i, layer in enumerate(spec.layers) if layer.recurrent)
        return cls(spec.n_layer, ctx, spec.max_kv_width, spec.max_kv_width, recurrent=rec,
                   conv_bytes=4 * max(1, d.d_conv - 1) * d.conv_dim, ssm_bytes=4 * d.hv * d.s * d.s)

    def tensors(self) -> list[tuple[str, int]]:
        """[(name, bytes)] of the `state` region that holds the cache (and the recurrent state)."""
        k, v = (self.n_seq * self.ctx * w * KV_BYTES for w in (self.k_width, self.v_width))
        out = []
        for i in range(self.n_layer):
            if i in self.recurrent:   # the state, then its checkpoint (runner.py's prefix reuse)
                c, s = self.n_seq * self.conv_bytes, self.n_seq * self.ssm_bytes
                out += [(f"rec_conv_l{i}", c), (f"rec_ssm_l{i}", s), (f"rec_conv_ck_l{i}", c), (f"rec_ssm_ck_l{i}", s)]
            else:
                out += [(f"cache_k_l{i}", k), (f"cache_v_l{i}", v)]
        return out

    @property
    def recurrent_bytes(self) -> int:
        """The recurrent state's part of nbytes, its checkpoint included (the rest is K/V)."""
        return 2 * len(self.recurrent) * self.n_seq * (self.conv_bytes + self.ssm_bytes)

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
        kv = [i for i in range(layout.n_layer) if i not in layout.recurrent]
        self._k = {i: tensors[f"cache_k_l{i}"] for i in kv}
        self._v = {i: tensors[f"cache_v_l{i}"] for i in kv}
        self._conv = {i: tensors[f"rec_conv_l{i}"] for i in layout.recurrent}
        self._ssm = {i: tensors[f"rec_ssm_l{i}"] for i in layout.recurrent}
        self.recurrent = bool(layout.recurrent)
        # (state, its checkpoint) tensor pairs: TransformerModel.save/restore_checkpoint copy between them
        self.checkpoint_pairs = [(tensors[f"rec_{k}_l{i}"], tensors[f"rec_{k}_ck_l{i}"])
                                 for i in layout.recurrent for k in ("conv", "ssm")]

    def conv(self, layer: int):
        return self._conv[layer]

    def ssm(self, layer: int):
        return self._ssm[layer]

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

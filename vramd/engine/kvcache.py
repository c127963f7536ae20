"""The KV cache's layout and binding: where layer l's keys and values for a position live.

Owns: `KVLayout` (the geometry: layers, context, widths, sequences; the
tensors a residency `state` region holds for it) and `KVCache` (a layout
bound to the region's tensors: the buffers the attention kernels read and
the KV writes fill, and the check that a batch's positions fit).

Sequences (parallel slots, issue 16): `n_seq` regions of `ctx` rows each,
sequence s owning rows [s * ctx, (s + 1) * ctx) of every layer's tensors
(`k_seq`/`v_seq`: that region as a view), and its recurrent state the s-th
conv_bytes / ssm_bytes of a recurrent layer's (`conv`/`ssm`).  A prefill
chunk's kernels are given its sequence's region as their cache (a binding
offset, their addressing unchanged); the decode kernels of several
sequences' rows bind the whole tensor (`k`/`v`) and read each row's
sequence (docs/architecture.md says why regions, not pages).  n_seq comes from one place, the loader's `kv_shape(..., n_seq)`
(default 1: one sequence, the layout as before).  The cache is f16 (KV_BYTES),
as llama.cpp's default.  Qwen3.5's DeltaNet layers keep a recurrent
state instead (conv inputs and the delta rule's matrices, f32, as llama.cpp's r/s caches): in the
same region, so it goes cold, warm and to the host under --evict-state exactly as K/V do.
Gemma 4 E2B / E4B's KV-sharing layers (`shared`: layer -> source layer) get no tensors:
k(layer) and v(layer) are the source's, as llama.cpp's layer_reuse_cb.
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
    shared: tuple = ()      # (layer, source layer): no rows of its own, it reads the source's (gemma4 E2B/E4B)

    @classmethod
    def for_spec(cls, spec, ctx: int, n_seq: int = 1) -> "KVLayout":
        d = spec.deltanet
        # every layer's rows as wide as the widest layer's (gemma4's sliding and global
        # layers differ; a narrower layer uses the front of its rows' space)
        shared = tuple((i, layer.kv_source) for i, layer in enumerate(spec.layers) if layer.kv_source >= 0)
        if d is None:
            return cls(spec.n_layer, ctx, spec.max_kv_width, spec.max_kv_width, n_seq, shared=shared)
        rec = tuple(i for i, layer in enumerate(spec.layers) if layer.recurrent)
        return cls(spec.n_layer, ctx, spec.max_kv_width, spec.max_kv_width, n_seq, recurrent=rec,
                   conv_bytes=4 * max(1, d.d_conv - 1) * d.conv_dim, ssm_bytes=4 * d.hv * d.s * d.s)

    def __post_init__(self):
        if self.n_seq < 1:
            raise ModelError(f"{self.n_seq} sequences: the KV cache holds at least one")

    def tensors(self) -> list[tuple[str, int]]:
        """[(name, bytes)] of the `state` region that holds the cache (and the recurrent state)."""
        k, v = (self.n_seq * self.ctx * w * KV_BYTES for w in (self.k_width, self.v_width))
        out, shared = [], dict(self.shared)
        for i in range(self.n_layer):
            if i in shared:
                continue
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
        shared = dict(layout.shared)
        kv = [i for i in range(layout.n_layer) if i not in layout.recurrent and i not in shared]
        self._k = {i: tensors[f"cache_k_l{i}"] for i in kv}
        self._v = {i: tensors[f"cache_v_l{i}"] for i in kv}
        for i, src in shared.items():   # a KV-sharing layer reads its source layer's rows
            self._k[i], self._v[i] = self._k[src], self._v[src]
        self._conv = {i: tensors[f"rec_conv_l{i}"] for i in layout.recurrent}
        self._ssm = {i: tensors[f"rec_ssm_l{i}"] for i in layout.recurrent}
        self._ck = {(k, i): tensors[f"rec_{k}_ck_l{i}"] for i in layout.recurrent for k in ("conv", "ssm")}
        self.recurrent = bool(layout.recurrent)
        self.n_seq = layout.n_seq
        # (state, checkpoint) tensors, every sequence's (tests: read back across a cold/warm cycle)
        self.checkpoint_tensors = [(tensors[f"rec_{k}_l{i}"], ck) for (k, i), ck in self._ck.items()]

    def k(self, layer: int):
        """Layer's K tensor, every sequence's rows (the kernels that read each row's sequence)."""
        return self._k[layer]

    def v(self, layer: int):
        return self._v[layer]

    def conv_all(self, layer: int):
        """Layer's conv states, every sequence's (the kernels that read each row's sequence)."""
        return self._conv[layer]

    def ssm_all(self, layer: int):
        return self._ssm[layer]

    # Views of one sequence's part (vramd/engine/ops.py `view`: made when the region is resident,
    # as the recorders make them).  Sequence s's K (V) rows: s * ctx rows of the layout's width on.
    def k_seq(self, layer: int, s: int = 0):
        return self._part(self._k[layer], s, 2 * self.ctx * self.layout.k_width)

    def v_seq(self, layer: int, s: int = 0):
        return self._part(self._v[layer], s, 2 * self.ctx * self.layout.v_width)

    def conv(self, layer: int, s: int = 0):
        return self._part(self._conv[layer], s, self.layout.conv_bytes)

    def ssm(self, layer: int, s: int = 0):
        return self._part(self._ssm[layer], s, self.layout.ssm_bytes)

    def _part(self, tensor, s: int, size: int):
        from vramd.engine.ops import view
        if not 0 <= s < self.n_seq:
            raise ModelError(f"sequence {s} outside the cache's {self.n_seq}")
        return view(tensor, s * size, size)

    def seq_parts(self, s: int) -> list:
        """Every view sequence s owns (K/V rows, recurrent state; not the checkpoint)."""
        out = []
        for i in range(self.layout.n_layer):
            out += [self.conv(i, s), self.ssm(i, s)] if i in self._conv else [self.k_seq(i, s), self.v_seq(i, s)]
        return out

    def checkpoint_pairs(self, s: int = 0) -> list:
        """(state, its checkpoint) view pairs of sequence s: TransformerModel.save/restore_checkpoint
        copy between them."""
        sizes = {"conv": self.layout.conv_bytes, "ssm": self.layout.ssm_bytes}
        return [(self.conv(i, s) if k == "conv" else self.ssm(i, s), self._part(ck, s, sizes[k]))
                for (k, i), ck in self._ck.items()]

    def check(self, batch) -> None:
        """Every position of `batch` (a TokenBatch) lies inside its sequence's context."""
        lo, hi = int(batch.pos.min()), int(batch.pos.max())
        if lo < 0 or hi >= self.ctx:
            raise ModelError(f"positions {lo}..{hi} outside the context of {self.ctx}")
        bad = [int(q) for q in batch.seq if not 0 <= q < self.layout.n_seq]
        if bad:
            raise ModelError(f"sequence {bad[0]} outside the cache's {self.layout.n_seq}")
        for r0, r1, s in batch.segments():
            if (s in batch.seq[:r0]) or (s in batch.seq[r1:]):
                raise ModelError(f"sequence {s}: its tokens are not consecutive rows of the batch")

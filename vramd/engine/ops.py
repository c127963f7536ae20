"""The compute ops of the forward pass: a small Python API over the GLSL
kernels in native/shaders/ (matvec_<type>, get_rows_<type>, rms_norm, rope,
kv_write, attention (attention_flash for prefill; attention_dec_n* / attention_split + attention_merge
for decode), silu_mul, add, scale; for mixture-of-experts models
moe_route, matvec_id_<type>, moe_group, matmul_id_<type> and moe_combine).

Owns: `Ops` (one per residency core: the pipelines, the recording batch),
`Weight` (a weight matrix: tensor, GGML type, rows, cols) and `view` (a
sub-range of a tensor as a bindable buffer).

    ops = Ops(residency)
    with ops.batch():                 # one command buffer, one submit at exit
        ops.get_rows(tok_embd, ids, x, n_tokens)
        ops.rms_norm(x, attn_norm, h, eps, n_tokens, n_embd)
        ops.matvec(wq, h, q, n_tokens)
        ...
    ops.sync()                        # then read results: tensor.read(np.float32)

Buffers.  Every buffer argument is a residency `Tensor` or a (VkBuffer,
byte offset, nbytes) tuple (`view(tensor, offset, nbytes)` makes one).  The
offset need not be storage-aligned: the view bound is aligned down and the
remainder is passed to the shader as an element offset.  Activations are
float32, positions and token ids int32, KV caches float16 (see `kv_write`).
Only the bytes an op touches are bound, and they must fit one
maxStorageBufferRange (lavapipe: 128 MiB) or a UsageError says so; weight
matrices and embedding tables are the exception: they are bound in row
chunks, so a tensor of any size works.

Positions and token ids are read by the kernels from device buffers, not
pushed as constants, so a recorded decode graph (`ops.graph()`) can be
replayed for the next token by writing just those two small buffers.

Ordering.  Ops recorded in one batch run in order (a compute-to-compute
barrier after each), and the batch is ordered after every restore copy by the
residency core.  Outside a batch each op is submitted alone (fine for tests;
the forward pass should record).  Nothing waits for the GPU except `sync()`
(and a batch that is re-begun while its last submit still runs).
"""
from __future__ import annotations

import contextlib
import os
import struct

from vramd.engine import attention_cm, linear
from vramd.errors import DeviceError, ModelError, UsageError
from vramd.gpu.kernels import Batch, Kernel, grid

try:  # the gguf package names the types; the values are GGML's and fixed
    from gguf import GGMLQuantizationType as _Q

    F32, F16, Q4_0, Q8_0, BF16 = _Q.F32, _Q.F16, _Q.Q4_0, _Q.Q8_0, _Q.BF16
except ImportError:  # pragma: no cover - gguf is a dependency
    F32, F16, Q4_0, Q8_0, BF16 = 0, 1, 2, 8, 30

# type -> (shader suffix, elements per block, bytes per block)
WEIGHT_TYPES = {int(F32): ("f32", 1, 4), int(F16): ("f16", 1, 2), int(BF16): ("bf16", 1, 2),
                int(Q8_0): ("q8_0", 32, 34), int(Q4_0): ("q4_0", 32, 18)}
# GGML's fixed values for Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (native/shaders/dequant_k.glsl)
WEIGHT_TYPES.update({3: ("q4_1", 32, 20), 6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24), 12: ("q4_k", 256, 144),
                     13: ("q5_k", 256, 176), 14: ("q6_k", 256, 210)})
# MXFP4 (39, gpt-oss's experts): 17-byte blocks, so rows may start at any byte (native/shaders/dequant_mxfp4.glsl)
WEIGHT_TYPES[39] = ("mxfp4", 32, 17)

# kernel -> (storage buffers, push-constant bytes); the shaders' layouts
_KERNELS = {"matvec": (3, 32), "matmul": (3, 32), "get_rows": (3, 32), "rms_norm": (3, 32), "rope": (3, 76),
            "kv_write": (3, 40), "attention": (6, 72), "attention_flash": (6, 72), "silu_mul": (3, 16), "add": (3, 20),
            "scale": (2, 16), "add_rms_norm": (4, 32), "attention_split": (5, 72), "attention_merge": (3, 28),
            "attention_split_gqa": (5, 72),
            **{f"attention_dec_{v}{q}": (5, 72) for v in ("n1g8", "n2g4", "n4g2") for q in ("", "_qs")},
            "rope_kv_write": (4, 80), "matvec_id": (4, 52), "moe_route": (4, 40), "moe_combine": (5, 36),
            "swiglu_oai": (3, 24), "add_id": (3, 20), "moe_group": (2, 20),
            "matmul_id": (4, 52)}

_MAX_HEAD_DIM = 512       # attention.comp: MAXD * WG
_FLASH_HEAD_DIM = 256     # attention_flash.comp: MAXW * 2 (larger heads take attention.comp)
_SPLIT_KEYS = 32          # decode attention: keys per work group's range at least (attention_split.comp)
_SPLIT_GROUPS = 1024      # decode attention: work groups aimed at (heads x ranges), ~8 per SM of an H200;
                          # more cost more than they share (8192 at ctx 8192 made a step 1.3 ms slower)
_DEC_GROUPS = 512         # attention_dec: work groups aimed at per token (KV head blocks x ranges), ~4 per SM
                          # of an H200, whatever the tokens (a token's ranges must not depend on its step's);
                          # VRAMD_DEC_GROUPS overrides it (native/dattn_h200.sh tries 256 and 1024)
_DEC_KEYS = {1: 64, 2: 32, 4: 16}   # attention_dec_n<NC>: keys a group reads a trip (16 lanes x UL)
_DEC_FORMS = {1: "attention_dec_n1g8", 2: "attention_dec_n2g4", 4: "attention_dec_n4g2"}   # by NC
_GQA_MAX_GROUP = 16       # attention_split_gqa.comp: MAXG query heads per KV head
_GQA_MAX_WORDS = 2048     # attention_split_gqa.comp: MAXQW, the group's q heads' words
_ELEMENTWISE_WG = 256     # local size of the element-wise shaders
ROUTE_MAX_EXPERTS = 1024  # moe_route.comp: MAX_EXPERT (its shared copy of a token's logits)
ROUTE_MAX_USED = 64       # moe_route.comp: MAX_USED


FLASH_K32_SHARED = 41856  # attention_flash_k32.comp's shared bytes: Q 2112 vec2, K/V 32 x 129 words, scores 64 x 33
FLASH_K16_SHARED = 29504  # attention_flash.comp's (16-key tiles)


def flash_kernel(limits: dict) -> str | None:
    """The prefill attention kernel a device takes: K/V tiles of 32 keys where its shared
    memory holds them (the H200's 48 KiB), else of 16 (29 KiB: lavapipe's 32 KiB), else none
    (Vulkan guarantees only 16 KiB: such a device runs attention.comp, a work group per head
    and token).  VRAMD_FLASH_K16 (set to anything) keeps the 16-key tiles (benchmarks of one
    against the other)."""
    shared = limits.get("maxComputeSharedMemorySize", 0)
    if shared < FLASH_K16_SHARED:
        return None
    if os.environ.get("VRAMD_FLASH_K16"):
        return "attention_flash"
    return "attention_flash_k32" if shared >= FLASH_K32_SHARED else "attention_flash"


def flash_rows(head_dim: int) -> int:
    """Query rows ((token, q head) pairs) of one attention_flash.comp work group: its Q tile's size."""
    return 64 if head_dim <= 64 else 32 if head_dim <= 128 else 16


def type_name(qtype) -> str:
    try:
        return _Q(int(qtype)).name
    except Exception:
        return str(qtype)


def row_bytes(qtype, cols: int) -> int:
    """Bytes of one row of `cols` elements in `qtype`."""
    name, block, size = _weight_type(qtype)
    if cols % block:
        raise ModelError(f"{type_name(qtype)} rows must be a multiple of {block} elements, got {cols}")
    return cols // block * size


def _weight_type(qtype):
    t = WEIGHT_TYPES.get(int(qtype))
    if t is None:
        supported = ", ".join(type_name(k) for k in WEIGHT_TYPES)
        raise ModelError(f"tensor type {type_name(qtype)} is not supported by the compute kernels "
                         f"(supported: {supported})")
    return t


class Weight:
    """A weight matrix (or embedding table) in ggml order: `rows` rows of
    `cols` contiguous elements of `qtype` (a gguf.GGMLQuantizationType), in
    `tensor` (a residency Tensor or a (buffer, offset, nbytes) view).  In GGUF
    shape terms, cols = ne[0] and rows = ne[1].  In a stack of experts'
    matrices (matvec_id), `stride` bytes lead from one expert's matrix to the
    next: rows * row bytes, or more where the matrix is a part of each expert's
    (gemma4's fused ffn_gate_up_exps: the gate rows, then the up rows)."""

    def __init__(self, tensor, qtype, rows: int, cols: int, stride: int | None = None):
        self.tensor, self.qtype, self.rows, self.cols = tensor, int(qtype), int(rows), int(cols)
        self.suffix = _weight_type(qtype)[0]
        if self.rows <= 0 or self.cols <= 0:
            raise ModelError(f"weight of {rows} x {cols} elements")
        self.row_bytes = row_bytes(qtype, self.cols)
        self.stride = self.rows * self.row_bytes if stride is None else int(stride)
        have = _nbytes(tensor)
        if self.rows * self.row_bytes > have:
            raise ModelError(f"{type_name(qtype)} weight of {rows} x {cols} needs {self.rows * self.row_bytes} "
                             f"bytes, its tensor has {have}")

    def __repr__(self):
        return f"Weight({type_name(self.qtype)}, {self.rows} x {self.cols})"


def _round4(n: int) -> int:
    """A bound range rounded up to whole uint32 words: shaders read words,
    and a word partly outside the range reads as zero (robust access).  The
    residency core rounds blocks to allocation granules and aligns tensors to
    256 bytes, so the up to 3 bytes past a tensor's end exist."""
    return max(4, (n + 3) // 4 * 4)


def _nbytes(buf) -> int:
    return buf[2] if isinstance(buf, tuple) else buf.nbytes


def _resolve(buf) -> tuple[int, int, int]:
    """(VkBuffer, byte offset, nbytes) of a Tensor or a view tuple."""
    if isinstance(buf, tuple):
        return buf
    b, o = buf.buffer()
    return b, o, buf.nbytes


def view(tensor, offset: int, nbytes: int | None = None) -> tuple[int, int, int]:
    """Bytes offset .. offset + nbytes of `tensor` (a Tensor or a view) as a
    (VkBuffer, offset, nbytes) view.  Resolves the buffer now: make views
    after the tensor's region is resident (or scratch)."""
    b, o, n = _resolve(tensor)
    if nbytes is None:
        nbytes = n - offset
    if offset < 0 or nbytes < 0 or offset + nbytes > n:
        raise UsageError(f"view {offset}+{nbytes} outside a buffer of {n} bytes")
    return b, o + offset, nbytes


def _check_subgroups(device) -> int:
    """matvec reduces with subgroup arithmetic (lavapipe and NVIDIA have it
    in compute shaders); a device without it is refused up front."""
    vk = device.vk
    sp = vk.VkPhysicalDeviceSubgroupProperties(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES)
    p2 = vk.VkPhysicalDeviceProperties2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=sp)
    vk.vkGetPhysicalDeviceProperties2(device.physical, p2)
    need = vk.VK_SUBGROUP_FEATURE_BASIC_BIT | vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT
    if not sp.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT or (sp.supportedOperations & need) != need:
        raise DeviceError(f"Vulkan device {device.name} lacks subgroup arithmetic in compute shaders, "
                          "which the compute kernels need")
    return int(sp.subgroupSize)


def decode_attn_form() -> str:
    """The decode attention form: "new" (attention_dec_n*.comp, a work group per KV head
    block and key range, 16-byte K/V loads, shuffle reductions; the default on every device)
    or "old" (attention_split.comp / attention_split_gqa.comp), by VRAMD_DECODE_ATTN=new|old.
    On lavapipe too the new one is faster (scripts/decode_attn_ab.py, 8 layers, 6 rounds,
    load ~4 on 2 cores, 2026-12-02: 32 q / 8 KV heads of 128 at 2,001 keys 798 against
    1,791 ms, at 101 keys 36 against 85; gpt-oss's 64 / 8 of 64 at 2,001 keys 325 against
    2,262, its 128-key window with sinks 48 against 178)."""
    form = os.environ.get("VRAMD_DECODE_ATTN", "new")
    if form not in ("new", "old"):
        raise UsageError(f"VRAMD_DECODE_ATTN={form!r}: expected new or old")
    return form


def _env_count(name: str, default: int) -> int:
    """A positive count from the environment variable `name`, else `default`."""
    v = os.environ.get(name, "")
    if not v:
        return default
    if not v.isdigit() or int(v) < 1:
        raise UsageError(f"{name}={v!r}: expected a positive integer")
    return int(v)


def dec_kernel(head_dim: int) -> str | None:
    """The long-context decode attention variant for `head_dim` (attention_dec_n<NC>: NC
    16-byte pieces a thread per row, head_dim <= 64 NC), None where it does not apply
    (head_dim not a multiple of 8, or over 256)."""
    nc = next((c for c in sorted(_DEC_FORMS) if head_dim <= 64 * c), 0)
    return _DEC_FORMS[nc] if nc and head_dim % 8 == 0 else None


class Ops:
    """The kernels of one residency core and the batch they record into."""

    def __init__(self, residency):
        self.residency = residency
        lim = residency.device.limits
        self.max_range = int(lim["maxStorageBufferRange"])
        # At least 16: matvec reads weights and x as 16-byte vectors when the
        # bound offsets allow (alignments are powers of two, so max is a multiple).
        self.align = max(16, int(lim["minStorageBufferOffsetAlignment"]))
        self.max_groups = lim["maxComputeWorkGroupCount"]
        self.subgroup_size = _check_subgroups(residency.device)
        self.coopmat = linear.coopmat_usable(residency.device)   # tensor-core matmuls (False: the portable ones)
        self.flash = flash_kernel(lim)   # prefill attention's kernel (its K/V tile by the shared memory)
        self.flash_cm = attention_cm.usable(residency.device)    # tensor-core prefill attention (VRAMD_FLASH_CM=0: off)
        self.cpu = residency.device.type == "cpu"   # linear.select(): the row-per-invocation forms
        self.q8_dp = linear.q8_decode_usable(residency.device)   # Q8_0 decode by integer dot products
        # A step's decode rows: up to this many a work group (linear.per_token_kernel; 1: each
        # row through its lone kernel).  On a CPU device the lone kernels are the matvec_c
        # forms, which have no such form: tests set `cpu` False to run these kernels there.
        self.mv_tokens = linear.mv_tokens()
        # ... and the subgroup size every pipeline runs with, which a row's sums depend on; 0
        # where VK_EXT_subgroup_size_control says it may vary (AMD: 32 or 64, Intel: 8 to 32,
        # chosen per pipeline by the driver): there the lone kernel, row by row
        sizes = getattr(residency.device, "subgroup_sizes", None)
        self.fixed_subgroup = self.subgroup_size if not sizes or sizes[0] == sizes[1] else 0
        # Decode attention of grouped-query heads by KV head (attention_split_gqa.comp): opt-in
        # (VRAMD_SPLIT_GQA=1).  On the H200 (2026-12-02, bench decode at 8,000 tokens, A/B twice)
        # it lost: 8B Q4_K 111.1 / 110.4 tok/s against the per-head form's 145.4 / 148.3 (the
        # per-head groups' repeated K/V reads hit the L2), gpt-oss 152.4 against 149.6.
        self.split_gqa = os.environ.get("VRAMD_SPLIT_GQA", "0") == "1"
        self.decode_attn = decode_attn_form()   # "new": attention_dec_n* (see _attention_split)
        self.dec_groups = _env_count("VRAMD_DEC_GROUPS", _DEC_GROUPS)   # its work groups a token (tuning A/B)
        # its q slices in registers (default) or shared memory (the _qs variants; tuning A/B)
        self.dec_q = os.environ.get("VRAMD_DEC_Q", "regs")
        if self.dec_q not in ("regs", "shared"):
            raise UsageError(f"VRAMD_DEC_Q={self.dec_q!r}: expected regs or shared")
        self._kernels: dict[str, Kernel] = {}
        self._batch: Batch | None = None      # recording now
        self._parallel = False                # inside parallel(): no barrier after each dispatch
        self._spare: Batch | None = None      # reused by batch()
        # (n_tokens, [(first row, rows, one token a sequence)]) of the batch being recorded
        # (TransformerModel._set_segs): matvec of n_tokens rows runs the one-token-a-sequence
        # rows through the per-token kernels whatever their number (see matvec)
        self.token_rows = None
        self._graphs: list[Batch] = []
        # A vramd.gpu.timing.Timestamps that every batch() writes into (None: untimed): the
        # prefill profile (`vramd bench decode --profile-prefill`), matmul benchmarks.  Each
        # batch resets it, so read it after the one batch of interest has completed.
        self.timer = None

    # -- recording ---------------------------------------------------------

    @contextlib.contextmanager
    def batch(self):
        """Records the ops called inside into one command buffer and submits
        it once on exit (without waiting: `sync()` before reading)."""
        if self._batch is not None:
            raise UsageError("a batch is already recording")
        b = self._spare or Batch(self.residency)
        self._spare = None
        b.timer = self.timer
        b.begin()
        self._batch = b
        try:
            yield b
        except BaseException:
            self._batch = None
            b.end()
            self._spare = b
            raise
        self._batch = None
        try:
            b.submit()
        finally:
            self._spare = b

    @contextlib.contextmanager
    def record(self, graph: Batch):
        """Records the ops called inside into `graph` (from `graph()`),
        replacing what it held; `graph.submit()` runs it, as often as wanted.
        Re-record after a release/restore cycle (buffers may move)."""
        if self._batch is not None:
            raise UsageError("a batch is already recording")
        graph.begin()
        self._batch = graph
        try:
            yield graph
        finally:
            self._batch = None
            graph.end()

    def graph(self) -> Batch:
        """A reusable recording (a `Batch`) owned by these ops."""
        g = Batch(self.residency)
        self._graphs.append(g)
        return g

    def barrier(self):
        """A compute-to-compute barrier in the current batch."""
        if self._batch is not None:
            self._batch.barrier()

    @contextlib.contextmanager
    def parallel(self):
        """Ops called inside are independent of each other (none reads what
        another writes, no two write the same bytes): they are recorded
        without the barrier after each, and one barrier follows them all, so
        the GPU may overlap them (q/k/v projections, gate and up)."""
        if self._parallel:
            raise UsageError("parallel() does not nest")
        self._parallel = True
        try:
            yield
        finally:
            self._parallel = False
            self.barrier()

    def sync(self) -> None:
        """Waits for every submitted op."""
        self.residency.sync()
        for b in [self._spare, *self._graphs]:
            if b is not None:
                b.submitted = False

    def close(self) -> None:
        self.residency.sync()
        for b in [self._spare, self._batch, *self._graphs]:
            if b is not None:
                b.close()
        self._spare = self._batch = None
        self._graphs = []
        for k in self._kernels.values():
            k.close()
        self._kernels = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _kernel(self, name: str, family: str | None = None) -> Kernel:
        k = self._kernels.get(name)
        if k is None:
            n, push = _KERNELS[family or name]
            # the tensor-core kernels assume 32-lane subgroups: asked for where the device can be asked
            cm = name.startswith(("matmul_cm_", "attention_flash_cm_"))
            sub = linear.cm_subgroup_size(self.residency.device) if cm else None
            k = self._kernels[name] = Kernel(self.residency, name, n_buffers=n, push_bytes=push, subgroup_size=sub)
        return k

    def _dispatch(self, kernel: Kernel, views, push: bytes, groups, *, label: str | None = None,
                  nbytes: int = 0) -> None:
        """`label`/`nbytes`: the name and bytes read, for a batch's timer (vramd/gpu/timing.py)."""
        if self._batch is not None:
            self._batch.dispatch(kernel, views, push, groups, not self._parallel, label=label, nbytes=nbytes)
            return
        with self.batch() as b:
            b.dispatch(kernel, views, push, groups, label=label, nbytes=nbytes)

    # -- binding -----------------------------------------------------------

    def _bind(self, buf, nbytes: int, what: str, elem: int = 4) -> tuple[tuple[int, int, int], int]:
        """Binds the first `nbytes` of `buf`: (view, element offset of byte 0
        within the view).  `elem` is the unit the shader indexes in."""
        b, off, have = _resolve(buf)
        if nbytes > have:
            raise UsageError(f"{what}: needs {nbytes} bytes, the buffer has {have}")
        if off % elem:
            raise UsageError(f"{what}: byte offset {off} is not a multiple of {elem}")
        start = off // self.align * self.align
        rng = _round4(off - start + nbytes)
        if rng > self.max_range:
            raise UsageError(f"{what}: {nbytes} bytes exceed the device's maxStorageBufferRange "
                             f"({self.max_range}); split the op")
        return (b, start, rng), (off - start) // elem

    def _bind_pos(self, pos, n_tokens: int, seq, what: str):
        """The positions' binding (view, int offset of pos[0]) and, with `seq` (the tokens'
        sequence ids, int32, in the same buffer as the positions: the scratch's "pos" holds
        both), the int offset of seq[0] in it; without, 0."""
        if seq is None:
            return (*self._bind(pos, 4 * n_tokens, what), 0)
        (pb, po, _pn), (sb, so, _sn) = _resolve(pos), _resolve(seq)
        if pb != sb:
            raise UsageError(f"{what}: the sequence ids must share the positions' buffer")
        lo, hi = min(po, so), max(po, so) + 4 * n_tokens
        v, first = self._bind((pb, lo, hi - lo), hi - lo, what)
        return v, first + (po - lo) // 4, first + (so - lo) // 4

    def _row_chunks(self, w: Weight, rows_needed: int):
        """(view, byte offset in view, first row, rows) pieces of a weight, each
        within one storage range (tables larger than the range go in pieces)."""
        b, off, _ = _resolve(w.tensor)
        per = (self.max_range - self.align - 4) // w.row_bytes
        if per < 1:
            raise UsageError(f"one row of {w} exceeds the device's maxStorageBufferRange")
        for r0 in range(0, rows_needed, per):
            n = min(per, rows_needed - r0)
            s = off + r0 * w.row_bytes
            start = s // self.align * self.align
            yield (b, start, _round4(s - start + n * w.row_bytes)), s - start, r0, n

    @staticmethod
    def _groups1d(n: int, limits) -> tuple[int, int, int]:
        gx, gy = grid(-(-n // _ELEMENTWISE_WG), limits)
        return gx, gy, 1

    # -- ops ---------------------------------------------------------------

    def copy(self, src, dst, nbytes: int) -> None:
        """dst[:nbytes] = src[:nbytes] (Tensors, views, or a HostBuffer's
        views), ordered after the ops before it and before those after."""
        sv, dv = _resolve(src), _resolve(dst)
        if self._batch is not None:
            self._batch.copy(sv, dv, nbytes)
            return
        with self.batch() as b:
            b.copy(sv, dv, nbytes)

    def matvec(self, w: Weight, x, y, n_tokens: int = 1, *, x_stride: int | None = None,
               y_stride: int | None = None) -> None:
        """Y[t, r] = sum_c W[r, c] * X[t, c] for t < n_tokens, r < w.rows.

        x: f32 [n_tokens, x_stride] (x_stride defaults to w.cols), y: f32
        [n_tokens, y_stride] (y_stride defaults to w.rows; a larger stride
        writes into a wider row, e.g. a fused QKV buffer).  Dequantizes in
        the kernel, accumulates in f32; y must not alias x."""
        x_stride = w.cols if x_stride is None else int(x_stride)
        y_stride = w.rows if y_stride is None else int(y_stride)
        if n_tokens < 1 or x_stride < w.cols or y_stride < w.rows:
            raise UsageError(f"matvec: bad sizes (n_tokens {n_tokens}, strides {x_stride}/{y_stride}) for {w}")
        runs = self.token_rows
        if runs is not None and runs[0] == n_tokens:
            # A step's decode rows (one token a sequence) go through the kernel a lone token
            # takes, each row on its own, so a request's numbers do not depend on its batch;
            # the rest (a prefill chunk) through what its size selects.
            for first, count, per_token in runs[1]:
                self._matvec(w, view(x, 4 * first * x_stride), view(y, 4 * first * y_stride), count,
                             x_stride, y_stride, per_token)
            return
        self._matvec(w, x, y, n_tokens, x_stride, y_stride, False)

    def _matvec(self, w: Weight, x, y, n_tokens: int, x_stride: int, y_stride: int, per_token: bool) -> None:
        # The kernel is chosen by vramd/engine/linear.py's select(), per bound row chunk.
        gz0 = -(-n_tokens // linear.MATMUL_TOKENS) if n_tokens >= linear.MATMUL_FROM else n_tokens
        if gz0 > self.max_groups[2]:
            raise UsageError(f"matvec: {n_tokens} tokens exceed the device's grid")
        xv, xo = self._bind(x, 4 * ((n_tokens - 1) * x_stride + w.cols), "matvec x")
        yv, yo = self._bind(y, 4 * ((n_tokens - 1) * y_stride + w.rows), "matvec y")
        for wv, wo, r0, n in self._row_chunks(w, w.rows):
            if per_token:   # each row bit for bit its lone kernel's, several a work group where it can
                sel = linear.per_token_kernel(w, n_tokens, wo, x_stride, self.mv_tokens, self.fixed_subgroup,
                                              coopmat=self.coopmat, cpu=self.cpu, q8_dp=self.q8_dp)
            else:
                sel = linear.select(w, n_tokens, wo, self.coopmat, cpu=self.cpu, q8_dp=self.q8_dp)
            k = self._kernel(sel.name, "matvec")
            push = struct.pack("<8I", n, w.cols, n_tokens, wo, xo, x_stride, yo + r0, y_stride)
            gx, gy = grid(-(-n // sel.rows_per_group), self.max_groups)
            gz = -(-n_tokens // sel.tokens_per_group)
            self._dispatch(k, [wv, xv, yv], push, (gx, gy, gz), label=f"{k.name} {w.rows}x{w.cols}",
                           nbytes=n * w.row_bytes)

    def fits_matvec_id(self, w: Weight) -> bool:
        """Whether matvec_id can bind a stack of `w`'s matrices: one whole
        expert's matrix within a storage range (the stack goes in runs of them)."""
        return w.rows * w.row_bytes + self.align + 4 <= self.max_range

    def expert_runs(self, w: Weight, n_expert: int):
        """(view, byte offset of the run's first matrix in the view, first
        expert, experts) runs of a stacked expert tensor, each within one
        storage range: matvec_id binds them one dispatch each.  `w` is
        expert 0's matrix at the start of the stack."""
        b, off, have = _resolve(w.tensor)
        slab = w.rows * w.row_bytes
        if (n_expert - 1) * w.stride + slab > have:
            raise UsageError(f"{n_expert} experts of {w} need {(n_expert - 1) * w.stride + slab} bytes, "
                             f"the tensor has {have}")
        room = self.max_range - self.align - 4 - slab
        if room < 0:
            raise UsageError(f"one expert's matrix ({w}, {slab} bytes) exceeds the device's "
                             f"maxStorageBufferRange ({self.max_range})")
        per = 1 + room // w.stride
        for e0 in range(0, n_expert, per):
            n = min(per, n_expert - e0)
            s = off + e0 * w.stride
            start = s // self.align * self.align
            yield (b, start, _round4(s - start + (n - 1) * w.stride + slab)), s - start, e0, n

    def matvec_id(self, w: Weight, n_expert: int, ids, x, y, n_slots: int, *, x_div: int = 1,
                  x_stride: int | None = None, y_stride: int | None = None) -> None:
        """Y[s, r] = sum_c W_{ids[s]}[r, c] * X[s // x_div, c] for slots s < n_slots, r < w.rows:
        each slot's expert matrix times its x row, all slots in one dispatch
        (work-group z: the slot), the experts read from `ids` on the GPU.

        w: expert 0's matrix (w.rows x w.cols of w.qtype) at the start of
        w.tensor, the whole stack (ggml's [n_expert, rows, cols]) in that
        tensor; ids: int32 [n_slots], each in 0 .. n_expert-1 (a slot with
        another id is left unwritten), e.g. moe_route's; x: f32 [n_slots /
        x_div, x_stride]: x_div = experts per token makes a token's slots
        share its row (gate, up), 1 gives each slot its own (down); y: f32
        [n_slots, y_stride] (defaults w.cols, w.rows)."""
        x_stride = w.cols if x_stride is None else int(x_stride)
        y_stride = w.rows if y_stride is None else int(y_stride)
        if n_slots < 1 or x_div < 1 or x_stride < w.cols or y_stride < w.rows:
            raise UsageError(f"matvec_id: bad sizes (slots {n_slots}, x_div {x_div}, strides "
                             f"{x_stride}/{y_stride}) for {w}")
        if n_slots > self.max_groups[2]:
            raise UsageError(f"matvec_id: {n_slots} slots exceed the device's grid")
        n_x = -(-n_slots // x_div)
        iv, io = self._bind(ids, 4 * n_slots, "matvec_id ids")
        xv, xo = self._bind(x, 4 * ((n_x - 1) * x_stride + w.cols), "matvec_id x")
        yv, yo = self._bind(y, 4 * ((n_slots - 1) * y_stride + w.rows), "matvec_id y")
        slab = w.rows * w.row_bytes
        words = w.suffix in linear.MATVEC_ROWS_W and w.row_bytes % 16 == 0
        for wv, wo, e0, n in self.expert_runs(w, n_expert):
            k, per_group = self._kernel("matvec_id_" + w.suffix, "matvec_id"), linear.MATVEC_ROWS
            if words and wo % 16 == 0:  # the unit-per-thread form, as matvec's
                k, per_group = self._kernel("matvec_id_w_" + w.suffix, "matvec_id"), linear.MATVEC_ROWS_W[w.suffix]
            push = struct.pack("<13I", w.rows, w.cols, n_slots, wo, xo, x_stride, yo, y_stride, io, w.stride, e0, n,
                               x_div)
            gx, gy = grid(-(-w.rows // per_group), self.max_groups)
            # Each slot reads one matrix: n_slots slabs in all, whichever run holds them.
            self._dispatch(k, [wv, xv, yv, iv], push, (gx, gy, n_slots),
                           label=f"{k.name} {w.rows}x{w.cols}x{n_slots}", nbytes=n_slots * slab if e0 == 0 else 0)

    def moe_group(self, ids, groups, n_slots: int, n_expert: int, bt: int = linear.MATMUL_TOKENS) -> None:
        """groups = the slots grouped by expert and their tiles of at most `bt` slots
        (moe_group.comp: one work group, a stable counting sort), for matmul_id.

        ids: int32 [n_slots], each in 0 .. n_expert-1 (moe_route's: slot t * k + j
        is token t's j-th expert); groups: uint32 [linear.group_words(n_slots,
        n_expert, bt)]: the sorted slots, the tile count, (expert, first, count) a tile."""
        if not 1 <= n_expert <= ROUTE_MAX_EXPERTS or n_slots < 1 or bt < 1:
            raise UsageError(f"moe_group: {n_slots} slots of {n_expert} experts (the kernel takes up to "
                             f"{ROUTE_MAX_EXPERTS}), tiles of {bt}")
        iv, io = self._bind(ids, 4 * n_slots, "moe_group ids")
        gv, go = self._bind(groups, 4 * linear.group_words(n_slots, n_expert, bt), "moe_group groups")
        self._dispatch(self._kernel("moe_group"), [iv, gv], struct.pack("<5I", n_slots, n_expert, bt, io, go),
                       (1, 1, 1))

    def matmul_id(self, w: Weight, n_expert: int, groups, x, y, n_slots: int, *, x_div: int = 1,
                  x_stride: int | None = None, y_stride: int | None = None) -> None:
        """matvec_id's Y[s, r] = sum_c W_{ids[s]}[r, c] * X[s // x_div, c] (same arguments,
        with `groups`, moe_group's output for those ids with bt = linear.MATMUL_TOKENS,
        in place of the ids), as tiled matmuls over each expert's slots
        (matmul_id_<type>: matmul.glsl with matmul_rows.glsl's MM_ID): each used
        expert's matrix read once per tile of its slots instead of once per slot.
        The grid covers the most tiles the slots can make (linear.id_tiles), so
        nothing is read back; unused tiles leave at once.  A stack larger than
        a binding goes in runs of experts, a dispatch each (expert_runs)."""
        x_stride = w.cols if x_stride is None else int(x_stride)
        y_stride = w.rows if y_stride is None else int(y_stride)
        if n_slots < 1 or x_div < 1 or x_stride < w.cols or y_stride < w.rows:
            raise UsageError(f"matmul_id: bad sizes (slots {n_slots}, x_div {x_div}, strides "
                             f"{x_stride}/{y_stride}) for {w}")
        bt = linear.MATMUL_TOKENS
        tiles = linear.id_tiles(n_slots, n_expert, bt)
        if tiles > self.max_groups[2]:
            raise UsageError(f"matmul_id: {n_slots} slots make up to {tiles} tiles, beyond the device's grid")
        n_x = -(-n_slots // x_div)
        gv, go = self._bind(groups, 4 * linear.group_words(n_slots, n_expert, bt), "matmul_id groups")
        xv, xo = self._bind(x, 4 * ((n_x - 1) * x_stride + w.cols), "matmul_id x")
        yv, yo = self._bind(y, 4 * ((n_slots - 1) * y_stride + w.rows), "matmul_id y")
        slab = w.rows * w.row_bytes
        k = self._kernel("matmul_id_" + w.suffix, "matmul_id")
        gx, gy = grid(-(-w.rows // linear.MATMUL_ROWS), self.max_groups)
        for wv, wo, e0, n in self.expert_runs(w, n_expert):
            push = struct.pack("<13I", w.rows, w.cols, n_slots, wo, xo, x_stride, yo, y_stride, go, w.stride, e0,
                               n, x_div)
            # (bytes: at most every expert's matrix once per run, fewer where some have no slot)
            self._dispatch(k, [wv, xv, yv, gv], push, (gx, gy, tiles),
                           label=f"{k.name} {w.rows}x{w.cols}x{n_slots}", nbytes=min(n, n_slots) * slab)

    def moe_route(self, logits, ids, weights, n_tokens: int, n_expert: int, k: int, renormalize: bool, *,
                  scale=None) -> None:
        """ids[t, j], weights[t, j] (j < k): token t's k experts, by decreasing
        softmax probability of its router logits (ties: the lower id first),
        and those probabilities, divided by their sum when `renormalize`, then
        times scale[id] where `scale` (f32 [n_expert], gemma4's per-expert output
        scale) is given -- vramd/engine/moe.py's route(), on the GPU (moe_route.comp).

        logits: f32 [n_tokens, n_expert]; ids: int32 [n_tokens, k];
        weights: f32 [n_tokens, k]."""
        if not 1 <= k <= n_expert or n_expert > ROUTE_MAX_EXPERTS or k > ROUTE_MAX_USED:
            raise UsageError(f"moe_route: {k} of {n_expert} experts (the kernel takes up to "
                             f"{ROUTE_MAX_USED} of {ROUTE_MAX_EXPERTS})")
        lv, lo = self._bind(logits, 4 * n_tokens * n_expert, "moe_route logits")
        iv, io = self._bind(ids, 4 * n_tokens * k, "moe_route ids")
        wv, wo = self._bind(weights, 4 * n_tokens * k, "moe_route weights")
        sv, so = self._bind(scale, 4 * n_expert, "moe_route scale") if scale is not None else (lv, 0)   # unread
        push = struct.pack("<10I", n_expert, k, n_tokens, lo, io, wo, int(bool(renormalize)), int(scale is not None),
                           so, 0)
        gx, gy = grid(n_tokens, self.max_groups)
        self._dispatch(self._kernel("moe_route"), [lv, iv, wv, sv], push, (gx, gy, 1))

    def moe_combine(self, x, down, weights, n_tokens: int, k: int, width: int, *, shared=None,
                    shared_gate=None, assign: bool = False) -> None:
        """x[t] += sum_j weights[t, j] * down[t * k + j] (+ sigmoid(shared_gate[t])
        * shared[t]): the routed experts' outputs, weighted, and a shared
        expert's, gated, added to the residual stream (moe_combine.comp);
        assign: x[t] = the sum instead (gemma4's experts, normed before the add).

        x, shared: f32 [n_tokens, width]; down: f32 [n_tokens * k, width];
        weights: f32 [n_tokens, k]; shared_gate: f32 [n_tokens] (logits)."""
        if (shared is None) != (shared_gate is None):
            raise UsageError("moe_combine: a shared expert needs its gate, and the other way round")
        xv, xo = self._bind(x, 4 * n_tokens * width, "moe_combine x")
        dv, do = self._bind(down, 4 * n_tokens * k * width, "moe_combine down")
        wv, wo = self._bind(weights, 4 * n_tokens * k, "moe_combine weights")
        if shared is not None:
            sv, so = self._bind(shared, 4 * n_tokens * width, "moe_combine shared")
            gv, go = self._bind(shared_gate, 4 * n_tokens, "moe_combine shared gate")
        else:
            (sv, so), (gv, go) = (dv, 0), (wv, 0)   # bound, never read
        push = struct.pack("<9I", width, n_tokens, k, xo, do, wo, so, go,
                           int(shared is not None) | (2 if assign else 0))
        self._dispatch(self._kernel("moe_combine"), [xv, dv, wv, sv, gv], push,
                       self._groups1d(n_tokens * width, self.max_groups))

    def get_rows(self, table: Weight, ids, out, n_tokens: int, *, o_stride: int | None = None) -> None:
        """out[t, :] = table[ids[t], :] as f32 (embedding lookup).

        ids: int32 [n_tokens]; out: f32 [n_tokens, o_stride] (default
        table.cols).  An id outside 0 .. rows-1 leaves its output row alone."""
        o_stride = table.cols if o_stride is None else int(o_stride)
        iv, io = self._bind(ids, 4 * n_tokens, "get_rows ids")
        ov, oo = self._bind(out, 4 * ((n_tokens - 1) * o_stride + table.cols), "get_rows out")
        k = self._kernel("get_rows_" + table.suffix, "get_rows")
        groups = self._groups1d(n_tokens * table.cols, self.max_groups)
        for wv, wo, r0, n in self._row_chunks(table, table.rows):
            push = struct.pack("<8I", table.cols, n_tokens, wo, r0, n, io, oo, o_stride)
            self._dispatch(k, [wv, iv, ov], push, groups)

    def rms_norm(self, x, w, y, eps: float, n_tokens: int, width: int, *, x_stride: int | None = None,
                 y_stride: int | None = None) -> None:
        """y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w per token row.

        x, y: f32 [n_tokens, stride] (strides default to width; y may be x);
        w: f32 [width] (GGUF norm weights are F32), or None: no weight (w = 1)."""
        x_stride = width if x_stride is None else int(x_stride)
        y_stride = width if y_stride is None else int(y_stride)
        xv, xo = self._bind(x, 4 * ((n_tokens - 1) * x_stride + width), "rms_norm x")
        if w is None:   # the shader reads no weight; x stands in for the binding
            wv, wo = xv, 0xFFFFFFFF
        else:
            wv, wo = self._bind(w, 4 * width, "rms_norm weight")
        yv, yo = self._bind(y, 4 * ((n_tokens - 1) * y_stride + width), "rms_norm y")
        push = struct.pack("<2If5I", width, n_tokens, eps, xo, x_stride, wo, yo, y_stride)
        gx, gy = grid(n_tokens, self.max_groups)
        self._dispatch(self._kernel("rms_norm"), [xv, wv, yv], push, (gx, gy, 1))

    def add_rms_norm(self, x, a, w, y, eps: float, n_tokens: int, width: int) -> None:
        """x[t] += a[t], then y[t] = rms_norm(x[t]) * w, in one dispatch (a
        residual add and the norm after it).  x, a, y: f32 [n_tokens,
        width], contiguous; a and y may be the same buffer, x neither."""
        xv, xo = self._bind(x, 4 * n_tokens * width, "add_rms_norm x")
        av, ao = self._bind(a, 4 * n_tokens * width, "add_rms_norm a")
        wv, wo = self._bind(w, 4 * width, "add_rms_norm weight")
        yv, yo = self._bind(y, 4 * n_tokens * width, "add_rms_norm y")
        push = struct.pack("<2If5I", width, n_tokens, eps, xo, ao, wo, yo, 0)
        gx, gy = grid(n_tokens, self.max_groups)
        self._dispatch(self._kernel("add_rms_norm"), [xv, av, wv, yv], push, (gx, gy, 1))

    def rope(self, x, pos, n_tokens: int, n_heads: int, head_dim: int, *, n_rot: int | None = None,
             neox: bool = False, freq_base: float = 10000.0, freq_scale: float = 1.0, freq_factors=None,
             t_stride: int | None = None, ext_factor: float = 0.0, corr_dims=(0.0, 0.0), mscale: float = 1.0,
             temperature=None) -> None:
        """Rotates x in place: f32 [n_tokens, n_heads, head_dim], token rows
        t_stride floats apart (default n_heads * head_dim), by the positions
        pos: int32 [n_tokens].  theta(p, i) = freq_scale * p *
        freq_base^(-2i/n_rot) / freq_factors[i] (freq_factors: f32
        [n_rot/2] or None).  neox=False rotates (x[2i], x[2i+1]) (llama);
        neox=True rotates (x[i], x[i + n_rot/2]) (qwen2, gemma).
        ext_factor != 0: YaRN's mix of interpolated and extrapolated angles
        over the pairs corr_dims = (lo, hi); mscale multiplies the rotated
        pairs (arch/spec.py RopeScaling says what these are).  temperature =
        (scale, floor, offset): the pairs are also multiplied by 1 + scale *
        ln(floor((p + offset) / floor) + 1) (q of llama 4 / mistral3; needs
        n_rot = head_dim)."""
        n_rot = head_dim if n_rot is None else int(n_rot)
        t_stride = n_heads * head_dim if t_stride is None else int(t_stride)
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            raise ModelError(f"rope over {n_rot} of {head_dim} dimensions: needs an even count <= head_dim")
        t_scale, t_floor, t_offset = temperature or (0.0, 1.0, 0.0)
        if t_scale and (n_rot != head_dim or not t_floor > 0):
            raise ModelError(f"attention temperature over {n_rot} of {head_dim} rotated dimensions "
                             f"(floor {t_floor}): needs every dimension rotated and a positive floor")
        xv, xo = self._bind(x, 4 * ((n_tokens - 1) * t_stride + n_heads * head_dim), "rope x")
        pv, po = self._bind(pos, 4 * n_tokens, "rope positions")
        if freq_factors is not None:
            fv, fo = self._bind(freq_factors, 4 * (n_rot // 2), "rope freq_factors")
        else:
            fv, fo = pv, 0  # bound but never read
        push = struct.pack("<8I2f2I7f", n_tokens, n_heads, head_dim, n_rot, int(bool(neox)), xo, t_stride, po,
                           freq_base, freq_scale, int(freq_factors is not None), fo, ext_factor, corr_dims[0],
                           corr_dims[1], mscale, t_scale, t_floor, t_offset)
        self._dispatch(self._kernel("rope"), [xv, pv, fv], push,
                       self._groups1d(n_tokens * n_heads * (n_rot // 2), self.max_groups))

    def rope_kv_write(self, x, cache, pos, n_tokens: int, n_heads: int, head_dim: int, ctx: int, *,
                      n_rot: int | None = None, neox: bool = False, freq_base: float = 10000.0,
                      freq_scale: float = 1.0, freq_factors=None, t_stride: int | None = None,
                      ext_factor: float = 0.0, corr_dims=(0.0, 0.0), mscale: float = 1.0, seq=None,
                      n_seq: int = 1) -> None:
        """cache[pos[t], :] = f16(rope(x[t, :])): `rope` then `kv_write` in one
        dispatch, with x left unrotated (the attention reads K from the cache
        only).  Arguments as rope's (no temperature: it scales q only);
        cache: f16 [ctx, n_heads * head_dim]; with `seq` (as kv_write's) f16
        [n_seq * ctx, ...], token t's row seq[t] * ctx + pos[t]."""
        n_rot = head_dim if n_rot is None else int(n_rot)
        width = n_heads * head_dim
        t_stride = width if t_stride is None else int(t_stride)
        if n_rot % 2 or not 0 < n_rot <= head_dim or head_dim % 2:
            raise ModelError(f"rope over {n_rot} of {head_dim} dimensions: needs even sizes, n_rot <= head_dim")
        xv, xo = self._bind(x, 4 * ((n_tokens - 1) * t_stride + width), "rope_kv_write x")
        pv, po, so = self._bind_pos(pos, n_tokens, seq, "rope_kv_write positions")
        if freq_factors is not None:
            fv, fo = self._bind(freq_factors, 4 * (n_rot // 2), "rope_kv_write freq_factors")
        else:
            fv, fo = pv, 0  # bound but never read
        cv, co = self._bind(cache, 2 * (n_seq if seq is not None else 1) * ctx * width, "rope_kv_write cache")
        push = struct.pack("<8I2f4I4f2I", n_tokens, n_heads, head_dim, n_rot, int(bool(neox)), xo, t_stride, po,
                           freq_base, freq_scale, int(freq_factors is not None), fo, co, ctx, ext_factor,
                           corr_dims[0], corr_dims[1], mscale, so, ctx if seq is not None else 0)
        self._dispatch(self._kernel("rope_kv_write"), [xv, pv, fv, cv], push,
                       self._groups1d(n_tokens * width // 2, self.max_groups))

    def kv_write(self, src, cache, pos, n_tokens: int, width: int, ctx: int, *,
                 src_stride: int | None = None, seq=None, n_seq: int = 1) -> None:
        """cache[pos[t], :] = f16(src[t, :]) for t < n_tokens.

        src: f32 [n_tokens, src_stride] (default width); cache: f16 [ctx,
        width] (width = n_kv_heads * head_dim, even), row-major; pos: int32
        [n_tokens].  Positions outside 0 .. ctx-1 are skipped.  seq: the
        tokens' sequence ids (int32 [n_tokens], in pos's buffer): the cache
        is then n_seq sequences of ctx rows, token t's row seq[t] * ctx + pos[t]."""
        if width % 2:
            raise ModelError(f"KV width {width} is odd: the f16 cache is written two halves at a time")
        src_stride = width if src_stride is None else int(src_stride)
        sv, so = self._bind(src, 4 * ((n_tokens - 1) * src_stride + width), "kv_write src")
        cv, co = self._bind(cache, 2 * (n_seq if seq is not None else 1) * ctx * width, "kv_write cache")
        pv, po, qo = self._bind_pos(pos, n_tokens, seq, "kv_write positions")
        push = struct.pack("<10I", n_tokens, width, so, src_stride, co, width // 2, po, ctx, qo,
                           ctx if seq is not None else 0)
        self._dispatch(self._kernel("kv_write"), [sv, cv, pv], push,
                       self._groups1d(n_tokens * width // 2, self.max_groups))

    def attention(self, q, k_cache, v_cache, pos, out, n_tokens: int, n_heads: int, n_kv_heads: int,
                  head_dim: int, ctx: int, scale: float, *, window: int = 0, q_stride: int | None = None,
                  o_stride: int | None = None, tmp=None, softcap: float = 0.0,
                  flash: bool = True, sinks=None, seq=None, n_seq: int = 1) -> None:
        """out[t, h*hd:(h+1)*hd] = softmax_j(scale * q[t, h] . K[j, kvh]) V[j, kvh]
        over cache rows j <= pos[t] (and j > pos[t] - window when window > 0),
        kvh = h // (n_heads // n_kv_heads); softcap > 0 caps each score s
        (after the scale) to softcap * tanh(s / softcap) first (gemma2).

        q: f32 [n_tokens, n_heads, head_dim] (token rows q_stride floats
        apart, default n_heads*head_dim); k_cache, v_cache: f16 [ctx,
        n_kv_heads*head_dim] as written by kv_write; pos: int32 [n_tokens];
        out: f32 [n_tokens, o_stride] (default n_heads*head_dim).  The rows
        of the current tokens must be written (kv_write) before, in order.
        tmp: f32 scratch free during the op; given, a single token (decode)
        runs its keys in ranges over many work groups (_attention_split).

        Kernels: several tokens (prefill) with head_dim <= 256 take the
        flash form (attention_flash.comp: a work group per KV head and tile
        of query rows, K/V tiles shared by the group's q heads and tokens;
        attention_flash_k32.comp, tiles of 32 keys, where the shared memory
        holds them: flash_kernel; on a device with cooperative matrices and
        head_dim 64, 128 or 256 the tensor-core form attention_flash_cm_d<D>,
        engine/attention_cm.py);
        a single token the split form; what is left (a token without tmp,
        heads over 256; flash=False, the reference the flash form is tested
        against) attention.comp, a work group per (head, token).  Every form
        takes the sinks.
        sinks: f32 [n_heads], a logit per head that joins each softmax's
        denominator without a value (gpt-oss's attention sinks); None: none.
        seq: the tokens' sequence ids (int32 [n_tokens], in pos's buffer;
        parallel slots' decode, one token per sequence): the caches are n_seq
        sequences of ctx rows, token t's keys its sequence's; the split form
        takes every token at once (tmp needed)."""
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ModelError(f"{n_heads} attention heads are not a multiple of {n_kv_heads} KV heads")
        if head_dim % 2 or head_dim > _MAX_HEAD_DIM:
            raise ModelError(f"head_dim {head_dim}: the attention kernel takes even sizes up to {_MAX_HEAD_DIM}")
        width = n_kv_heads * head_dim
        q_stride = n_heads * head_dim if q_stride is None else int(q_stride)
        o_stride = n_heads * head_dim if o_stride is None else int(o_stride)
        qv, qo = self._bind(q, 4 * ((n_tokens - 1) * q_stride + n_heads * head_dim), "attention q")
        rows = n_seq * ctx if seq is not None else ctx
        kv, ko = self._bind(k_cache, 2 * rows * width, "attention K cache")
        vv, vo = self._bind(v_cache, 2 * rows * width, "attention V cache")
        pv, po, so = self._bind_pos(pos, n_tokens, seq, "attention positions")
        ov, oo = self._bind(out, 4 * ((n_tokens - 1) * o_stride + n_heads * head_dim), "attention out")
        # the sinks' binding: the positions stand in (never read) when there are none
        sink = (pv, po, 0) if sinks is None else (*self._bind(sinks, 4 * n_heads, "attention sinks"), 1)
        if seq is not None or (n_tokens == 1 and tmp is not None):
            split = (n_tokens, q_stride, o_stride, so, ctx if seq is not None else 0)
            if tmp is not None and self._attention_split(qv, qo, kv, ko, vv, vo, pv, po, ov, oo, tmp, n_heads,
                                                         n_kv_heads, head_dim, ctx, scale, window, softcap, sink, split):
                return
            if seq is not None:
                raise UsageError("attention: several sequences' tokens need the split form's tmp")
        # every prefill and fallback kernel takes the same push constants and bindings
        push = struct.pack("<14I2f2I", n_tokens, n_heads, n_kv_heads, head_dim, qo, q_stride, ko, vo, width // 2,
                           po, oo, o_stride, ctx, int(window), scale, softcap, sink[2], sink[1])
        cm = (attention_cm.kernel(head_dim, self.residency.device.limits.get("maxComputeSharedMemorySize", 0))
              if flash and self.flash_cm and n_tokens > 1 else None)
        if cm:   # the tensor-core form
            tiles = attention_cm.tiles(n_tokens, n_heads, n_kv_heads)
            if n_kv_heads > self.max_groups[0] or tiles > self.max_groups[1]:
                raise UsageError(f"attention: {n_kv_heads} KV heads x {tiles} query tiles exceed the device's grid")
            self._dispatch(self._kernel(cm, "attention"), [qv, kv, vv, pv, ov, sink[0]], push, (n_kv_heads, tiles, 1))
            return
        if flash and self.flash and n_tokens > 1 and head_dim <= _FLASH_HEAD_DIM:
            tiles = -(-n_tokens * (n_heads // n_kv_heads) // flash_rows(head_dim))
            if n_kv_heads > self.max_groups[0] or tiles > self.max_groups[1]:
                raise UsageError(f"attention: {n_kv_heads} KV heads x {tiles} query tiles exceed the device's grid")
            self._dispatch(self._kernel(self.flash, "attention_flash"), [qv, kv, vv, pv, ov, sink[0]], push,
                           (n_kv_heads, tiles, 1))
            return
        if n_heads > self.max_groups[0] or n_tokens > self.max_groups[1]:
            raise UsageError(f"attention: {n_heads} heads x {n_tokens} tokens exceed the device's grid")
        self._dispatch(self._kernel("attention"), [qv, kv, vv, pv, ov, sink[0]], push, (n_heads, n_tokens, 1))

    def _attention_split(self, qv, qo, kv, ko, vv, vo, pv, po, ov, oo, tmp, n_heads, n_kv_heads, head_dim, ctx,
                         scale, window, softcap=0.0, sink=None, split=(1, 0, 0, 0, 0)) -> bool:
        """Query tokens of decode (one, or one of each of several sequences: `split` =
        (n_tokens, q_stride, o_stride, seq offset, rows per sequence or 0)): each token's
        keys in ranges: by default (decode_attn "new") a work group per (KV head, block of
        its q heads, range, token) with the ranges by the keys alone (attention_dec.glsl's
        variants, dec_kernel; head_dim a multiple of 8 up to 256, else the old forms); the
        old forms a work group per (head, range, token) (attention_split.comp; for
        grouped-query heads, 2 to 16 per KV head, a work group per (KV head, range, token)
        that reads each K/V row once for the group's heads: attention_split_gqa.comp), then
        a merge per (head, token) (attention_merge.comp), with the partial states in `tmp`
        (f32 scratch the caller does not need across this op).  False when tmp cannot
        hold even one range per head (the caller then runs attention.comp)."""
        n_tokens, q_stride, o_stride, so, seq_rows = split
        stride = head_dim + 2
        cap = _nbytes(tmp) // (4 * n_tokens * n_heads * stride)
        keys = min(ctx, window) if window > 0 else ctx
        group = n_heads // n_kv_heads
        dec = dec_kernel(head_dim)
        if (self.decode_attn == "new" and dec and ko % 4 == 0 and vo % 4 == 0 and n_tokens <= self.max_groups[2]
                and self.subgroup_size >= 8):   # its key lanes: 8 invocations of one subgroup
            nc = int(dec[-3])   # attention_dec_n<NC>g<MAXG>
            dec += "_qs" if self.dec_q == "shared" else ""
            # The long-context form (attention_dec.glsl): a work group per (KV head, block of
            # 8 / nc of its q heads, range, token); the ranges by the keys alone, at least one
            # trip of keys each (batch invariance: the tokens sharing the step change nothing,
            # unless tmp is too small for them, which the model's scratch is not).
            units = n_kv_heads * -(-group // (8 // nc))
            n_splits = min(-(-keys // _DEC_KEYS[nc]), max(1, self.dec_groups // units), cap, self.max_groups[1])
            if n_splits >= 1 and units <= self.max_groups[0]:
                return self._split_dispatch(dec, units, n_splits, keys, split, qv, qo, kv, ko, vv, vo,
                                            pv, po, ov, oo, tmp, n_heads, n_kv_heads, head_dim, ctx, scale, window,
                                            softcap, sink)
        # Grouped-query heads by KV head: each K/V row read once for the group's q heads.
        gqa = self.split_gqa and 2 <= group <= _GQA_MAX_GROUP and group * head_dim // 2 <= _GQA_MAX_WORDS
        units = n_kv_heads if gqa else n_heads   # work groups per range
        # the work groups aimed at are shared by the tokens (one token: as before)
        n_splits = min(-(-keys // _SPLIT_KEYS), max(1, _SPLIT_GROUPS // (units * n_tokens)), cap,
                       self.max_groups[1])
        if n_splits < 1 or n_tokens > self.max_groups[2]:
            return False
        name = "attention_split_gqa" if gqa else "attention_split"
        return self._split_dispatch(name, units, n_splits, keys, split, qv, qo, kv, ko, vv, vo, pv, po, ov, oo, tmp,
                                    n_heads, n_kv_heads, head_dim, ctx, scale, window, softcap, sink)

    def _split_dispatch(self, name, units, n_splits, keys, split, qv, qo, kv, ko, vv, vo, pv, po, ov, oo, tmp,
                        n_heads, n_kv_heads, head_dim, ctx, scale, window, softcap, sink) -> bool:
        """Records the split kernel `name` ((units, n_splits, tokens) work groups, the
        contract of attention_split.comp) and the merge; True."""
        n_tokens, q_stride, o_stride, so, seq_rows = split
        stride = head_dim + 2
        chunk = -(-keys // n_splits)
        tv, to = self._bind(tmp, 4 * n_tokens * n_heads * n_splits * stride, "attention partials")
        push = struct.pack("<13I2f3I", n_heads, n_kv_heads, head_dim, qo, ko, vo, n_kv_heads * head_dim // 2, po, to,
                           ctx, int(window), chunk, n_splits, scale, softcap, q_stride, so, seq_rows)
        self._dispatch(self._kernel(name), [qv, kv, vv, pv, tv], push, (units, n_splits, n_tokens))
        sink = sink or (pv, po, 0)   # (view, float offset, has_sink): see attention
        self._dispatch(self._kernel("attention_merge"), [tv, ov, sink[0]],
                       struct.pack("<7I", head_dim, n_splits, to, oo, sink[2], sink[1], o_stride),
                       (n_heads, 1, n_tokens))
        return True

    def silu_mul(self, gate, up, out, n: int) -> None:
        """out[i] = silu(gate[i]) * up[i], i < n (f32; out may be gate or up)."""
        gv, go = self._bind(gate, 4 * n, "silu_mul gate")
        uv, uo = self._bind(up, 4 * n, "silu_mul up")
        ov, oo = self._bind(out, 4 * n, "silu_mul out")
        self._dispatch(self._kernel("silu_mul"), [gv, uv, ov], struct.pack("<4I", n, go, uo, oo),
                       self._groups1d(n, self.max_groups))

    def swiglu_oai(self, gate, up, out, n: int, alpha: float, limit: float) -> None:
        """out[i] = min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, +-limit) + 1), i < n
        (gpt-oss's clamped SwiGLU; f32; out may be gate or up)."""
        gv, go = self._bind(gate, 4 * n, "swiglu_oai gate")
        uv, uo = self._bind(up, 4 * n, "swiglu_oai up")
        ov, oo = self._bind(out, 4 * n, "swiglu_oai out")
        self._dispatch(self._kernel("swiglu_oai"), [gv, uv, ov], struct.pack("<4I2f", n, go, uo, oo, alpha, limit),
                       self._groups1d(n, self.max_groups))

    def add_id(self, y, bias, ids, n_slots: int, width: int, n_expert: int) -> None:
        """y[s, :] += bias[ids[s], :] for s < n_slots (f32 rows of `width`; bias
        [n_expert, width]; ids uint32 per slot, e.g. moe_route's): per-expert biases."""
        yv, yo = self._bind(y, 4 * n_slots * width, "add_id y")
        bv, bo = self._bind(bias, 4 * n_expert * width, "add_id bias")
        iv, io = self._bind(ids, 4 * n_slots, "add_id ids")
        self._dispatch(self._kernel("add_id"), [yv, bv, iv], struct.pack("<5I", n_slots, width, yo, bo, io),
                       self._groups1d(n_slots * width, self.max_groups))

    def add(self, a, b, out, n: int, b_len: int | None = None) -> None:
        """out[i] = a[i] + b[i % b_len], i < n (f32).  b_len = n (default):
        a residual add; b_len = width: a bias broadcast over token rows.
        out may be a or b."""
        b_len = n if b_len is None else int(b_len)
        if not 0 < b_len <= n:
            raise UsageError(f"add: b_len {b_len} for n {n}")
        av, ao = self._bind(a, 4 * n, "add a")
        bv, bo = self._bind(b, 4 * b_len, "add b")
        ov, oo = self._bind(out, 4 * n, "add out")
        self._dispatch(self._kernel("add"), [av, bv, ov], struct.pack("<5I", n, ao, bo, b_len, oo),
                       self._groups1d(n, self.max_groups))

    def scale(self, a, out, n: int, s: float) -> None:
        """out[i] = a[i] * s, i < n (f32; out may be a)."""
        av, ao = self._bind(a, 4 * n, "scale a")
        ov, oo = self._bind(out, 4 * n, "scale out")
        self._dispatch(self._kernel("scale"), [av, ov], struct.pack("<3If", n, ao, oo, s),
                       self._groups1d(n, self.max_groups))

    def gelu_mul(self, gate, up, out, n: int) -> None:
        """out[i] = gelu(gate[i]) * up[i], i < n (f32; out may be gate or up);
        gelu is ggml's tanh approximation 0.5 g (1 + tanh(sqrt(2/pi) (g +
        0.044715 g^3))) (Gemma's FFN).  Same bindings as silu_mul."""
        gv, go = self._bind(gate, 4 * n, "gelu_mul gate")
        uv, uo = self._bind(up, 4 * n, "gelu_mul up")
        ov, oo = self._bind(out, 4 * n, "gelu_mul out")
        self._dispatch(self._kernel("gelu_mul", "silu_mul"), [gv, uv, ov], struct.pack("<4I", n, go, uo, oo),
                       self._groups1d(n, self.max_groups))

    def softcap(self, a, out, n: int, cap: float) -> None:
        """out[i] = cap * tanh(a[i] / cap), i < n (f32; out may be a): final
        logit soft-capping.  Same bindings as scale."""
        if not cap > 0:
            raise UsageError(f"softcap: cap {cap} must be positive")
        av, ao = self._bind(a, 4 * n, "softcap a")
        ov, oo = self._bind(out, 4 * n, "softcap out")
        self._dispatch(self._kernel("softcap", "scale"), [av, ov], struct.pack("<3If", n, ao, oo, cap),
                       self._groups1d(n, self.max_groups))

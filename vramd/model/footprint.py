"""What a model needs, on the device and on the host, exactly as `vramd serve` allocates it.

Owns: `footprint()`, the one place that sizes a model's regions (weights with
the `--n-cpu-moe` placement, KV cache, compute scratch, the `--mmproj`
encoder and its activations), and `packed_bytes()`, the device bytes the
residency core makes of a region's tensors.  `vramd serve` lays its regions
out from a `Footprint` (and picks `--n-cpu-moe auto` with it); `vramd plan`
prints one.  So the two cannot disagree about what fits a `--vram-budget`
(they did: plan sized scratch as a llama model's, 918,784 B for a small MoE
model whose daemon allocated 332,800 B).

The engine calls (`spec_for`, `scratch_layout`) live here only: which
forward pass runs a file, and the scratch it asks for, is the engine's to say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramd.errors import UsageError, VramdError
from vramd.model import loader, placement

# The residency core's packing (native/src/region.c, vramd_region_seal), for a device whose limits
# are not known here (`vramd plan` opens none): tensors start at multiples of the storage alignment
# (at least 256 B), blocks ramp up from 16 MiB to `block_bytes` and are rounded to the granule
# (64 KiB, or the host-import alignment when larger: no device vramd has met has a larger one).
MIN_ALIGN = 256
GRANULE = 64 << 10
RAMP_START = 16 << 20
RAMP_BLOCKS = 8
DEFAULT_LIMITS = {"storage_alignment": MIN_ALIGN, "block_bytes": 256 << 20, "max_allocation": 1 << 62}


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def packed_bytes(layout, limits: dict | None = None) -> int:
    """Device bytes (and, for kinds with a shadow, host bytes) of a region holding `layout`
    [(name, nbytes)] as the residency core packs it: `Region.info()["bytes"]`.  `limits`:
    `Residency.limits` of the device, else DEFAULT_LIMITS."""
    lim = limits or DEFAULT_LIMITS
    align = max(lim["storage_alignment"], MIN_ALIGN)
    target_max, max_alloc = lim["block_bytes"], lim["max_allocation"]
    blocks = used = total = 0
    for _name, nbytes in layout:
        at = _round_up(used, align)
        target = target_max
        if 0 < blocks <= RAMP_BLOCKS and (RAMP_START << (blocks - 1)) < target:
            target = RAMP_START << (blocks - 1)
        if blocks == 0 or (used > 0 and at + nbytes > target) or _round_up(at + nbytes, GRANULE) > max_alloc:
            if blocks:
                total += _round_up(used, GRANULE)
            blocks += 1
            at = 0
        used = at + nbytes
    return total + (_round_up(used, GRANULE) if blocks else 0)


@dataclass
class Footprint:
    """A model's regions as `vramd serve` lays them out, and their bytes."""
    ctx: int
    plan: placement.Plan                     # each tensor's placement (device or host)
    layouts: dict[str, list[tuple[str, int]]] = field(default_factory=dict)   # region -> [(tensor, bytes)]
    limits: dict = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    runnable: bool = True                    # False: the engine does not run it; scratch is the loader's estimate
    chunk: int | None = None                 # tokens per prefill chunk the scratch holds (None: not runnable)
    max_buffer: int = 128 << 20              # the bytes of one activation buffer the chunk was cut to
                                             # (vramd/engine/scratch.py's buffer_cap)
    max_buffer_source: str = "assumed"       # "device" (its limits), "given" (--max-buffer) or "assumed"
                                             # (no device: lavapipe's, the Vulkan minimum)

    # The regions, their kind, and whether they have a host shadow.
    REGIONS = {"weights": "weights", "kv": "state", "scratch": "scratch", "encoder": "encoder",
               "encoder_scratch": "scratch"}

    @property
    def host_tensors(self) -> list[str]:
        """The expert tensors kept in host memory (--n-cpu-moe), outside the residency swap."""
        return [t["name"] for t in self.plan.tensors if t["placement"] == "host"]

    @property
    def recurrent_bytes(self) -> int:
        """The state region's part that is a recurrent state (qwen35's DeltaNet layers: conv and
        delta-rule state and their checkpoint), not K/V: tensor bytes."""
        return sum(n for name, n in self.layouts.get("kv", ()) if name.startswith("rec_"))

    def region_bytes(self, region: str) -> int:
        layout = self.layouts.get(region)
        return packed_bytes(layout, self.limits) if layout else 0

    @property
    def device(self) -> dict[str, int]:
        """Device bytes of each kind while the model serves text (the breakdown of a warm daemon
        after a request); the encoder's while it encodes, its activations in `encode_scratch`."""
        return {"weights": self.region_bytes("weights"), "state": self.region_bytes("kv"),
                "encoder": self.region_bytes("encoder"), "scratch": self.region_bytes("scratch")}

    @property
    def device_bytes(self) -> int:
        """What going warm brings to the device: weights, state and scratch (the budget's check)."""
        d = self.device
        return d["weights"] + d["state"] + d["scratch"]

    @property
    def encode_scratch(self) -> int:
        return self.region_bytes("encoder_scratch")

    @property
    def host(self) -> dict[str, int]:
        """Host bytes: each region's shadow (scratch has none), and the host experts."""
        return {"weights": self.region_bytes("weights"), "state": self.region_bytes("kv"),
                "encoder": self.region_bytes("encoder"), "scratch": 0, "experts": self.plan.host_bytes}

    def to_json(self) -> dict:
        d = self.device
        return {"n_cpu_moe": self.plan.n_cpu_moe, "has_experts": self.plan.has_experts, "ctx": self.ctx,
                "prefill_chunk": self.chunk, "max_buffer_bytes": self.max_buffer,
                "max_buffer_source": self.max_buffer_source,
                "runnable": self.runnable, "tensors": self.plan.tensors,
                "device_weight_bytes": d["weights"], "kv_bytes": d["state"], "scratch_bytes": d["scratch"],
                "recurrent_state_bytes": self.recurrent_bytes,
                "device_bytes": self.device_bytes, "host_bytes": sum(self.host.values()),
                "encoder_bytes": d["encoder"], "encode_scratch_bytes": self.encode_scratch,
                "device": d, "host": self.host,
                "regions": {r: {"kind": self.REGIONS[r], "tensors": len(lay),
                                "tensor_bytes": sum(n for _t, n in lay), "bytes": self.region_bytes(r)}
                            for r, lay in self.layouts.items()}}


def footprint(mf, ctx: int, *, n_cpu_moe=None, budget: int | None = None, mmproj=None,
              limits: dict | None = None, chunk: int | None = None, max_buffer: int | None = None,
              n_seq: int = 1) -> Footprint:
    """What model `mf` (a validated ModelFile) needs at `ctx`, as `vramd serve` allocates it.

    n_cpu_moe: None (every tensor on the device), a number of layers (float, or the flag's
    text: "1.5", "4/3") or "auto": the smallest that fits `budget` device bytes (a UsageError
    if nothing does).  mmproj: the --mmproj ModelFile, validated.  limits: the device's
    `Residency.limits` (serve has them; plan assumes DEFAULT_LIMITS).  chunk:
    --prefill-chunk, the tokens per prefill chunk the scratch is laid out for
    (None: the architecture's default; vramd/engine/scratch.py's chunk_tokens), cut so that
    no activation buffer passes `max_buffer` bytes (plan's --max-buffer; None: the device's
    maxStorageBufferRange from `limits`, else the conservative BUFFER_BYTES).  n_seq: the
    sequences (parallel slots) the KV cache holds, each of ctx positions (loader.kv_shape)."""
    from vramd.engine.arch import spec_for
    from vramd.engine.scratch import buffer_cap, chunk_tokens, scratch_layout
    lim = dict(limits or DEFAULT_LIMITS)
    cap = buffer_cap(limits) if max_buffer is None else int(max_buffer)
    source = ("given" if max_buffer is not None else
              "device" if limits and "max_storage_range" in limits else "assumed")
    try:
        spec = spec_for(mf)
        runnable = True
    except VramdError:  # serve refuses it; the loader's estimate stands in (what it lays out without an engine)
        scratch, runnable, tokens = [("compute", loader.scratch_bytes(mf))], False, None
    if runnable:
        tokens = chunk_tokens(spec, chunk, cap)
        scratch = scratch_layout(spec, tokens, cap=cap)
    shape = loader.kv_shape(mf, ctx, n_seq)
    kv = loader.kv_layout(shape) if shape is not None else []
    kv_dev, scratch_dev = packed_bytes(kv, lim) if kv else 0, packed_bytes(scratch, lim)

    def measure(p: placement.Plan) -> int:   # device bytes as the core packs them
        return packed_bytes(_device_layout(p), lim) + kv_dev + scratch_dev

    n = placement.parse_n_cpu_moe(0 if n_cpu_moe is None else n_cpu_moe)
    if n == "auto":
        if budget is None:
            raise UsageError("--n-cpu-moe auto needs a device budget (--vram-budget)")
        p = placement.smallest_fit(mf, budget, kv_dev, scratch_dev, measure=measure)
    else:
        p = placement.plan(mf, n, kv_dev, scratch_dev)
    layouts = {"weights": _device_layout(p), "kv": kv, "scratch": scratch}
    if mmproj is not None:
        from vramd.engine.vision import layouts as encoder_layouts
        from vramd.model.mmproj import load_mmproj
        layouts["encoder"], layouts["encoder_scratch"] = encoder_layouts(mmproj, *load_mmproj(mmproj))
    return Footprint(ctx, p, {r: lay for r, lay in layouts.items() if lay}, lim, runnable, tokens, cap, source)


def _device_layout(p: placement.Plan) -> list[tuple[str, int]]:
    return [(t["name"], t["bytes"]) for t in p.tensors if t["placement"] == "device"]


DEFAULT_CTX = 4096       # a file that does not say its context length
CTX_STEP = 256           # the context --ctx auto picks is a multiple of this (or the file's own)


def file_context_length(mf) -> int | None:
    """What the file says it was trained for: `<arch>.context_length`."""
    return loader.arch_int(mf, "context_length")


def auto_ctx(mf, budget: int, *, n_cpu_moe=None, limits: dict | None = None,
             chunk: int | None = None) -> tuple[int, str]:
    """--ctx's default: the file's context length, or the largest multiple of CTX_STEP below it
    whose KV cache fits `budget` with the weights and scratch.  Returns (ctx, why): the one line
    the daemon logs.  A model whose weights leave no room for CTX_STEP gets CTX_STEP (its restore
    then says what does not fit)."""
    trained = file_context_length(mf)
    cap = trained if trained and trained > 0 else DEFAULT_CTX
    cap = min(cap, 1 << 20)
    said = f"the file's context length {trained}" if trained else f"the file says no context length: {DEFAULT_CTX}"

    def fits(ctx: int) -> bool:
        return footprint(mf, ctx, n_cpu_moe=n_cpu_moe, limits=limits, chunk=chunk).device_bytes <= budget

    if fits(cap):
        return cap, f"{said}; its KV cache fits the budget of {budget} bytes"
    lo, hi = 0, cap // CTX_STEP          # multiples of CTX_STEP: lo fits (0: none does), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * CTX_STEP):
            lo = mid
        else:
            hi = mid
    ctx = max(lo, 1) * CTX_STEP
    return min(ctx, cap), (f"the largest whose KV cache fits the budget of {budget} bytes with the weights "
                           f"and scratch ({said}); give --ctx to choose")
